"""Fused GPU kernels (Triton) for one decode token of a llama-family layer: eight launches a layer.

    qkv_rope         RMS norm of x, q/k/v rows of the fused [qd + 2 kvd, D] matrix, RoPE on q and k,
                     k and v stored into the KV cache at the position read from the device
    attention        one program per query head over its KV head's cache rows 0..pos (online softmax,
                     in the cache's dtype, fp32 sums; the loop stops at pos, read from the device)
    gemv             out = W @ f(x) [+ residual] with constexpr variants: the norm computed in-kernel, ReLU,
                     or a threshold that writes the firing mask and adds the firing count on the device
                     (o projection + residual; the predictor's fc1 and fc2; dense up/gate/down; the head)
                     and the firing count of each 16-row block of the mask (the compacted list's input)
    gate_up          act(gate . h) * up . h for the rows the mask fires: over row blocks, or over the
                     compacted list of firing rows (kernels/triton_ffn.py)
    down_axpy        partial sums of a[k] * down_t[k] over splits of the rows or of the list,
    reduce_residual  then x + the splits' sum, added in split order: deterministic, no atomics

Everything the host would otherwise read (the position, the mask, the firing count) stays on the
device, so a step has no host sync and fixed shapes: `hotcold.runtime.decode_step` captures it in a CUDA graph.
Weights are F16, BF16 or F32 `[rows, D]` row-major; activations and accumulations are fp32, so the
predictor's logits meet the threshold in fp32, as on the CPU. The row kernels' column loops are software-pipelined
(`tl.range(num_stages=)`: weight tiles loaded stages ahead of the sums).

Every kernel is launched through `launches.launch`, so `LaunchCounter` counts it (and on the `meta`
device skips it). Tested under TRITON_INTERPRET=1 against torch in float64 (tests/runtime/test_decode_step.py).
"""

from __future__ import annotations

import logging
import os

import torch

from hotcold.kernels.launches import launch
from hotcold.kernels.triton import _INTERPRETED, tl, triton
from hotcold.kernels.triton_ffn import (  # noqa: F401 (the FFN kernels, used through this module)
    ACTIVATION_CODES,
    GPU_TILE,
    KIND_CODES,
    MASK_GROUP,
    Compact,
    _blocks,
    _rms_inv,
    axpy_splits,
    down_axpy,
    down_axpy_partial,
    gate_up,
    reduce_residual,
)

_jit = triton.jit if triton is not None else (lambda fn: fn)
log = logging.getLogger(__name__)
_STAGES = (
    tl.constexpr(3) if tl is not None else 3
)  # the row loops' pipeline depth (GPU_TILE["stages"]'s default)


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


@_jit
def _dot_rows(w_ptr, stride_w, rows, live, x_ptr, nw_ptr, inv, D, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BR] dots of weight rows `rows` (read where `live`) with x (RMS-normed in-kernel when NORM)."""
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([rows.shape[0], BLOCK_D], dtype=tl.float32)
    row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w
    for d0 in tl.range(0, D, BLOCK_D, num_stages=_STAGES):  # loads issued stages ahead of the sums
        c = d0 + cols
        xs = tl.load(x_ptr + c, mask=c < D, other=0.0)
        if NORM:
            xs = xs * inv * tl.load(nw_ptr + c, mask=c < D, other=0.0)
        w = tl.load(row_ptr + c[None, :], mask=live[:, None] & (c < D)[None, :], other=0.0).to(tl.float32)
        acc += w * xs[None, :]
    return tl.sum(acc, axis=1)


@_jit
def _gemv_kernel(
    w_ptr, x_ptr, nw_ptr, res_ptr, out_ptr, h_ptr, count_ptr, bc_ptr, thr, eps, R, D, stride_w,
    NORM: tl.constexpr, RELU: tl.constexpr, RESIDUAL: tl.constexpr, THRESHOLD: tl.constexpr,
    WRITE_NORMED: tl.constexpr, BLOCK_COUNTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
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
        fired = tl.sum(fire.to(tl.int32), axis=0)
        tl.atomic_add(count_ptr, fired)
        if BLOCK_COUNTS:  # this program's rows are one block of the mask: its count, stored (no atomics)
            tl.store(bc_ptr + pid, fired)
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


# ------------------------------------------------------------------------------------------------
# Host wrappers: shapes in, launches out. No checks that read device values (nothing here syncs).
# ------------------------------------------------------------------------------------------------


def gemv(w, x, *, out, norm=None, eps=0.0, residual=None, relu=False, threshold=None, mask_out=None,
         count=None, normed_out=None, block_counts=None) -> torch.Tensor:  # fmt: skip
    """out [R] = W [R, D] @ f(x [D]) (+ residual [R]); f = RMS norm with weight `norm` when given.
    With `threshold`: `mask_out` int8 [R] = (W @ x >= threshold), `count` int32 [1] += fired rows, and with
    `block_counts` (int32 [>= ceil(R / MASK_GROUP)]) the fired rows of each MASK_GROUP-row block.
    With `normed_out`: also writes norm(x) there (fc1 of the predictor hands the FFN its input)."""
    r, d = w.shape
    tile = _blocks(w)
    if block_counts is not None:
        if threshold is None:
            raise ValueError("gemv: block_counts come with a threshold")
        tile["BLOCK_R"] = MASK_GROUP
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
        block_counts if block_counts is not None else x,
        float(threshold or 0.0), float(eps), r, d, w.stride(0),
        NORM=norm is not None and normed_out is None,
        RELU=relu, RESIDUAL=residual is not None, THRESHOLD=threshold is not None,
        WRITE_NORMED=normed_out is not None, BLOCK_COUNTS=block_counts is not None, **tile,
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
