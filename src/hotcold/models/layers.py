"""Math shared by the model families: norms, RoPE, attention over a preallocated KV cache, linear layers
over any weight type. Pure functions of tensors; no device or placement decisions here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotcold.kernels import cpu
from hotcold.quants import QuantTensor

Weight = torch.Tensor | QuantTensor


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] float32 @ weight[F, D].T (+ bias) -> [T, F] float32, for float and block-quantized weights."""
    if isinstance(weight, torch.Tensor) and not uses_c_kernels(weight):  # float32 anywhere, or on a GPU
        out = (
            F.linear(x, weight)
            if weight.dtype == torch.float32
            else F.linear(x.to(weight.dtype), weight).float()
        )
    else:
        out = cpu.matmul(weight, x)
    if bias is not None:
        out = out + bias
    return out


class LinearGroup:
    """[linear(x, w) for w in weights] with the same bits, for weights that share x (a layer's q, k, v):
    CPU weights that the C kernels multiply (not float32) go in one call, so their rows stream in one
    pass of the threads. Keep one per layer: the C plan is built on first use (and again only if the
    weights are replaced)."""

    def __init__(self):
        self._key: tuple | None = None
        self._group = None

    def __call__(
        self, x: torch.Tensor, weights: list[Weight], *, norm: tuple[torch.Tensor, float] | None = None
    ) -> list[torch.Tensor]:
        """With norm = (weight, eps) the weights multiply rms_norm(x, weight, eps); for a few tokens the
        norm runs inside the same C call."""
        if self._key is None or any(a is not b for a, b in zip(weights, self._key, strict=True)):
            self._key, self._group = tuple(weights), None
            if all(uses_c_kernels(w) for w in weights) and cpu.backend() == "c":
                try:
                    self._group = cpu.MatvecGroup(weights)
                except ValueError:  # different widths or types without a kernel: one call each
                    pass
        if self._group is not None and x.device.type == "cpu":
            if norm is not None and x.shape[0] <= C_NORM_MAX_TOKENS:
                return self._group(x, norm=norm)
            return self._group(rms_norm(x, *norm) if norm is not None else x)
        h = rms_norm(x, *norm) if norm is not None else x
        return [linear(h, w) for w in weights]


def uses_c_kernels(weight: Weight) -> bool:
    """Whether `linear` multiplies by this weight with the C kernels (CPU, not float32): the one rule."""
    if isinstance(weight, torch.Tensor):
        return weight.device.type == "cpu" and weight.dtype != torch.float32
    return weight.data.device.type == "cpu"


C_NORM_MAX_TOKENS = 4  # up to this many tokens the RMS norm runs in C (one call, not five ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= C_NORM_MAX_TOKENS:
        out = cpu.rms_norm(x, weight, eps)
        if out is not None:
            return out
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rope_tables(n_ctx: int, rope_dim: int, base: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, rope_dim/2] for positions 0..n_ctx-1 (linear scaling multiplies positions by `scale`)."""
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * scale * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """x [T, H, Dh]; cos/sin [T, R/2]. Normal mode (llama.cpp, GGUF-permuted q/k) rotates adjacent pairs
    (0,1), (2,3)...; NEOX mode (Falcon, HF rotate-half) rotates (i, i + R/2). Dims past R pass through."""
    rope_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        x0, x1 = rot[..., : rope_dim // 2], rot[..., rope_dim // 2 :]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class KVCache:
    """Preallocated keys and values for one sequence: k[l], v[l] are [S, Hkv, Dh] on layer l's device;
    positions are explicit, so a decode step always has the same shapes."""

    def __init__(
        self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, *, dtype=torch.float32, devices=None
    ):
        self.n_ctx = n_ctx
        devices = devices or ["cpu"] * n_layer
        self.k = [torch.zeros(n_ctx, n_head_kv, head_dim, dtype=dtype, device=d) for d in devices]
        self.v = [torch.zeros(n_ctx, n_head_kv, head_dim, dtype=dtype, device=d) for d in devices]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    @classmethod
    def for_layers(cls, config, layers, n_ctx: int) -> KVCache:
        """One cache slice per layer, on that layer's device: fp16 when a GPU is involved (the budget counts
        2 bytes), fp32 on the CPU (the exact reference)."""
        devices = [layer.device for layer in layers]
        dtype = torch.float16 if any(d.type == "cuda" for d in devices) else torch.float32
        return cls(config.n_layer, n_ctx, config.n_head_kv, config.head_dim, dtype=dtype, devices=devices)


class RopeTables:
    """cos/sin tables per device, grown on demand past the training context."""

    def __init__(self, config):
        self.config = config
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, pos: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        cos, sin = self._tables.get(device, (None, None))
        if cos is None or pos + T > cos.shape[0]:
            n = max(pos + T, c.n_ctx_train)
            cos, sin = (t.to(device) for t in rope_tables(n, c.rope_dim, c.rope_base, c.rope_scale))
            self._tables[device] = (cos, sin)
        return cos[pos : pos + T], sin[pos : pos + T]


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    pos: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """apply_rope on q and k, then attention(): one C call for a decode step on the CPU."""
    if q.shape[0] == 1 and q.device.type == "cpu":
        if pos + 1 > cache.n_ctx:
            raise ValueError(f"context overflow: position {pos + 1} exceeds the context size {cache.n_ctx}")
        out = cpu.attention_decode(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cache.k[layer],
            cache.v[layer],
            pos,
            cos,
            sin,
            neox=neox,
            sliding_window=sliding_window,
        )
        if out is not None:
            return out
    q, k = apply_rope(q, cos, sin, neox=neox), apply_rope(k, cos, sin, neox=neox)
    return attention(q, k, v, cache, layer, pos, sliding_window=sliding_window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    pos: int,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, H, Dh], k/v [T, Hkv, Dh] for positions pos..pos+T-1; writes k/v into the cache and attends over
    positions 0..pos+T-1 causally. Returns [T, H*Dh]."""
    T, H, Dh = q.shape
    end = pos + T
    if end > cache.n_ctx:
        raise ValueError(f"context overflow: position {end} exceeds the context size {cache.n_ctx}")
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache[pos:end] = k.to(k_cache.dtype)
    v_cache[pos:end] = v.to(v_cache.dtype)
    keys = k_cache[:end].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, S, Dh]
    values = v_cache[:end].to(q.dtype).transpose(0, 1)[None]
    mask = None
    if T > 1 or sliding_window:
        q_pos = torch.arange(pos, end, device=q.device)[:, None]
        k_pos = torch.arange(end, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window:
            mask = mask & (k_pos > q_pos - sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != H
    )  # [1, H, T, Dh]
    return out[0].transpose(0, 1).reshape(T, H * Dh)
