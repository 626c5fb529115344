"""The C decode-step glue on the CPU: RMS norm, LayerNorm and attention (RoPE, KV cache write, GQA softmax
attention) for one token, or for the decode rows of a batch (each over its own cache), one call each
instead of a dozen small tensor ops per row, with their torch fallbacks.
`hotcold.kernels.cpu` re-exports them."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from hotcold.kernels import build
from hotcold.kernels.build import f32_contiguous, nthreads, ptr

__all__ = [
    "rms_norm",
    "layer_norm",
    "moe_route",
    "apply_rope",
    "attention_decode",
    "attention_decode_rows",
    "attention_explicit",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / sqrt(mean(x^2) + eps) * weight. One C call (float64 sum of squares) for a float32
    contiguous CPU x [T, D] and weight [D]; torch otherwise."""
    lib = build.get_lib()
    c_ok = x.dim() == 2 and weight.shape == x.shape[1:] and f32_contiguous(x) and f32_contiguous(weight)
    if lib is None or not c_ok:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    t, d = x.shape
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), weight.data_ptr(), eps, t, d, out.data_ptr())
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim. One C call (float64 mean and variance: hc_layer_norm, the LayerNorm of the
    one-call decode too) for a float32 contiguous CPU x [T, D] and weight / bias [D]; torch otherwise."""
    lib = build.get_lib()
    c_ok = (
        x.dim() == 2
        and weight.shape == x.shape[1:]
        and f32_contiguous(x)
        and f32_contiguous(weight)
        and (bias is None or (bias.shape == weight.shape and f32_contiguous(bias)))
    )
    if lib is None or not c_ok:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    t, d = x.shape
    out = torch.empty_like(x)
    lib.hc_layer_norm(x.data_ptr(), weight.data_ptr(), ptr(bias), eps, t, d, out.data_ptr())
    return out


GATINGS = {"softmax": 0, "sigmoid": 1}  # hc_moe_route's gating codes
SIGMOID_SUM_MIN = (
    6.103515625e-5  # upstream clamps the sum of the chosen sigmoids below at F16's smallest normal
)


def moe_route(logits: torch.Tensor, k: int, gating: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of logits [T, E]: its k largest (largest first) and the softmax over them, or (gating "sigmoid":
    SmallThinker) their sigmoids over their sum (at least SIGMOID_SUM_MIN) -> (ids [T, k] int64, weights [T, k]
    float32). One C call (hc_moe_route: the routing of the one-call decode too) for float32 CPU logits; torch's
    topk, softmax and sigmoid otherwise."""
    lib = build.get_lib()
    if lib is None or not (logits.dim() == 2 and logits.is_cpu and logits.dtype == torch.float32):
        top, ids = torch.topk(logits, k, dim=-1)
        if gating == "sigmoid":
            chosen = torch.sigmoid(top.float())
            return ids, chosen / chosen.sum(-1, keepdim=True).clamp(min=SIGMOID_SUM_MIN)
        return ids, torch.softmax(top, dim=-1)
    lg = logits.contiguous()
    t, e = lg.shape
    ids = torch.empty(t, k, dtype=torch.int64)
    weights = torch.empty(t, k, dtype=torch.float32)
    lib.hc_moe_route(lg.data_ptr(), t, e, k, GATINGS[gating], ids.data_ptr(), weights.data_ptr())
    return ids, weights


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """x [T, H, Dh], cos/sin [T, R/2]: normal mode rotates pairs (2j, 2j+1), neox (j, j + R/2); dims past R
    pass through (as rope_head in _cpu_kernels.c). The one torch RoPE: ops re-exports it for the models."""
    r = cos.shape[-1] * 2
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x0, x1 = (rot[..., : r // 2], rot[..., r // 2 :]) if neox else (rot[..., 0::2], rot[..., 1::2])
    a, b = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    out = torch.cat((a, b), dim=-1) if neox else torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """One token's attention: RoPE on q [1, H, Dh] and k [1, Hkv, Dh] (cos/sin [1, R/2], R <= Dh), k and v
    stored at row pos of the caches [S, Hkv, Dh], softmax(cap(q k^T / sqrt(Dh))) v (cap(s) = softcap *
    tanh(s / softcap) where softcap is set: Gemma 2) over rows 0..pos (the last
    `sliding_window` of them when given; query head h reads kv head h // (H / Hkv)) -> [1, H*Dh]. q and k
    are rotated in place. attention_decode_rows of one row: one C call when everything is float32 and
    contiguous on the CPU, else torch (scaled_dot_product_attention). ValueError('context overflow: ...')
    when pos is outside the cache."""
    return attention_decode_rows(
        q,
        k,
        v,
        [k_cache],
        [v_cache],
        [pos],
        cos,
        sin,
        neox=neox,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        threads=threads,
    )


def _torch_attention_decode(
    q, k, v, k_cache, v_cache, pos, cos, sin, neox, window, softcap=0.0, sinks=None
) -> torch.Tensor:
    """attention_decode in torch: the models' torch attention for one token (the window as a slice; a soft-cap
    on the scores as the models' explicit attention applies it)."""
    cos, sin = cos.reshape(1, -1), sin.reshape(1, -1)
    qr, kr = apply_rope(q, cos, sin, neox=neox), apply_rope(k, cos, sin, neox=neox)
    q.copy_(qr)
    k.copy_(kr)
    k_cache[pos] = kr[0].to(k_cache.dtype)
    v_cache[pos] = v[0].to(v_cache.dtype)
    lo = max(0, pos - window + 1) if window else 0
    keys = k_cache[lo : pos + 1].to(qr.dtype).transpose(0, 1)[None]  # [1, Hkv, S, Dh]
    values = v_cache[lo : pos + 1].to(qr.dtype).transpose(0, 1)[None]
    _, h, dh = q.shape
    if softcap or sinks is not None:  # the models' explicit attention (ops.attention's, for sinks and caps)
        return (
            attention_explicit(qr.transpose(0, 1), keys[0], values[0], None, sinks, softcap)
            .transpose(0, 1)
            .reshape(1, h * dh)
        )
    out = F.scaled_dot_product_attention(qr.transpose(0, 1)[None], keys, values, enable_gqa=h != k.shape[1])
    return out[0].transpose(0, 1).reshape(1, h * dh)


def attention_explicit(q, keys, values, mask, sinks: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """softmax([cap(q.k / sqrt(Dh)), sink]) without the sink's column, @ v: q [H, T, Dh], keys / values
    [Hkv, S, Dh], mask [T, S] bool or None -> [H, T, Dh] in q's dtype, computed in float32 (a GPU's fp16 cache
    too: torch ops, no fused kernel with sinks or caps yet). cap(s) = softcap * tanh(s / softcap) where softcap
    is set; no sink column where sinks is None. Query head h reads KV head h // (H / Hkv), without copying."""
    dtype = q.dtype
    q, keys, values = q.float(), keys.float(), values.float()
    (h, t, dh), hkv = q.shape, keys.shape[0]
    grouped = q.reshape(
        hkv, (h // hkv) * t, dh
    )  # [Hkv, group * T, Dh]: a KV head's query heads, one after another
    scores = (grouped @ keys.transpose(-1, -2)).view(h, t, -1) * dh**-0.5  # [H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).view(h, 1, 1).expand(h, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.reshape(hkv, -1, probs.shape[-1]) @ values).view(h, t, dh).to(dtype)


def attention_decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    positions: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """attention_decode for N tokens of N different sequences (a batched decode step): row n of q [N, H, Dh],
    k/v [N, Hkv, Dh] at positions[n] over caches k_caches[n] / v_caches[n], cos/sin [N, R/2] -> [N, H*Dh],
    each row exactly as it is computed alone. One C call when everything is float32 and contiguous on the
    CPU, else torch row by row."""
    n = q.shape[0] if q.dim() == 3 else 0
    h, dh, hkv = (q.shape[1], q.shape[2], k.shape[1]) if n and k.dim() == 3 else (0, 0, 0)
    # a prompt chunk's rows share one cache pair: each distinct pair is checked once
    pairs = {(id(kc), id(vc)): (kc, vc) for kc, vc in zip(k_caches, v_caches)}.values()
    caches_ok = len(k_caches) == len(v_caches) == len(positions) == n and all(
        kc.dim() == 3 and kc.shape[1:] == (hkv, dh) and vc.shape == kc.shape for kc, vc in pairs
    )
    if not (h and hkv) or k.shape != (n, hkv, dh) or v.shape != k.shape or not caches_ok or h % hkv:
        got = [tuple(t.shape) for t in (q, k, v, *k_caches[:1], *v_caches[:1])]
        raise ValueError(
            f"want q [N, H, Dh], k/v [N, Hkv, Dh], N caches [S, Hkv, Dh], Hkv | H; got {got}, {len(k_caches)} caches"
        )
    r = cos.shape[-1] * 2
    if cos.shape != (n, r // 2) or sin.shape != cos.shape or r > dh:
        raise ValueError(f"cos/sin {tuple(cos.shape)} are not one [R/2] row per position with R <= {dh}")
    for p, kc in zip(positions, k_caches):
        if not 0 <= p < kc.shape[0]:
            raise ValueError(f"context overflow: position {p + 1} exceeds the context size {kc.shape[0]}")
    window = sliding_window if sliding_window and sliding_window > 0 else 0
    lib = build.get_lib()
    cos, sin = cos.contiguous(), sin.contiguous()
    if lib is None or not all(f32_contiguous(t) for t in (q, k, v, cos, sin, *(c for p in pairs for c in p))):
        return torch.cat(
            [
                _torch_attention_decode(
                    q[j : j + 1],
                    k[j : j + 1],
                    v[j : j + 1],
                    k_caches[j],
                    v_caches[j],
                    positions[j],
                    cos[j : j + 1],
                    sin[j : j + 1],
                    neox,
                    window,
                    softcap,
                    sinks,
                )
                for j in range(n)
            ]
        )
    out = torch.empty(n, h * dh, dtype=torch.float32)
    kcs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in k_caches])
    vcs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in v_caches])
    pos = (ctypes.c_int64 * n)(*positions)
    tensors = (q.data_ptr(), k.data_ptr(), v.data_ptr(), kcs, vcs, pos)
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected [{h}] (one logit per query head)")
    sink = None if sinks is None else sinks.to(torch.float32).contiguous()
    rope = (r, cos.data_ptr(), sin.data_ptr(), int(neox), window, float(softcap), ptr(sink))
    rc = lib.hc_attn_decode_rows(n, *tensors, h, hkv, dh, *rope, out.data_ptr(), nthreads(threads))
    if rc != 0:
        raise MemoryError("hc_attn_decode_rows: out of memory")
    return out
