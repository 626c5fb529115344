"""A one-token decode step with fixed shapes for a llama-family model that lives entirely on one device
(gpt-fast's recipe): every buffer preallocated, the position a device tensor, the KV cache written in
place at that position, attention over a length mask in the cache's dtype, the firing counts kept on the
device. Nothing in a step reads a device value on the host, so on CUDA the whole step is captured once per
KV cache in a CUDA graph and replayed per token; the only host traffic per token is the token's embedding
row in and one copy of [logits, firing counts] out.

Per layer eight kernel launches with the fused Triton kernels (kernels/triton_decode.py):
qkv + norm + RoPE + KV write, attention, o projection + residual, then for a sparse FFN the predictor's
fc1 (writing the normed FFN input on the side), fc2 + threshold -> mask + count, gate/up of the firing
rows, down_t axpy, sum + residual. `TorchKernels` is the same step in plain torch ops (fixed shapes, no
syncs): the reference the fused kernels are tested against, and the fallback where Triton is missing.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLayer:
    """One layer's tensors on the step's device: float matrices [rows, D] row-major, float32 vectors."""

    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [qd + 2 kvd, D]: q, k, v rows (q and k in the GGUF order: RoPE on adjacent pairs)
    wo: torch.Tensor  # [D, qd]
    ffn_norm: torch.Tensor  # [D]
    up: torch.Tensor  # [F, D]
    gate: torch.Tensor  # [F, D]
    down_t: torch.Tensor | None  # [F, D] (sparse files), or
    down: torch.Tensor | None  # [D, F] (dense layout)
    fc1: torch.Tensor | None = None  # [R, D]: the predictor (None: dense FFN)
    fc2: torch.Tensor | None = None  # [F, R]
    threshold: float = 0.0


@dataclass(frozen=True)
class StepShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    kind: str  # "gated" | "gated_both"
    activation: str  # "relu" | "silu"
    window: int = 0  # sliding window (0: none)


class TorchKernels:
    """The fused kernels' contracts in torch ops: fixed shapes, results written into the given buffers."""

    @staticmethod
    def _norm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean() + eps) * w

    def gemv(self, w, x, *, out, norm=None, eps=0.0, residual=None, relu=False, threshold=None,
             mask_out=None, count=None, normed_out=None):  # fmt: skip
        if normed_out is not None:
            normed_out.copy_(self._norm(x, norm, eps))
            norm = None
        h = self._norm(x, norm, eps) if norm is not None else x
        y = F.linear(h.to(w.dtype), w).float() if w.dtype != torch.float32 else F.linear(h, w)
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

    def gate_up(self, gate, up, h, mask, a_out, *, kind, activation, norm=None, eps=0.0):
        act = torch.relu if activation == "relu" else F.silu
        hw = (self._norm(h, norm, eps) if norm is not None else h).to(up.dtype)
        g = act(F.linear(hw, gate).float())
        u = F.linear(hw, up).float()
        a = g * (act(u) if kind == "gated_both" else u)
        return a_out.copy_(a if mask is None else torch.where(mask != 0, a, 0.0))

    def down_axpy(self, down_t, a, residual, partial, out):
        return out.copy_(residual + (a.to(down_t.dtype) @ down_t).float())

    @staticmethod
    def partial_rows(down_t: torch.Tensor) -> int:
        return 1


def triton_kernels():
    """The fused Triton kernels as an object with TorchKernels' methods (imports triton)."""
    from hotcold.kernels import triton_decode as td

    class TritonKernels:
        gemv = staticmethod(td.gemv)
        qkv_rope = staticmethod(td.qkv_rope)
        attention = staticmethod(td.attention)
        gate_up = staticmethod(td.gate_up)
        down_axpy = staticmethod(td.down_axpy)

        @staticmethod
        def partial_rows(down_t: torch.Tensor) -> int:
            return td.axpy_splits(down_t, down_t.device)[0]

    return TritonKernels()


class _Buffers:
    """Everything one step writes besides the KV cache, preallocated on the device."""

    def __init__(self, layers: list[StepLayer], shape: StepShape, n_vocab: int, device, partial_rows: int):
        D = layers[0].wo.shape[0]
        n_ff = max(layer.up.shape[0] for layer in layers)
        rank = max((layer.fc1.shape[0] for layer in layers if layer.fc1 is not None), default=1)
        f32 = dict(dtype=torch.float32, device=device)
        self.x = torch.zeros(D, **f32)  # the residual stream; the embedding row comes in here
        self.x2 = torch.zeros(D, **f32)
        self.h = torch.zeros(D, **f32)  # the normed FFN input
        self.q = torch.zeros(shape.n_head * shape.head_dim, **f32)
        self.attn = torch.zeros_like(self.q)
        self.r = torch.zeros(rank, **f32)  # the predictor's hidden layer
        self.a = torch.zeros(n_ff, **f32)  # the FFN's activations (0 where a neuron did not fire)
        self.mask = torch.zeros(n_ff, dtype=torch.int8, device=device)
        self.partial = torch.zeros(partial_rows, D, **f32)
        # what comes back to the host each token, in one copy: logits [V], then per-layer firing counts
        self.result = torch.zeros(n_vocab + len(layers), **f32)
        self.logits = self.result[:n_vocab]
        self.counts = self.result[n_vocab:].view(torch.int32)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)


class StaticDecoder:
    """The fixed-shape decode step over `layers` on one device; `head_norm` [D], `head` [V, D]; `cos`/`sin`
    [n_ctx, Dh/2] float32 RoPE tables. kernels: "triton" or "torch"."""

    def __init__(self, layers: list[StepLayer], shape: StepShape, head_norm, head, cos, sin, *,
                 kernels: str = "triton", capture: bool | None = None):  # fmt: skip
        self.layers, self.shape = layers, shape
        self.head_norm, self.head = head_norm, head
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self.device = head.device
        self.fused = kernels == "triton"
        self.kernels = triton_kernels() if self.fused else TorchKernels()
        self.n_ff = [layer.up.shape[0] for layer in layers]
        self.sparse = [layer.fc1 is not None for layer in layers]
        self._lock = threading.Lock()  # one set of buffers: one step at a time (server slots share a model)
        sparse = [layer.down_t for layer in layers if layer.down_t is not None]
        rows = max((self.kernels.partial_rows(d) for d in sparse), default=1)
        self.buf = _Buffers(layers, shape, head.shape[0], self.device, rows)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KV cache -> CUDA graph
        self._host = torch.zeros(self.buf.result.shape, dtype=torch.float32, pin_memory=self.capture)

    def run(self, k_caches, v_caches) -> None:
        """One step on the buffers: x (the embedding row) and pos in, result (logits, counts) out."""
        b, s, k = self.buf, self.shape, self.kernels
        qd = s.n_head * s.head_dim
        kvd = s.n_head_kv * s.head_dim
        b.counts.zero_()
        for i, layer in enumerate(self.layers):
            k.qkv_rope(layer.wqkv, b.x, layer.attn_norm, s.eps, b.pos, self.cos, self.sin, b.q,
                       k_caches[i], v_caches[i], n_q=qd, n_kv=kvd)  # fmt: skip
            k.attention(b.q, k_caches[i], v_caches[i], b.pos, b.attn, n_head=s.n_head, head_dim=s.head_dim,
                        window=s.window)  # fmt: skip
            k.gemv(layer.wo, b.attn, out=b.x2, residual=b.x)  # x2 = x + attention's output
            n_ff = layer.up.shape[0]
            a = b.a[:n_ff]
            if layer.fc1 is not None:
                r = b.r[: layer.fc1.shape[0]]
                mask = b.mask[:n_ff]
                k.gemv(layer.fc1, b.x2, out=r, relu=True, norm=layer.ffn_norm, eps=s.eps, normed_out=b.h)
                k.gemv(
                    layer.fc2, r, out=r, threshold=layer.threshold, mask_out=mask, count=b.counts[i : i + 1]
                )
                k.gate_up(layer.gate, layer.up, b.h, mask, a, kind=s.kind, activation=s.activation)
            else:  # dense FFN: every row, the norm computed inside the gate/up kernel
                k.gate_up(layer.gate, layer.up, b.x2, None, a, kind=s.kind, activation=s.activation,
                          norm=layer.ffn_norm, eps=s.eps)  # fmt: skip
            if layer.down_t is not None:
                k.down_axpy(layer.down_t, a, b.x2, b.partial, b.x)
            else:
                k.gemv(layer.down, a, out=b.x, residual=b.x2)
        k.gemv(self.head, b.x, out=b.logits, norm=self.head_norm, eps=s.eps)

    def step(self, kv, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, list[int]]:
        """One token: its embedding row x [D] (on the host) at `pos` of the sequence whose cache is `kv`
        (state.KVCache on this device) -> (logits [V] float32 on the host, firing counts per layer)."""
        with self._lock:
            return self._step(kv, x, pos)

    def _step(self, kv, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, list[int]]:
        if pos >= self.cos.shape[0] or pos >= kv.n_ctx:
            raise ValueError(
                f"position {pos} is past the context ({min(kv.n_ctx, self.cos.shape[0])} tokens)"
            )
        b = self.buf
        if self.capture:
            b.x.copy_(x, non_blocking=True)
            b.pos.fill_(pos)
            graph = self._graphs.get(kv)
            if graph is None:  # the first step of this cache runs eagerly, then the step is captured
                self._graphs[kv] = self._run_and_capture(kv)
            else:
                graph.replay()
            self._host.copy_(b.result, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the one wait of the token
        else:
            b.x.copy_(x)
            b.pos.fill_(pos)
            self.run(kv.k, kv.v)
            self._host.copy_(b.result)
        n_vocab = self.head.shape[0]
        return self._host[:n_vocab].clone(), self._host[n_vocab:].view(torch.int32).tolist()

    def _run_and_capture(self, kv):
        """This token's step run eagerly on a side stream (also the warm-up CUDA graphs want before a
        capture), then a CUDA graph of the same step over this cache's tensors (their addresses are baked in)."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.run(kv.k, kv.v)
            with torch.cuda.graph(graph, stream=stream):
                self.run(kv.k, kv.v)
        current.wait_stream(stream)
        return graph


# ------------------------------------------------------------------------------------------------
# From a loaded model
# ------------------------------------------------------------------------------------------------


def _float_on(t, device: torch.device) -> bool:
    return isinstance(t, torch.Tensor) and t.device == device and t.dtype in (torch.float16, torch.bfloat16,
                                                                               torch.float32)  # fmt: skip


def from_model(
    model, *, kernels: str | None = None, capture: bool | None = None, ctx_size: int | None = None
):
    """(StaticDecoder, None) for a llama-family model whose every layer, FFN and head live on one device in
    float types, else (None, why not). Sparse layers must be all-hot (every neuron on that device)."""
    from hotcold.models.llama import Llama
    from hotcold.sparse.ffn import DenseFFN, SparseFFN
    from hotcold.sparse.hybrid import HybridFFN

    if type(model) is not Llama:
        return None, f"{type(model).__name__} models take the eager step"
    c = model.config
    device = model.head.device
    if c.rope_dim != c.head_dim or c.head_dim & (c.head_dim - 1):
        return None, "partial RoPE or a head size that is not a power of two"
    layers, kinds = [], set()
    for i, layer in enumerate(model.layers):
        ffn = layer.ffn
        if layer.device != device:
            return None, f"layer {i}'s attention is on {layer.device}, the head on {device}"
        if isinstance(ffn, HybridFFN) and ffn.all_hot and ffn.device == device and ffn.norm is not None:
            w, pred = ffn.hot_weights, ffn.predictor
            fc1, fc2, thr = pred.fc1, pred.fc2, float(pred.threshold)
        elif isinstance(ffn, SparseFFN) and ffn.expert is None and ffn.norm is not None:  # the CPU stand-in
            w, pred = ffn.weights, ffn.predictor
            fc1, fc2, thr = pred.fc1, pred.fc2, float(pred.threshold)
        elif isinstance(ffn, DenseFFN) and ffn.norm is not None:
            w, fc1, fc2, thr = ffn.weights, None, None, 0.0
        else:
            return None, f"layer {i}'s FFN ({type(ffn).__name__}) is not all on {device}"
        if (
            w.kind not in ("gated", "gated_both")
            or w.activation not in ("relu", "silu")
            or w.up_bias is not None
        ):
            return None, f"layer {i}'s FFN kind {w.kind}/{w.activation} has no fused step"
        kinds.add((w.kind, w.activation))
        wq, wk, wv = layer.qkv.weights
        tensors = [wq, wk, wv, layer.wo, w.up, w.gate, w.down_t if w.down_t is not None else w.down]
        tensors += [fc1, fc2] if fc1 is not None else []
        if not all(_float_on(t, device) for t in tensors):
            return None, f"layer {i} has weights that are not float tensors on {device}"
        wqkv = torch.cat([wq, wk, wv])
        if layer.qkv.c_group is None:
            # the eager path (prefill) multiplies by views of the fused matrix, so the GPU holds q/k/v once;
            # a C group (CPU weights) keeps its own pointers and its matrices
            layer.qkv.weights[:] = list(torch.split(wqkv, [wq.shape[0], wk.shape[0], wv.shape[0]]))
        layers.append(
            StepLayer(
                attn_norm=layer.attn_norm.weight,
                wqkv=wqkv,
                wo=layer.wo,
                ffn_norm=ffn.norm.weight.to(device),
                up=w.up,
                gate=w.gate,
                down_t=w.down_t,
                down=w.down,
                fc1=fc1,
                fc2=fc2,
                threshold=thr,
            )
        )
    if len(kinds) != 1 or not _float_on(model.head.weight, device) or not model.layers[0].attn_norm.rms:
        return None, "mixed FFN kinds, a non-float head, or a LayerNorm model"
    kind, activation = kinds.pop()
    if kernels is None:
        kernels = "triton" if device.type == "cuda" and _triton_ok() else "torch"
    cos, sin = model.rope._covering(max(c.n_ctx_train, ctx_size or 0), device)
    shape = StepShape(c.n_head, c.n_head_kv, c.head_dim, model.layers[0].attn_norm.eps, kind, activation,
                      window=c.sliding_window or 0)  # fmt: skip
    decoder = StaticDecoder(layers, shape, model.head.norm.weight, model.head.weight, cos, sin,
                            kernels=kernels, capture=capture)  # fmt: skip
    return decoder, None


def _triton_ok() -> bool:
    try:
        from hotcold.kernels import triton as gpu
    except ImportError:
        return False
    return gpu.available()
