"""K-quant quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): ggml's reference algorithms in numpy.

The `gguf` package dequantizes every type but quantizes only the legacy 32-value blocks; this module
writes the 256-value super-blocks the way `llama-quantize` does without an importance matrix, i.e. the
same bytes as ggml's `quantize_row_q{2,3,4,5,6}_K_ref` (ggml-quants.c), which llama.cpp compiles in
plain float32 (ggml-base is built without -march, so without FMA contraction). Byte-exactness rests on
doing every float operation in the same order and precision as that C code:
  - every product and sum in float32, in the C expression's order (`w*x*l` is `(w*x)*l`);
  - every C accumulation loop (`s += t[i]`, starting from 0) as a sequential float32 sum:
    `np.add.reduce` over axis 0 of an [n, S] array adds row after row, never pairwise;
  - `nearest_int` is the 12582912 magic-number trick: round half to even, and for arguments that are
    known to be in range, `rint(clip(v))` gives the same integer (rounding is monotone);
  - reciprocals as ggml writes them (`d = 1/iscale`, not `max/-32`), fp16 rounding to nearest even.
Vectorised over super-blocks; Python loops run over sub-block elements and candidate scales only.

Algorithms (each sub-block gets a scale, plus a min for the "x" types):
  make_qkx2_quants (Q2_K, Q4_K, Q5_K): L = round((x - min) / scale) in 0..nmax; start from the
    min/max range, then try nstep+1 scales (rmin + rdelta*k + nmax)/(max - min), refit scale and
    min by weighted least squares and keep the one with the smallest weighted error (|diff| for Q2_K,
    diff^2 otherwise). Weights: |x| (Q2_K), sqrt(mean(x^2)) + |x| (Q4_K, Q5_K). The running min is
    updated when a candidate wins, and later candidates use it (as in the C code).
  make_qx_quants (Q6_K, rmse_type 1): symmetric L in -nmax..nmax-1, scale from x's largest-magnitude
    value, then 18 more candidate scales, weight x^2, keep the best least-squares fit.
  make_q3_quants (Q3_K): the same start, then up to 5 passes of coordinate descent on each L.
  Sub-block scales (and mins) are then quantized to 4/6/8 bits against one fp16 super-block scale,
  and x is requantized with the rounded scales.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

__all__ = ["TYPES", "quantize"]

QK_K = 256
TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
_F = np.float32
_ZERO = np.float32(0.0)
_MAGIC = np.float32(12582912.0)
_GROUP_MAX_EPS = np.float32(1e-15)
_CHUNK = 1024  # super-blocks per work item ([32, 8192] float32 temporaries, about a core's L2)


# ----------------------------------------------------------------------------------------------
# ggml's float helpers
# ----------------------------------------------------------------------------------------------
def _nearest_int(v: np.ndarray) -> np.ndarray:
    """float32 -> int32 exactly as ggml's nearest_int (also for out-of-range, inf and NaN arguments)."""
    v = np.asarray(v, dtype=np.float32)
    return ((v + _MAGIC).view(np.int32) & 0x007FFFFF) - 0x00400000


def _nint_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """MAX(lo, MIN(hi, nearest_int(v))) as float32, exact for any v."""
    return np.clip(_nearest_int(v), lo, hi).astype(np.float32)


def _rint_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The same for |v| <= 2**22 (the hot loops, where that bound holds), in place and faster."""
    np.clip(v, lo, hi, out=v)
    return np.rint(v, out=v)


def _round_clip(v: np.ndarray, lo: int, hi: int, in_range: bool) -> np.ndarray:
    """_rint_clip where every |v| <= 2**22 is known (in_range), else the exact _nint_clip (it gives
    ggml's answers for inf, NaN and huge arguments too, e.g. a scale that overflowed on tiny values)."""
    return _rint_clip(v, lo, hi) if in_range else _nint_clip(v, lo, hi)


def _sum(a: np.ndarray) -> np.ndarray:
    """[n, S] -> [S]: `float s = 0; for (i) s += a[i];` (sequential; `+ 0` turns an all -0 sum into +0)."""
    return np.add.reduce(a, axis=0) + _ZERO


def _fp16(v: np.ndarray) -> np.ndarray:
    """float32 -> fp16 bits as uint16 (round to nearest even, as GGML_FP32_TO_FP16)."""
    return np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint16)


def _fp32(h: np.ndarray) -> np.ndarray:
    return h.view(np.float16).astype(np.float32)


def _u16_bytes(h: np.ndarray) -> np.ndarray:
    """uint16 [N] -> uint8 [N, 2], little endian."""
    return np.ascontiguousarray(h.astype("<u2")).view(np.uint8).reshape(-1, 2)


def _running_max(a: np.ndarray) -> np.ndarray:
    """[N, k] -> [N]: `float m = 0; for (j) if (a[j] > m) m = a[j];` (+0 when nothing is larger, never -0)."""
    m = np.zeros(a.shape[0], np.float32)
    for j in range(a.shape[1]):
        m = np.where(a[:, j] > m, a[:, j], m)
    return m


def _running_absmax(a: np.ndarray) -> np.ndarray:
    """[N, k] -> [N]: `amax = 0; m = 0; for (j) if (fabsf(a[j]) > amax) { amax = fabsf(a[j]); m = a[j]; }`
    (NaN never wins, unlike np.argmax)."""
    amax = np.zeros(a.shape[0], np.float32)
    m = np.zeros(a.shape[0], np.float32)
    for j in range(a.shape[1]):
        take = np.abs(a[:, j]) > amax
        amax = np.where(take, np.abs(a[:, j]), amax)
        m = np.where(take, a[:, j], m)
    return m


def _abs_argmax(x: np.ndarray) -> np.ndarray:
    """[n, S] -> [S]: the value with the largest |x|, the first one on ties (`if (ax > amax)`)."""
    idx = np.argmax(np.abs(x), axis=0)
    return np.take_along_axis(x, idx[None], axis=0)[0]


def _sub_blocks(xb: np.ndarray, n: int) -> np.ndarray:
    """[N, 256] -> [n, N*256/n]: element index first, so that sums run over axis 0."""
    return np.ascontiguousarray(xb.reshape(-1, n).T)


# ----------------------------------------------------------------------------------------------
# per sub-block: scale (and min) search
# ----------------------------------------------------------------------------------------------
def _make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """x, w: [n, S] -> (L [n, S] float32 in 0..nmax, scale [S], the_min [S]) as make_qkx2_quants."""
    lo = np.minimum.reduce(x, axis=0)
    mx = np.maximum.reduce(x, axis=0)
    mn = np.where(lo > 0, _ZERO, lo)
    flat = mx == mn

    def in_range(iscale, mn) -> bool:  # |iscale*(x - mn)| stays far below 2**22 in every live sub-block
        bound = np.abs(iscale) * np.maximum(np.abs(mx - mn), np.abs(lo - mn))
        return bool(((bound < 2.0**21) | flat).all())

    sum_w = np.add.reduce(w, axis=0)  # starts from weights[0], not from 0
    sum_x = np.add.reduce(w * x, axis=0)

    def err(diff):
        return np.abs(diff, out=diff) if use_mad else np.multiply(diff, diff, out=diff)

    iscale = _F(nmax) / (mx - mn)
    scale = _F(1) / iscale
    L = _round_clip(iscale * (x - mn), 0, nmax, in_range(iscale, mn))
    # the kept L is round(L_iscale * (x - L_mn)): remembering the winning candidate's two numbers per
    # sub-block and recomputing L once at the end is cheaper than copying L under a mask per candidate
    L_iscale, L_mn = iscale, mn
    diff = scale * L
    diff += mn
    diff -= x
    best = _sum(np.multiply(w, err(diff), out=diff))
    for k in range(nstep + 1):
        iscale = ((_F(rmin) + _F(rdelta) * _F(k)) + _F(nmax)) / (mx - mn)  # min: the running one
        la = np.subtract(x, mn, out=diff)
        la *= iscale
        la = _round_clip(la, 0, nmax, in_range(iscale, mn))
        wl = w * la
        sum_l = _sum(wl)
        sum_xl = _sum(wl * x)
        wl *= la
        sum_l2 = _sum(wl)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, _ZERO, this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        d = np.multiply(la, this_scale, out=wl)
        d += this_min
        d -= x
        cur = _sum(np.multiply(w, err(d), out=d))
        better = (D > 0) & (cur < best)
        if better.any():
            L_iscale = np.where(better, iscale, L_iscale)
            L_mn = np.where(better, mn, L_mn)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
        diff = la  # reuse the buffer
    L = np.subtract(x, L_mn, out=diff)
    L *= L_iscale
    L = _round_clip(L, 0, nmax, in_range(L_iscale, L_mn))
    L[:, flat] = 0
    scale = np.where(flat, _ZERO, scale)
    the_min = -mn
    return L, scale, the_min


def _make_qx_quants(x, nmax: int):
    """x: [n, S] -> (L [n, S] float32 in 0..2*nmax-1, scale [S]) as make_qx_quants(rmse_type=1, no weights)."""
    mx = _abs_argmax(x)
    zero = np.abs(mx) < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    L_iscale = _F(-nmax) / mx  # the kept L is round(L_iscale * x): recomputed once at the end
    lq = _rint_clip(L_iscale * x, -nmax, nmax - 1)
    sumlx = _sum(wx * lq)
    suml2 = _sum((w * lq) * lq)
    scale = np.where(suml2 != 0, sumlx / suml2, _ZERO)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        iscale = -(_F(nmax) + _F(0.1) * _F(i)) / mx
        lq = np.multiply(x, iscale, out=lq)
        lq = _rint_clip(lq, -nmax, nmax - 1)
        sumlx = _sum(wx * lq)
        suml2 = _sum((w * lq) * lq)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if better.any():
            L_iscale = np.where(better, iscale, L_iscale)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    L = _rint_clip(np.multiply(x, L_iscale, out=lq), -nmax, nmax - 1)
    L += _F(nmax)
    L[:, zero] = 0
    return L, np.where(zero, _ZERO, scale)


def _make_q3_quants(x, nmax: int):
    """x: [n, S] -> (L [n, S] float32 in 0..2*nmax-1, scale [S]) as make_q3_quants(do_rmse=true)."""
    n = x.shape[0]
    mx = _abs_argmax(x)
    zero = np.abs(mx) < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    lq = _rint_clip((_F(-nmax) / mx) * x, -nmax, nmax - 1)
    sumlx = _sum(wx * lq)
    suml2 = _sum((w * lq) * lq)
    # a sub-block whose pass changed nothing would change nothing in the next pass either, so running
    # every sub-block for the passes that any of them needs gives the C code's `break` result
    for _ in range(5):
        changed = False
        for i in range(n):
            li = lq[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new_l = _nint_clip((x[i] * sl2) / slx, -nmax, nmax - 1)
            slx_new = slx + wx[i] * new_l
            sl2_new = sl2 + (w[i] * new_l) * new_l
            take = (
                (slx > 0)
                & (new_l != li)
                & (sl2_new > 0)
                & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new)
            )
            if take.any():
                changed = True
                lq[i] = np.where(take, new_l, li)
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        if not changed:
            break
    scale = np.where(suml2 > 0, sumlx / suml2, _ZERO)
    L = lq + _F(nmax)
    L[:, zero] = 0
    return L, np.where(zero, _ZERO, scale)


# ----------------------------------------------------------------------------------------------
# super-blocks: [N, 256] float32 -> [N, type size] uint8
# ----------------------------------------------------------------------------------------------
def _requant(xb, L, d, dm, n: int, lo: int, hi: int, offset: int):
    """Where the rounded sub-block scale d [N, 256/n] is non-zero, L = clip(nearest_int((x + dm)/d)) + offset."""
    nb = xb.shape[0]
    x3 = xb.reshape(nb, -1, n)
    v = x3 if dm is None else x3 + dm[..., None]
    new = _nint_clip(v / d[..., None], lo, hi) + _F(offset)
    L3 = L.reshape(nb, -1, n)
    return np.where((d != 0)[..., None], new, L3).reshape(nb, QK_K)


def _pack2(L: np.ndarray) -> np.ndarray:
    """[N, 256] 2-bit values -> qs [N, 64]: byte l of each 128-half holds L[l], L[l+32], L[l+64], L[l+96]."""
    q = L.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [N, 8] -> the 12 bytes that get_scale_min_k4 reads."""
    sc = np.empty((ls.shape[0], 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return sc


def _scales_mins_x(xb, n: int, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool, weights):
    """Shared by Q2_K/Q4_K/Q5_K: per sub-block L, scale, min -> ([N, 256] L, [N, nsub] scales, mins)."""
    nb = xb.shape[0]
    x = _sub_blocks(xb, n)
    L, scales, mins = _make_qkx2_quants(x, weights(x), nmax, rmin, rdelta, nstep, use_mad)
    return L.T.reshape(nb, QK_K), scales.reshape(nb, -1), mins.reshape(nb, -1)


def _weights_q45(x: np.ndarray) -> np.ndarray:
    av_x = np.sqrt(_sum(x * x) / _F(32))
    return av_x + np.abs(x)


def _q2_k(xb: np.ndarray) -> np.ndarray:
    L, scales, mins = _scales_mins_x(xb, 16, 3, -0.5, 0.1, 15, True, np.abs)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    q4 = _F(15)
    ok, okm = max_scale > 0, max_min > 0
    ls = np.where(ok[:, None], _nearest_int((q4 / max_scale)[:, None] * scales), 0) & 0xFF
    d = np.where(ok, _fp16(max_scale / q4), 0).astype(np.uint16)
    lm = np.where(okm[:, None], _nearest_int((q4 / max_min)[:, None] * mins), 0)
    sc = (ls | (lm << 4)) & 0xFF
    dmin = np.where(okm, _fp16(max_min / q4), 0).astype(np.uint16)
    dq = _fp32(d)[:, None] * (sc & 0xF).astype(_F)
    dm = _fp32(dmin)[:, None] * (sc >> 4).astype(_F)
    L = _requant(xb, L, dq, dm, 16, 0, 3, 0).astype(np.uint8)
    return np.concatenate([sc.astype(np.uint8), _pack2(L), _u16_bytes(d), _u16_bytes(dmin)], axis=1)


def _q3_k(xb: np.ndarray) -> np.ndarray:
    nb = xb.shape[0]
    L, scales = _make_q3_quants(_sub_blocks(xb, 16), 4)
    L = L.T.reshape(nb, QK_K)  # back to [N, 256]
    scales = scales.reshape(nb, 16)
    max_scale = _running_absmax(scales)
    ok = max_scale != 0
    iscale = _F(-32) / max_scale
    li = _nearest_int(iscale[:, None] * scales)
    li = ((li + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
    li = np.where(ok[:, None], np.clip(li, -32, 31) + 32, 0)  # 0..63
    sc = np.zeros((nb, 12), np.int64)
    sc[:, 0:8] = (li[:, 0:8] & 0xF) | ((li[:, 8:16] & 0xF) << 4)
    hi = li >> 4
    for j in range(16):
        sc[:, 8 + j % 4] |= hi[:, j] << (2 * (j // 4))
    d = np.where(ok, _fp16(_F(1) / iscale), 0).astype(np.uint16)
    dq = _fp32(d)[:, None] * (li - 32).astype(_F)
    L = _requant(xb, L, dq, None, 16, -4, 3, 4).astype(np.uint8)
    high = L > 3
    hmask = np.zeros((nb, 32), np.uint8)
    for b in range(8):
        hmask |= high[:, 32 * b : 32 * b + 32].astype(np.uint8) << b
    L = np.where(high, L - 4, L).astype(np.uint8)
    return np.concatenate([hmask, _pack2(L), sc.astype(np.uint8), _u16_bytes(d)], axis=1)


def _q45_k(xb: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Q4_K and Q5_K share everything but nmax and the search: -> (L [N, 256] uint8, header [N, 16])."""
    L, scales, mins = _scales_mins_x(xb, 32, nmax, rmin, 0.1, nstep, False, _weights_q45)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _ZERO)
    inv_min = np.where(max_min > 0, _F(63) / max_min, _ZERO)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # uint8_t ls = ...; MIN(63, ls)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d = _fp16(max_scale / _F(63))
    dmin = _fp16(max_min / _F(63))
    dq = _fp32(d)[:, None] * ls.astype(_F)
    dm = _fp32(dmin)[:, None] * lm.astype(_F)
    L = _requant(xb, L, dq, dm, 32, 0, nmax, 0).astype(np.uint8)
    header = np.concatenate(
        [_u16_bytes(d), _u16_bytes(dmin), _pack_scales_k4(ls.astype(np.uint8), lm.astype(np.uint8))], axis=1
    )
    return L, header


def _q4_k(xb: np.ndarray) -> np.ndarray:
    L, header = _q45_k(xb, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    return np.concatenate([header, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def _q5_k(xb: np.ndarray) -> np.ndarray:
    L, header = _q45_k(xb, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32)  # [N, 64-group, low/high 32, 32]
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for g in range(4):
        qh |= (q[:, g, 0] > 15).astype(np.uint8) << (2 * g)
        qh |= (q[:, g, 1] > 15).astype(np.uint8) << (2 * g + 1)
    ql = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    return np.concatenate([header, qh, ql], axis=1)


def _q6_k(xb: np.ndarray) -> np.ndarray:
    nb = xb.shape[0]
    L, scales = _make_qx_quants(_sub_blocks(xb, 16), 32)
    L = L.T.reshape(nb, QK_K)  # back to [N, 256]
    scales = scales.reshape(nb, 16)
    max_scale = _running_absmax(scales)
    zero = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = _F(-128) / max_scale
    d = np.where(zero, 0, _fp16(_F(1) / iscale)).astype(np.uint16)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127)
    sc = np.where(zero[:, None], 0, ((sc + 128) & 0xFF) - 128)  # int8_t
    dq = _fp32(d)[:, None] * sc.astype(_F)
    L = _requant(xb, L, dq, None, 16, -32, 31, 32).astype(np.uint8)
    L[zero] = 0
    q = L.reshape(-1, 2, 4, 32)  # [N, 128-half, quarter, 32]
    ql = np.concatenate(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)],
        axis=2,
    ).reshape(-1, 128)
    hb = q >> 4
    qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _u16_bytes(d)], axis=1)


_QUANTIZERS = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(values: np.ndarray, qtype: Q | int, *, threads: int | None = None) -> np.ndarray:
    """float32 values [..., cols] (cols a multiple of 256) -> uint8 [..., row_bytes] in ggml's layout,
    the same bytes as ggml's quantize_row_*_ref. Non-finite input raises ValueError. threads: worker
    threads over chunks of super-blocks (numpy releases the GIL); default: every CPU."""
    qtype = Q(qtype)
    if qtype not in _QUANTIZERS:
        raise ValueError(f"kquants quantizes {', '.join(t.name for t in sorted(TYPES))}, not {qtype.name}")
    x = np.ascontiguousarray(values, dtype=np.float32)
    lead, cols = x.shape[:-1], (x.shape[-1] if x.ndim else 1)
    if cols % QK_K:
        raise ValueError(f"{qtype.name} needs rows whose length is a multiple of {QK_K}, got {cols}")
    finite = np.isfinite(x)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(
            f"cannot quantize to {qtype.name}: the values hold {bad.size} non-finite number(s) "
            f"(NaN or inf; the first, {x.reshape(-1)[bad[0]]}, at flat index {bad[0]})"
        )
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], size), np.uint8)
    fn = _QUANTIZERS[qtype]

    def work(start: int) -> None:
        with np.errstate(all="ignore"):  # masked lanes (flat sub-blocks) divide by zero
            out[start : start + _CHUNK] = fn(blocks[start : start + _CHUNK])

    starts = range(0, blocks.shape[0], _CHUNK)
    threads = min(threads or os.cpu_count() or 1, len(starts))
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, starts))
    else:
        for s in starts:
            work(s)
    return out.reshape(*lead, cols // QK_K * size)
