"""The fused decode kernels' contracts (kernels/triton_decode.py) in plain torch ops, for one token: fixed
shapes, results written into the buffers the caller gives, no host syncs. The reference the fused kernels are
tested against (on the CPU in float32), and decode_step's kernels where Triton is missing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows of a 16-bit matrix widened to float32 at a time: bounds the temporary copy (a 32000 x 4096 head
# widened whole would be 512 MiB, inside a CUDA graph's memory pool for good)
_WIDEN_BYTES = 64 << 20


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w @ x in float32 on every device, as the fused kernels compute it: 16-bit weights are widened (a
    block of rows at a time), the activations never rounded to fp16. (Multiplying in w's dtype on a GPU
    rounded x and the products' sums to fp16: ~0.46 predictor decisions a layer a token differed.)"""
    if w.dtype == torch.float32:
        return F.linear(x, w)
    x = x.float()
    rows = max(1, _WIDEN_BYTES // (4 * w.shape[1]))
    if w.shape[0] <= rows:
        return F.linear(x, w.float())
    return torch.cat([F.linear(x, w[i : i + rows].float()) for i in range(0, w.shape[0], rows)], dim=-1)


class TorchKernels:
    """The fused kernels' contracts in torch ops: fixed shapes, results written into the given buffers."""

    @staticmethod
    def _norm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean() + eps) * w

    def gemv(self, w, x, *, out, norm=None, eps=0.0, residual=None, relu=False, threshold=None,
             mask_out=None, count=None, normed_out=None, block_counts=None):  # fmt: skip
        if normed_out is not None:
            normed_out.copy_(self._norm(x, norm, eps))
            norm = None
        h = self._norm(x, norm, eps) if norm is not None else x
        y = _mm(h, w)
        if relu:
            y = torch.relu(y)
        if threshold is not None:
            fire = y >= threshold
            mask_out.copy_(fire)
            count.add_(fire.sum(dtype=torch.int32))
            return mask_out
        if residual is not None:
            y = y + residual
        return out.copy_(y)

    def qkv_rope(self, wqkv, x, norm, eps, pos, cos, sin, q_out, k_cache, v_cache, *, n_q, n_kv):
        y = self.gemv(wqkv, x, out=torch.empty(wqkv.shape[0], device=x.device), norm=norm, eps=eps)
        c, s = cos.index_select(0, pos)[0], sin.index_select(0, pos)[0]  # [Dh/2]
        half = c.shape[0]
        qk = y[: n_q + n_kv].view(-1, half, 2)
        a = qk[..., 0] * c - qk[..., 1] * s
        b = qk[..., 0] * s + qk[..., 1] * c
        qk = torch.stack((a, b), dim=-1).flatten()
        q_out.copy_(qk[:n_q])
        k_cache.view(k_cache.shape[0], -1).index_copy_(0, pos, qk[n_q:].view(1, -1).to(k_cache.dtype))
        v_cache.view(v_cache.shape[0], -1).index_copy_(0, pos, y[n_q + n_kv :].view(1, -1).to(v_cache.dtype))

    def attention(self, q, k_cache, v_cache, pos, out, *, n_head, head_dim, window=0):
        n_ctx, n_kv = k_cache.shape[0], k_cache.shape[1]
        n = torch.arange(n_ctx, device=q.device)
        live = n <= pos
        if window > 0:
            live = live & (n > pos - window)
        group = n_head // n_kv
        qh = (q * head_dim**-0.5).view(n_kv, group, head_dim)  # [Hkv, G, Dh]
        k = k_cache.float().transpose(0, 1)  # [Hkv, S, Dh]
        v = v_cache.float().transpose(0, 1)
        s = torch.where(live, qh @ k.transpose(1, 2), float("-inf"))  # [Hkv, G, S]
        out.copy_((torch.softmax(s, dim=-1) @ v).flatten())

    def gate_up(self, gate, up, h, mask, a_out, *, kind, activation, norm=None, eps=0.0, qtypes=(None, None),
                compact=None):  # fmt: skip
        act = torch.relu if activation == "relu" else F.silu
        hn = self._norm(h, norm, eps) if norm is not None else h
        g = act(_mm(hn, gate))
        u = _mm(hn, up)
        a = g * (act(u) if kind == "gated_both" else u)
        return a_out.copy_(a if mask is None else torch.where(mask != 0, a, 0.0))

    def down_axpy(self, down_t, a, residual, partial, out, *, qtype=None, compact=None):
        return out.copy_(residual + _mm(a, down_t.T))  # a @ down_t

    @staticmethod
    def compact(n_ff: int, device) -> None:
        """No compacted firing list here: `a` stays one value a row (block_counts and compact are the fused
        kernels' scratch, None for these)."""
        return None

    @staticmethod
    def partial_rows(layer) -> int:
        """Rows of the down_axpy scratch a layer (a decode_step.StepLayer) needs: none here."""
        return 1
