"""Fused GPU kernels (Triton) for one decode token of a llama-family layer: eight launches a layer.

    qkv_rope         RMS norm of x, q/k/v rows of the fused [qd + 2 kvd, D] matrix, RoPE on q and k,
                     k and v stored into the KV cache at the position read from the device
    attention        one program per query head over its KV head's cache rows 0..pos (online softmax,
                     in the cache's dtype, fp32 sums; the loop stops at pos, read from the device)
    gemv             out = W @ f(x) [+ residual] with constexpr variants: the norm computed in-kernel, ReLU,
                     or a threshold that writes the firing mask and adds the firing count on the device
                     (o projection + residual; the predictor's fc1 and fc2; dense up/gate/down; the head)
    gate_up          act(gate . h) * up . h for the rows the mask fires, 0 elsewhere; a row block nobody
                     needs reads no weights
    down_axpy        partial sums of a[k] * down_t[k] over row splits (rows with a == 0 are not read),
    reduce_residual  then x + the splits' sum, added in split order: deterministic, no atomics

Everything the host would otherwise read (the position, the mask, the firing count) stays on the
device, so a step has no host sync and fixed shapes: `hotcold.decode_step` captures it in a CUDA graph.
Weights are F16, BF16 or F32 `[rows, D]` row-major; activations and accumulations are fp32, so the
predictor's logits meet the threshold in fp32, as on the CPU.

Every kernel is launched through `launches.launch`, so `LaunchCounter` counts it (and on the `meta`
device skips it). Tested under TRITON_INTERPRET=1 against torch in float64 (tests/test_decode_step.py).
"""

from __future__ import annotations

import logging
import os

import torch

from hotcold.kernels.launches import launch
from hotcold.kernels.triton import _INTERPRETED, _QCODE, _load_rows, _sm_count, tl, triton
from hotcold.kernels.triton_args import QTYPES

_jit = triton.jit if triton is not None else (lambda fn: fn)
log = logging.getLogger(__name__)


class FusedPaths:
    """Whether the eager GPU paths use these kernels for a decode token (a GPU layer's attention:
    models/base.fused_decode_attention; a hybrid layer's FFN: sparse/hybrid.OneToken). On unless
    HOTCOLD_FUSED_EAGER=0; switched off for the process, with the reason, the first time a launch raises
    (a GPU or a Triton that cannot compile them), so decoding goes on through the torch ops."""

    enabled = os.environ.get("HOTCOLD_FUSED_EAGER", "1") != "0"
    failure: str | None = None

    @classmethod
    def fail(cls, exc: BaseException) -> None:
        cls.enabled = False
        cls.failure = f"{type(exc).__name__}: {exc}"
        log.warning("fused decode kernels off for this process, decoding through torch ops: %s", cls.failure)


ACTIVATION_CODES = {"relu": 0, "silu": 1}
KIND_CODES = {"gated": 0, "gated_both": 1}


@_jit
def _rms_inv(x_ptr, D, eps, BLOCK_D: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the fp32 vector x [D] (every program computes it: D is small)."""
    cols = tl.arange(0, BLOCK_D)
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        xs = tl.load(x_ptr + d0 + cols, mask=d0 + cols < D, other=0.0)
        ss += xs * xs
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + eps)


@_jit
def _dot_rows(w_ptr, stride_w, rows, live, x_ptr, nw_ptr, inv, D, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BR] dots of weight rows `rows` (read where `live`) with x (RMS-normed in-kernel when NORM)."""
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([rows.shape[0], BLOCK_D], dtype=tl.float32)
    row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        xs = tl.load(x_ptr + c, mask=c < D, other=0.0)
        if NORM:
            xs = xs * inv * tl.load(nw_ptr + c, mask=c < D, other=0.0)
        w = tl.load(row_ptr + c[None, :], mask=live[:, None] & (c < D)[None, :], other=0.0).to(tl.float32)
        acc += w * xs[None, :]
    return tl.sum(acc, axis=1)


@_jit
def _gemv_kernel(
    w_ptr, x_ptr, nw_ptr, res_ptr, out_ptr, h_ptr, count_ptr, thr, eps, R, D, stride_w,
    NORM: tl.constexpr, RELU: tl.constexpr, RESIDUAL: tl.constexpr, THRESHOLD: tl.constexpr,
    WRITE_NORMED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    inv = 1.0
    if NORM or WRITE_NORMED:
        inv = _rms_inv(x_ptr, D, eps, BLOCK_D)
    if WRITE_NORMED:  # h = norm(x) for a later kernel, each program writing its share of the columns
        cols = tl.arange(0, BLOCK_D)
        for d0 in range(pid * BLOCK_D, D, tl.num_programs(0) * BLOCK_D):
            c = d0 + cols
            xs = tl.load(x_ptr + c, mask=c < D, other=0.0)
            tl.store(h_ptr + c, xs * inv * tl.load(nw_ptr + c, mask=c < D, other=0.0), mask=c < D)
    y = _dot_rows(w_ptr, stride_w, rows, ok, x_ptr, nw_ptr, inv, D, NORM, BLOCK_D)
    if RELU:
        y = tl.maximum(y, 0.0)
    if THRESHOLD:  # the predictor's fc2: fp32 logits against the threshold; the firing count on the device
        fire = (y >= thr) & ok
        tl.store(out_ptr + rows, fire.to(tl.int8), mask=ok)
        tl.atomic_add(count_ptr, tl.sum(fire.to(tl.int32), axis=0))
    else:
        if RESIDUAL:
            y += tl.load(res_ptr + rows, mask=ok, other=0.0)
        tl.store(out_ptr + rows, y, mask=ok)


@_jit
def _qkv_rope_kernel(
    w_ptr, x_ptr, nw_ptr, eps, pos_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, D, stride_w, QD, KVD,
    HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # rows 2p and 2p + 1 of the fused matrix: a RoPE pair (adjacent pairs: the GGUF llama layout)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    n_pairs = (QD + 2 * KVD) // 2
    ok = p < n_pairs
    inv = _rms_inv(x_ptr, D, eps, BLOCK_D)
    even = _dot_rows(w_ptr, stride_w, 2 * p, ok, x_ptr, nw_ptr, inv, D, True, BLOCK_D)
    odd = _dot_rows(w_ptr, stride_w, 2 * p + 1, ok, x_ptr, nw_ptr, inv, D, True, BLOCK_D)
    pos = tl.load(pos_ptr)
    j = p % HALF  # the pair's index inside its head
    rotate = 2 * p < QD + KVD  # q and k rows; v rows pass through
    cos = tl.load(cos_ptr + pos * HALF + j, mask=ok & rotate, other=1.0)
    sin = tl.load(sin_ptr + pos * HALF + j, mask=ok & rotate, other=0.0)
    a = even * cos - odd * sin
    b = even * sin + odd * cos
    row = 2 * p
    is_q = row < QD
    is_k = (row >= QD) & (row < QD + KVD)
    is_v = row >= QD + KVD
    tl.store(q_ptr + row, a, mask=ok & is_q)
    tl.store(q_ptr + row + 1, b, mask=ok & is_q)
    kdst = kc_ptr + pos * KVD + (row - QD)
    tl.store(kdst, a.to(kc_ptr.dtype.element_ty), mask=ok & is_k)
    tl.store(kdst + 1, b.to(kc_ptr.dtype.element_ty), mask=ok & is_k)
    vdst = vc_ptr + pos * KVD + (row - QD - KVD)
    tl.store(vdst, a.to(vc_ptr.dtype.element_ty), mask=ok & is_v)
    tl.store(vdst + 1, b.to(vc_ptr.dtype.element_ty), mask=ok & is_v)


@_jit
def _attention_kernel(
    q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, scale, window, GROUP, KVD,
    DH: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    kvh = h // GROUP
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + h * DH + d) * scale  # [DH]
    pos = tl.load(pos_ptr)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    m = tl.max(tl.full([BLOCK_N], -float("inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
    acc = tl.zeros([DH], dtype=tl.float32)
    n0 = first - first % BLOCK_N
    for start in range(n0, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live = (n >= first) & (n <= pos)
        off = n[:, None].to(tl.int64) * KVD + kvh * DH + d[None, :]
        k = tl.load(kc_ptr + off, mask=live[:, None], other=0.0).to(tl.float32)  # [BN, DH]
        s = tl.where(live, tl.sum(k * q[None, :], axis=1), -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new)
        v = tl.load(vc_ptr + off, mask=live[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + h * DH + d, acc / total)


@_jit
def _gate_up_kernel(
    gate_ptr, up_ptr, h_ptr, nw_ptr, eps, m_ptr, idx_ptr, a_ptr, F, D, stride_g, stride_u,
    QG: tl.constexpr, QU: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_IDX: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < F
    fire = ok
    if HAS_MASK:
        if HAS_IDX:  # row k of the weights is neuron idx[k] of the mask (a hybrid layer's hot rows)
            neuron = tl.load(idx_ptr + rows, mask=ok, other=0)
            fire = (tl.load(m_ptr + neuron, mask=ok, other=0) != 0) & ok
        else:
            fire = (tl.load(m_ptr + rows, mask=ok, other=0) != 0) & ok
    a = tl.zeros([BLOCK_R], dtype=tl.float32)
    if tl.max(fire.to(tl.int32), axis=0) > 0:  # a block nobody fires reads no weights
        inv = 1.0
        if NORM:
            inv = _rms_inv(h_ptr, D, eps, BLOCK_D)
        # gate and up rows in one pass over h: each column block of h is loaded once for both
        cols = tl.arange(0, BLOCK_D)
        acc_g = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        g_ptr = gate_ptr + rows[:, None].to(tl.int64) * stride_g
        u_ptr = up_ptr + rows[:, None].to(tl.int64) * stride_u
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            hs = tl.load(h_ptr + c, mask=c < D, other=0.0)
            if NORM:
                hs = hs * inv * tl.load(nw_ptr + c, mask=c < D, other=0.0)
            live = fire[:, None] & (c < D)[None, :]
            acc_g += _load_rows(g_ptr, c[None, :], live, QG) * hs[None, :]
            acc_u += _load_rows(u_ptr, c[None, :], live, QU) * hs[None, :]
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        if ACT == 0:
            g = tl.maximum(g, 0.0)
        else:
            g = g / (1.0 + tl.exp(-g))
        if KIND == 1:
            if ACT == 0:
                u = tl.maximum(u, 0.0)
            else:
                u = u / (1.0 + tl.exp(-u))
        a = tl.where(fire, g * u, 0.0)
    tl.store(a_ptr + rows, a, mask=ok)


@_jit
def _down_axpy_kernel(
    w_ptr, a_ptr, part_ptr, F, D, rows_per_split, stride_w,
    QTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(1)
    k_begin = split * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, F)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rows = k0 + tl.arange(0, BLOCK_K)
        coef = tl.load(a_ptr + rows, mask=rows < k_end, other=0.0)
        live = coef != 0.0
        if tl.max(live.to(tl.int32), axis=0) > 0:  # rows nobody needs are not read
            row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w
            w = _load_rows(row_ptr, cols[None, :], live[:, None] & (cols < D)[None, :], QTYPE)
            acc += coef[:, None] * w
    tl.store(part_ptr + split * D + cols, tl.sum(acc, axis=0), mask=cols < D)


@_jit
def _reduce_residual_kernel(part_ptr, res_ptr, out_ptr, S, D, BLOCK_D: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.load(res_ptr + cols, mask=ok, other=0.0)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * D + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, acc, mask=ok)


# ------------------------------------------------------------------------------------------------
# Host wrappers: shapes in, launches out. No checks that read device values (nothing here syncs).
# ------------------------------------------------------------------------------------------------


# GPU tiles of the row kernels: [rows, columns] a program step, 4 warps; first guesses, not tuned on a GPU.
# benchmark() times the alternatives, so the first GPU run says which to keep.
GPU_TILE = {"rows": 16, "cols": 256, "warps": 4}


def _blocks(w: torch.Tensor) -> dict:
    """BLOCK_R, BLOCK_D (and num_warps on a GPU) of a row kernel over weights w: on the interpreter narrow
    enough that tests cover several column blocks; on a GPU GPU_TILE (F32 weights: half as many columns,
    so a step still loads 8 KiB in 16-byte loads)."""
    if _INTERPRETED or w.device.type != "cuda":
        return dict(BLOCK_R=16, BLOCK_D=32)
    # F32 rows: 8 KiB a step at half the columns; ggml blocks (uint8): half the columns too, since a
    # [16, 256] tile of Q4_0 gate + up spills registers (ptxas for sm_90: 255 registers, 76 bytes spilled)
    cols = GPU_TILE["cols"] // 2 if w.element_size() == 4 or w.dtype == torch.uint8 else GPU_TILE["cols"]
    return dict(BLOCK_R=GPU_TILE["rows"], BLOCK_D=cols, num_warps=GPU_TILE["warps"])


def gemv(w, x, *, out, norm=None, eps=0.0, residual=None, relu=False, threshold=None, mask_out=None,
         count=None, normed_out=None) -> torch.Tensor:  # fmt: skip
    """out [R] = W [R, D] @ f(x [D]) (+ residual [R]); f = RMS norm with weight `norm` when given.
    With `threshold`: `mask_out` int8 [R] = (W @ x >= threshold), `count` int32 [1] += fired rows.
    With `normed_out`: also writes norm(x) there (fc1 of the predictor hands the FFN its input)."""
    r, d = w.shape
    tile = _blocks(w)
    nw = norm if norm is not None else x
    if normed_out is not None and norm is None:
        raise ValueError("gemv: normed_out needs the norm weight")
    launch(
        _gemv_kernel,
        (triton.cdiv(r, tile["BLOCK_R"]),),
        w, x, nw,
        residual if residual is not None else x,
        mask_out if threshold is not None else out,
        normed_out if normed_out is not None else x,
        count if count is not None else x,
        float(threshold or 0.0), float(eps), r, d, w.stride(0),
        NORM=norm is not None and normed_out is None,
        RELU=relu, RESIDUAL=residual is not None, THRESHOLD=threshold is not None,
        WRITE_NORMED=normed_out is not None, **tile,
    )  # fmt: skip
    return mask_out if threshold is not None else out


def qkv_rope(wqkv, x, norm, eps, pos, cos, sin, q_out, k_cache, v_cache, *, n_q: int, n_kv: int) -> None:
    """q_out [qd] and the cache rows at `pos` (a device int64 [1]) from the fused [qd + 2 kvd, D] matrix;
    cos/sin [n_ctx, Dh/2] fp32; k_cache, v_cache [n_ctx, Hkv, Dh] in the cache dtype."""
    rows, d = wqkv.shape
    half = cos.shape[1]
    tile = _blocks(wqkv)
    block_p = tile.pop("BLOCK_R")
    pairs = rows // 2
    launch(
        _qkv_rope_kernel,
        (triton.cdiv(pairs, block_p),),
        wqkv, x, norm, float(eps), pos, cos, sin, q_out, k_cache, v_cache, d, wqkv.stride(0), n_q, n_kv,
        HALF=half, BLOCK_P=block_p, **tile,
    )  # fmt: skip


def attention(q, k_cache, v_cache, pos, out, *, n_head: int, head_dim: int, window: int = 0) -> None:
    """out [H * Dh] = softmax(q . K[0..pos]) V per head; K/V [n_ctx, Hkv, Dh]; GQA by head groups."""
    n_kv = k_cache.shape[1]
    block_n = 16 if _INTERPRETED or q.device.type != "cuda" else 64
    launch(
        _attention_kernel,
        (n_head,),
        q, k_cache, v_cache, pos, out, head_dim**-0.5, int(window), n_head // n_kv, n_kv * head_dim,
        DH=head_dim, BLOCK_N=block_n,
    )  # fmt: skip


def _width(w: torch.Tensor, qtype: str | None) -> tuple[int, int]:
    """(kernel type code, values a row) of float weights (qtype None) or ggml blocks ("q8_0", "q4_0")."""
    if qtype is None:
        return 0, w.shape[1]
    block_bytes, block_values = QTYPES[qtype]
    return _QCODE[qtype], w.shape[1] // block_bytes * block_values


def gate_up(gate, up, h, mask, a_out, *, kind: str, activation: str, norm=None, eps=0.0,
            qtypes: tuple[str | None, str | None] = (None, None), mask_rows=None) -> torch.Tensor:  # fmt: skip
    """a_out [F] = act(gate . h) * up . h (gated_both: act(up . h)) where mask [F] (None: every row);
    with `norm`, h is RMS-normed in the kernel first (a dense FFN, which has no predictor to do it).
    qtypes: gate's and up's block types (None: float; "q8_0" / "q4_0": uint8 ggml blocks [F, row bytes]).
    mask_rows: int64 [F] where weight row k is neuron mask_rows[k] of a longer mask (a hybrid layer's
    hot rows against the whole layer's mask)."""
    qg, _ = _width(gate, qtypes[0])
    qu, d = _width(up, qtypes[1])
    f = up.shape[0]
    tile = _blocks(up if up.dtype == torch.uint8 else gate)
    launch(
        _gate_up_kernel,
        (triton.cdiv(f, tile["BLOCK_R"]),),
        gate, up, h, norm if norm is not None else h, float(eps), mask if mask is not None else h,
        mask_rows if mask_rows is not None else h, a_out, f, d, gate.stride(0), up.stride(0), QG=qg, QU=qu,
        NORM=norm is not None, HAS_MASK=mask is not None, HAS_IDX=mask_rows is not None, KIND=KIND_CODES[kind], ACT=ACTIVATION_CODES[activation],
        **tile,
    )  # fmt: skip
    return a_out


def axpy_splits(f: int, d: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows per split) of down_axpy over f rows of d values: enough programs to fill the GPU
    (~4 per SM)."""
    block_k, block_d = _axpy_blocks(device)
    n_d = triton.cdiv(d, block_d)
    blocks = triton.cdiv(f, block_k)
    splits = max(1, min(blocks, triton.cdiv(4 * _sm_count(device), n_d)))
    rows_per_split = triton.cdiv(blocks, splits) * block_k
    return triton.cdiv(f, rows_per_split), rows_per_split


def down_axpy(down_t, a, residual, partial, out, *, qtype: str | None = None) -> torch.Tensor:
    """out [D] = residual + sum_k a[k] down_t[k] (rows with a[k] == 0 unread); partial [>= S, D] scratch
    with S from axpy_splits (a decode step's scratch is sized for its widest layer: only the first S rows
    are this call's). Two launches; the splits are added in order. qtype as in gate_up."""
    return reduce_residual(down_axpy_partial(down_t, a, partial, qtype=qtype), residual, out)


def down_axpy_partial(down_t, a, partial, *, qtype: str | None = None) -> torch.Tensor:
    """down_axpy's first launch: partial[:S] = each row split's sum of a[k] down_t[k]; returns partial[:S],
    the rows reduce_residual must add (rows past S hold another layer's sums)."""
    code, d = _width(down_t, qtype)
    f = down_t.shape[0]
    splits, rows_per_split = axpy_splits(f, d, down_t.device)
    if partial.shape[0] < splits or partial.shape[1] != d:
        raise ValueError(f"down_axpy: scratch {tuple(partial.shape)} holds fewer than {splits} splits of {d}")
    block_k, block_d = _axpy_blocks(down_t.device)
    launch(
        _down_axpy_kernel,
        (triton.cdiv(d, block_d), splits),
        down_t, a, partial, f, d, rows_per_split, down_t.stride(0), QTYPE=code, BLOCK_K=block_k, BLOCK_D=block_d,
    )  # fmt: skip
    return partial[:splits]


def reduce_residual(partial, residual, out) -> torch.Tensor:
    """down_axpy's second launch: out [D] = residual + the splits of partial [S, D], added in order."""
    splits, d = partial.shape
    block_d = _axpy_blocks(partial.device)[1]
    launch(
        _reduce_residual_kernel,
        (triton.cdiv(d, block_d),),
        partial,
        residual,
        out,
        splits,
        d,
        BLOCK_D=block_d,
    )
    return out


def _axpy_blocks(device: torch.device) -> tuple[int, int]:
    return (16, 32) if _INTERPRETED or device.type != "cuda" else (16, 256)
