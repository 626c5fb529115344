"""The FFN half of the fused decode kernels (kernels/triton_decode.py): one token, fixed shapes, no host sync.

    gate_up          act(gate . h) * up . h of the rows the mask fires
    down_axpy        per-split sums of a[k] * down_t[k] (two launches with reduce_residual)
    reduce_residual  x + the splits' sums, added in split order (the split count a constexpr: all loads
                     issued at once)

Two ways to find the firing rows:
- dense rows (mask [F], and a hybrid layer's hot rows through mask_rows): program p owns rows 16p..16p+15
  and reads the weights of those that fire; a block where nothing fires reads nothing. At 10% random firing
  82% of blocks hold a firing row, so most programs stream one or two rows a step: latency bound;
- a compacted list (`Compact`): the predictor's threshold kernel also writes how many rows fire in each
  16-row block of the mask (no atomics: each program stores its own block's count). The compacted gate_up's
  program p takes firing rows number BR*p .. BR*p+BR-1 in ascending row order (found from the block counts'
  prefix sum and the mask, in registers, by every program: no extra launch, no host sync), so every program
  streams BR live rows; it writes a[e] and the row ids rows[e] for list entries e. The compacted down_axpy
  splits the list (its length read on the device) into the fixed number of splits and reads only listed
  rows with a != 0.
Every loop over columns, row splits or list chunks is `tl.range(..., num_stages=STAGES)` without a branch
inside: its loads do not depend on the previous step's sums, so Triton's pipeliner issues them stages ahead
(sm_90 PTX: the F16 weight tiles as 16-byte cp.async; ggml blocks' 2-byte loads stay plain ld.global; see
benchmarks/triton_offline.py).

Summation order is fixed by the data: a row's dot product sums column blocks in order (a compacted row gives
the dense kernel's bits); down_axpy's split of entry e depends only on the list's length, each split sums
its entries in ascending row order, and the splits are added in order. Deterministic, no atomics in any sum;
the compacted down_axpy groups rows differently from the dense-row one, so the two agree to rounding
(tests: < 1e-5 relative to the largest output, as every fused kernel against float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotcold.kernels.launches import launch
from hotcold.kernels.triton import _INTERPRETED, _QCODE, _load_rows, _sm_count, tl, triton
from hotcold.kernels.triton_args import QTYPES

_jit = triton.jit if triton is not None else (lambda fn: fn)

ACTIVATION_CODES = {"relu": 0, "silu": 1}
KIND_CODES = {"gated": 0, "gated_both": 1}
MASK_GROUP = 16  # rows of the mask a block count covers (the threshold kernel's BLOCK_R)
_CHUNK = tl.constexpr(256) if tl is not None else 256  # block counts scanned at a time


@dataclass(frozen=True)
class Compact:
    """Device scratch of the compacted firing list: block_counts int32 [>= ceil(F / MASK_GROUP)] (written by
    the threshold kernel, gemv(..., block_counts=)), rows int32 [>= F] (written by gate_up: list entry e is
    row rows[e])."""

    block_counts: torch.Tensor
    rows: torch.Tensor

    @staticmethod
    def empty(n_ff: int, device) -> Compact:
        blocks = -(-n_ff // MASK_GROUP)
        return Compact(torch.zeros(blocks, dtype=torch.int32, device=device),
                       torch.zeros(n_ff, dtype=torch.int32, device=device))  # fmt: skip

    def first(self, n_ff: int) -> Compact:
        """The scratch of a mask of n_ff rows (a decode step's is sized for its widest layer): the kernels
        read the mask's length from len(rows)."""
        return Compact(self.block_counts[: -(-n_ff // MASK_GROUP)], self.rows[:n_ff])


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
def _listed_rows(m_ptr, bc_ptr, F, e, G: tl.constexpr, CHUNK: tl.constexpr):
    """(rows [BR], n): the mask's firing rows number e [BR] in ascending row order (0 where e >= n), and n,
    how many fire. From the block counts' prefix sums: entry e lies in the first block whose inclusive sum
    passes e; inside that block it is the (e - blocks before)-th firing row."""
    n_blocks = tl.cdiv(F, G)
    blk = tl.zeros(e.shape, dtype=tl.int32)  # blocks wholly before entry e
    base = tl.zeros(e.shape, dtype=tl.int32)  # entries in those blocks
    carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        c = tl.load(bc_ptr + b, mask=b < n_blocks, other=0)
        before = ((tl.cumsum(c, axis=0) + carry)[None, :] <= e[:, None]) & (b < n_blocks)[None, :]
        blk += tl.sum(before.to(tl.int32), axis=1)
        base += tl.sum(tl.where(before, c[None, :], 0), axis=1)
        carry += tl.sum(c, axis=0)
    valid = e < carry
    r = blk[:, None] * G + tl.arange(0, G)[None, :]  # [BR, G]: the rows of each entry's block
    fired = (tl.load(m_ptr + r, mask=valid[:, None] & (r < F), other=0) != 0).to(tl.int32)
    pick = (fired != 0) & (tl.cumsum(fired, axis=1) == (e - base + 1)[:, None])
    return tl.sum(tl.where(pick, r, 0), axis=1), carry


@_jit
def _gate_up_kernel(
    gate_ptr, up_ptr, h_ptr, nw_ptr, eps, m_ptr, idx_ptr, bc_ptr, list_ptr, a_ptr, F, D, stride_g, stride_u,
    QG: tl.constexpr, QU: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_IDX: tl.constexpr,
    COMPACT: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows, or list entries when COMPACT
    ok = slots < F
    rows = slots
    fire = ok
    if COMPACT:  # this program's BLOCK_R list entries (F: the mask's length); list_ptr receives their rows
        rows, n = _listed_rows(m_ptr, bc_ptr, F, slots, G, _CHUNK)
        fire = slots < n
        if HAS_IDX:  # a hybrid layer: the list holds neurons, idx[neuron] is its hot row (-1: a cold one)
            rows = tl.load(idx_ptr + rows, mask=fire, other=-1)
            fire = fire & (rows >= 0)
            rows = tl.where(fire, rows, 0)
        tl.store(list_ptr + slots, rows, mask=ok)
    elif HAS_MASK:
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
        for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
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
    tl.store(a_ptr + slots, a, mask=ok)


@_jit
def _down_axpy_kernel(
    w_ptr, a_ptr, rows_ptr, bc_ptr, part_ptr, F, D, rows_per_split, stride_w,
    QTYPE: tl.constexpr, COMPACT: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(1)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    if COMPACT:  # list entries [k_begin, k_end): the list's length shared out over the fixed splits
        n = tl.sum(tl.zeros([_CHUNK], dtype=tl.int32), axis=0)
        for b0 in range(0, tl.cdiv(F, G), _CHUNK):
            b = b0 + tl.arange(0, _CHUNK)
            n += tl.sum(tl.load(bc_ptr + b, mask=b < tl.cdiv(F, G), other=0), axis=0)
        per = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK_K) * BLOCK_K
        k_begin = split * per
        k_end = tl.minimum(k_begin + per, n)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            coef = tl.load(a_ptr + ks, mask=ks < k_end, other=0.0)
            rows = tl.load(rows_ptr + ks, mask=ks < k_end, other=0)
            row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w
            w = _load_rows(row_ptr, cols[None, :], (coef != 0.0)[:, None] & (cols < D)[None, :], QTYPE)
            acc += coef[:, None] * w
    else:  # row splits [k_begin, k_end) of the weights; rows with a == 0 are not read (masked off: no
        # traffic; no branch either, so the loop pipelines like the list's)
        k_begin = split * rows_per_split
        k_end = tl.minimum(k_begin + rows_per_split, F)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
            rows = k0 + tl.arange(0, BLOCK_K)
            coef = tl.load(a_ptr + rows, mask=rows < k_end, other=0.0)
            row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w
            w = _load_rows(row_ptr, cols[None, :], (coef != 0.0)[:, None] & (cols < D)[None, :], QTYPE)
            acc += coef[:, None] * w
    tl.store(part_ptr + split * D + cols, tl.sum(acc, axis=0), mask=cols < D)


@_jit
def _reduce_residual_kernel(part_ptr, res_ptr, out_ptr, D, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.load(res_ptr + cols, mask=ok, other=0.0)
    for s in tl.static_range(SPLITS):  # unrolled: every split's load issued before the adds
        acc += tl.load(part_ptr + s * D + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, acc, mask=ok)


# ------------------------------------------------------------------------------------------------
# Host wrappers: shapes in, launches out. No checks that read device values (nothing here syncs).
# ------------------------------------------------------------------------------------------------


# GPU tiles of the row kernels: [rows, columns] a program step, 4 warps; first guesses, not tuned on a GPU.
# benchmarks/gpu_fused.py times the alternatives, so the first GPU run says which to keep. compact_rows: the
# compacted gate_up's rows a program (fewer than the dense tile's: at 10% firing a 7B layer lists ~1100
# rows, and 8 a program still fills 132 SMs); stages: the pipelined loops' depth.
GPU_TILE = {"rows": 16, "cols": 256, "warps": 4, "compact_rows": 8, "stages": 3}


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


def _stages(device: torch.device) -> int:
    return 1 if _INTERPRETED or device.type != "cuda" else GPU_TILE["stages"]


def _width(w: torch.Tensor, qtype: str | None) -> tuple[int, int]:
    """(kernel type code, values a row) of float weights (qtype None) or ggml blocks ("q8_0", "q4_0")."""
    if qtype is None:
        return 0, w.shape[1]
    block_bytes, block_values = QTYPES[qtype]
    return _QCODE[qtype], w.shape[1] // block_bytes * block_values


def gate_up(gate, up, h, mask, a_out, *, kind: str, activation: str, norm=None, eps=0.0,
            qtypes: tuple[str | None, str | None] = (None, None), mask_rows=None,
            compact: Compact | None = None, neuron_rows=None) -> torch.Tensor:  # fmt: skip
    """a_out [F] = act(gate . h) * up . h (gated_both: act(up . h)) where mask [F] (None: every row);
    with `norm`, h is RMS-normed in the kernel first (a dense FFN, which has no predictor to do it).
    qtypes: gate's and up's block types (None: float; "q8_0" / "q4_0": uint8 ggml blocks [F, row bytes]).
    mask_rows: int64 [F] where weight row k is neuron mask_rows[k] of a longer mask (a hybrid layer's
    hot rows against the whole layer's mask).
    compact: the mask's block counts (from the threshold kernel) in; a_out[e] and compact.rows[e] for the
    e-th firing row out, in ascending row order (entries past the count: a 0), for down_axpy(compact=);
    a_out and compact.rows hold len(mask) entries. With neuron_rows (int32 [len(mask)]: each neuron's weight
    row, -1 where it has none: a hybrid layer's cold neurons), the list holds every firing neuron and a cold
    one gets a 0 (its row is not read)."""
    qg, _ = _width(gate, qtypes[0])
    qu, d = _width(up, qtypes[1])
    f = up.shape[0]
    tile = _blocks(up if up.dtype == torch.uint8 else gate)
    if compact is not None:
        if mask is None or mask_rows is not None or compact.rows.shape[0] != mask.shape[0]:
            raise ValueError(
                "gate_up: a compacted list needs its mask's scratch (Compact.first) and no mask_rows"
            )
        f = mask.shape[0]  # programs over the list's entries
        if not (_INTERPRETED or up.device.type != "cuda"):
            tile["BLOCK_R"] = GPU_TILE["compact_rows"]
        else:
            tile["BLOCK_R"] = 4  # the interpreter: several programs over a handful of firing rows
    if neuron_rows is not None and compact is None:
        raise ValueError("gate_up: neuron_rows go with a compacted list (mask_rows without one)")
    idx = neuron_rows if neuron_rows is not None else mask_rows if mask_rows is not None else h
    launch(
        _gate_up_kernel,
        (triton.cdiv(f, tile["BLOCK_R"]),),
        gate, up, h, norm if norm is not None else h, float(eps), mask if mask is not None else h, idx,
        compact.block_counts if compact is not None else h, compact.rows if compact is not None else h, a_out,
        f, d, gate.stride(0), up.stride(0), QG=qg, QU=qu, NORM=norm is not None, HAS_MASK=mask is not None,
        HAS_IDX=idx is not h,
        COMPACT=compact is not None, KIND=KIND_CODES[kind], ACT=ACTIVATION_CODES[activation], G=MASK_GROUP,
        STAGES=_stages(up.device), **tile,
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


def down_axpy(down_t, a, residual, partial, out, *, qtype: str | None = None,
              compact: Compact | None = None) -> torch.Tensor:  # fmt: skip
    """out [D] = residual + sum_k a[k] down_t[k] (rows with a[k] == 0 unread); partial [>= S, D] scratch
    with S from axpy_splits (a decode step's scratch is sized for its widest layer: only the first S rows
    are this call's). Two launches; the splits are added in order. qtype as in gate_up; compact: `a` is
    gate_up(compact=)'s list (a[e] for row compact.rows[e])."""
    return reduce_residual(down_axpy_partial(down_t, a, partial, qtype=qtype, compact=compact), residual, out)


def down_axpy_partial(down_t, a, partial, *, qtype: str | None = None, compact: Compact | None = None):
    """down_axpy's first launch: partial[:S] = each split's sum of a[k] down_t[k]; returns partial[:S],
    the rows reduce_residual must add (rows past S hold another layer's sums)."""
    code, d = _width(down_t, qtype)
    f = down_t.shape[0]
    splits, rows_per_split = axpy_splits(f, d, down_t.device)
    if partial.shape[0] < splits or partial.shape[1] != d:
        raise ValueError(f"down_axpy: scratch {tuple(partial.shape)} holds fewer than {splits} splits of {d}")
    block_k, block_d = _axpy_blocks(down_t.device)
    c = compact
    launch(
        _down_axpy_kernel,
        (triton.cdiv(d, block_d), splits),
        down_t, a, c.rows if c is not None else a, c.block_counts if c is not None else a, partial,
        c.rows.shape[0] if c is not None else f, d,  # compact: F is the mask's length (the list's blocks)
        rows_per_split, down_t.stride(0), QTYPE=code, COMPACT=c is not None, G=MASK_GROUP,
        STAGES=_stages(down_t.device), BLOCK_K=block_k, BLOCK_D=block_d,
    )  # fmt: skip
    return partial[:splits]


def reduce_residual(partial, residual, out) -> torch.Tensor:
    """down_axpy's second launch: out [D] = residual + the splits of partial [S, D], added in order."""
    splits, d = partial.shape
    block_d = _axpy_blocks(partial.device)[1]
    launch(
        _reduce_residual_kernel,
        (triton.cdiv(d, block_d),),
        partial, residual, out, d, SPLITS=splits, BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _axpy_blocks(device: torch.device) -> tuple[int, int]:
    return (16, 32) if _INTERPRETED or device.type != "cuda" else (16, 256)
