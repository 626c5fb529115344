"""GPU sparse FFN kernels (Triton) over the hot rows of one layer.

The GPU keeps a compact copy of a layer's hot rows: `w_hot [K, D]`, row k = neuron `hot_idx[k]`
(the sorted GPU bucket). Two operations, per token t and hot row k:

    hot_gather_matvec   out[t, k] = w_hot[k] . x[t]            where mask[t, k], else 0   (up, gate)
    hot_axpy            out[t]    = sum_k mask[t, k] a[t, k] w_hot_t[k]                   (down_t)

Weights are F16, BF16 or F32 tensors, or ggml Q8_0 / Q4_0 blocks exactly as in the GGUF file
(`uint8 [K, row_bytes]` plus `qtype=`), so the loader copies file bytes to the GPU unchanged.

Decode is memory bound, so the kernels are built to read only what the predictor asks for:
- a program owns a block of rows; it loads the mask first and, when no token fires any of its
  rows, stores zeros and reads no weights at all; inside a live block, the weight loads are masked
  per row, so rows nobody needs cost no memory traffic (hot_axpy also skips rows whose `a` is 0);
- weight tiles are `[BLOCK_K rows, BLOCK_D columns]`, contiguous along D so the loads vectorise;
  products accumulate in fp32;
- every token of a program's token block reuses the tile it loaded, so with T <= 8 each weight
  row is read once; T > 8 (prefill) switches to `tl.dot` on tensor cores (TF32 inputs, F32
  weights in IEEE fp32), one weight read per 16-64 tokens;
- hot_axpy splits the rows across programs (each output column block gets several programs, so
  the GPU is full even when D is small) and sums the per-split partials with one `torch.sum`:
  deterministic, no atomics, the same bits on every run.

Quantized rows are read in halves of each 32-value block (values 0..15 and 16..31), which is how a
Q4_0 byte stores them: a block's values come from contiguous 2-byte loads and its fp16 scale is
loaded once per row. ggml's 34- and 18-byte blocks are only 2-byte aligned, so wider loads would
need a repacked copy, which the loader is meant to avoid.

Status: correct under the Triton interpreter (TRITON_INTERPRET=1) against a float64 reference;
built offline for sm_90 (H200): no register spills, 16-byte loads for F16/BF16/F32 tiles. Never
run on a GPU yet: block sizes are first guesses, effective GB/s unmeasured.

TRITON_INTERPRET=1 must be set before triton is first imported: `triton.language` decorates its
own helpers (tl.sum, tl.max, ...) at import, so the mode cannot change later in a process
(tests/kernels/test_triton.py runs the interpreter in a subprocess).
"""

from __future__ import annotations

import functools
import os

import torch

from hotcold.kernels.launches import launch
from hotcold.kernels.triton_args import _FLOAT_NAMES, QTYPES, _activations, _out, _qtype_name

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module imports, available() is False
    triton = None
    tl = None

# As triton decides it when it decorates a kernel: at import time, from the environment.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

_QCODE = {None: 0, "q8_0": 1, "q4_0": 2}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

DOT_MIN_TOKENS = 9  # from this many tokens on, tl.dot (tensor cores) instead of per-token FMAs


def available() -> bool:
    """Triton is importable and can run here: a CUDA device, or the interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and (_INTERPRETED or torch.cuda.is_available())


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _load_rows(row_ptr, cols, mask, QTYPE: tl.constexpr):
    """Weights at row starts `row_ptr` [BK, 1] and columns `cols` [1, BD] as fp32 [BK, BD], one
    scale load per value (the tl.dot path, where loads are not the bottleneck).
    Lanes where `mask` is false are not read and give 0."""
    if QTYPE == 0:  # F16 / BF16 / F32: row_ptr points at elements
        w = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # ggml blocks of 32 values: row_ptr points at bytes
        if QTYPE == 1:  # Q8_0: fp16 d, then 32 int8 q; value = d * q
            block = row_ptr + (cols // 32) * 34
            q = tl.load(block + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:  # Q4_0: fp16 d, then 16 bytes; byte j: value j in the low nibble, j + 16 in the high one
            block = row_ptr + (cols // 32) * 18
            j = cols % 32
            byte = tl.load(block + 2 + j % 16, mask=mask, other=0).to(tl.int32)
            q = ((byte >> ((j // 16) * 4)) & 15).to(tl.float32) - 8.0
        # 2-byte aligned: blocks are 34 / 18 bytes and rows a whole number of blocks
        d = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
        w = q * d
    return w


@_jit
def _load_halves(row_ptr, blk, j, live, D, QTYPE: tl.constexpr):
    """Decode-path tile of ggml blocks: values 0..15 and 16..31 of each 32-value block, fp32
    [BK, NB, 16] each. row_ptr [BK, 1, 1] row starts (bytes), blk [1, NB, 1] block ids,
    j [1, 1, 16], live [BK, 1, 1] rows to read. Split this way (a Q4_0 byte holds value j in its
    low nibble and j + 16 in its high one) the values come from contiguous loads and each block's
    fp16 scale is loaded once per row, not once per value."""
    col = blk * 32 + j  # [1, NB, 16]
    m = live & (col < D)  # D is a whole number of blocks
    if QTYPE == 1:  # Q8_0: fp16 d, then 32 int8 q; value = d * q
        block = row_ptr + blk * 34  # [BK, NB, 1]
        lo = tl.load(block + 2 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        hi = tl.load(block + 18 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    else:  # Q4_0: fp16 d, then 16 bytes; value = d * (nibble - 8)
        block = row_ptr + blk * 18
        byte = tl.load(block + 2 + j, mask=m, other=0).to(tl.int32)
        lo = (byte & 15).to(tl.float32) - 8.0
        hi = (byte >> 4).to(tl.float32) - 8.0
    scale = tl.load(block.to(tl.pointer_type(tl.float16)), mask=live & (blk * 32 < D), other=0.0).to(
        tl.float32
    )
    return lo * scale, hi * scale


@_jit
def _matvec_kernel(
    w_ptr,  # [K, D] elements, or [K, row_bytes] ggml blocks
    x_ptr,  # [T, D] fp32
    m_ptr,  # [T, K] bool
    out_ptr,  # [T, K] fp32
    K,
    D,
    T,
    stride_w,
    stride_x,
    stride_m,
    stride_o,
    QTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    STAGES: tl.constexpr = 1,
):
    rows = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    ok = (toks[:, None] < T) & (rows[None, :] < K)  # [BT, BK]
    fire = tl.load(m_ptr + toks[:, None] * stride_m + rows[None, :], mask=ok, other=0) != 0
    live = tl.max(fire.to(tl.int32), axis=0) > 0  # [BK] rows that some token needs
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # an idle row block reads no weights
        if USE_DOT:  # prefill: [BT, BD] x [BD, BK] on tensor cores
            row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w  # [BK, 1]
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)  # [BD]
                w = _load_rows(row_ptr, cols[None, :], live[:, None] & (cols < D)[None, :], QTYPE)  # [BK, BD]
                xs = tl.load(
                    x_ptr + toks[:, None] * stride_x + cols[None, :],
                    mask=(toks < T)[:, None] & (cols < D)[None, :],
                    other=0.0,
                )  # [BT, BD]
                acc += tl.dot(xs, tl.trans(w), input_precision=PRECISION)
        elif QTYPE == 0:  # decode, float weights: each token makes one pass over the tile in registers
            row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w  # [BK, 1]
            for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):  # loads ahead
                cols = d0 + tl.arange(0, BLOCK_D)  # [BD]
                w = _load_rows(row_ptr, cols[None, :], live[:, None] & (cols < D)[None, :], QTYPE)  # [BK, BD]
                for t in tl.static_range(BLOCK_T):
                    tok = tl.program_id(1) * BLOCK_T + t
                    # (cols < D) & (tok < T), written so the interpreter's scalar-and-block `&` is avoided
                    x_t = tl.load(
                        x_ptr + tok * stride_x + cols, mask=cols < tl.where(tok < T, D, 0), other=0.0
                    )
                    part = tl.sum(w * x_t[None, :], axis=1)  # [BK]
                    acc += tl.where(tl.arange(0, BLOCK_T)[:, None] == t, part[None, :], 0.0)
        else:  # decode, ggml blocks: the same, in [BK, NB, 16] halves of 32-value blocks
            row_ptr = w_ptr + rows[:, None, None].to(tl.int64) * stride_w  # [BK, 1, 1]
            j = tl.arange(0, 16)[None, None, :]
            for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):  # loads ahead
                blk = d0 // 32 + tl.arange(0, BLOCK_D // 32)[None, :, None]  # [1, NB, 1]
                lo, hi = _load_halves(row_ptr, blk, j, live[:, None, None], D, QTYPE)  # [BK, NB, 16] x 2
                col = blk * 32 + j
                for t in tl.static_range(BLOCK_T):
                    tok = tl.program_id(1) * BLOCK_T + t
                    d_t = tl.where(tok < T, D, 0)
                    x_lo = tl.load(x_ptr + tok * stride_x + col, mask=col < d_t, other=0.0)  # [1, NB, 16]
                    x_hi = tl.load(x_ptr + tok * stride_x + col + 16, mask=col + 16 < d_t, other=0.0)
                    part = tl.sum(tl.sum(lo * x_lo + hi * x_hi, axis=2), axis=1)  # [BK]
                    acc += tl.where(tl.arange(0, BLOCK_T)[:, None] == t, part[None, :], 0.0)
    tl.store(out_ptr + toks[:, None] * stride_o + rows[None, :], tl.where(fire, acc, 0.0), mask=ok)


@_jit
def _axpy_kernel(
    w_ptr,  # [K, D] rows of ffn_down_t, elements or ggml blocks
    a_ptr,  # [T, K] fp32
    m_ptr,  # [T, K] bool
    part_ptr,  # [S, T, D] fp32 partial sums, one slice per row split
    K,
    D,
    T,
    rows_per_split,
    stride_w,
    stride_a,
    stride_m,
    stride_ps,
    stride_pt,
    QTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    split = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    k_begin = split * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, K)
    out_ptr = part_ptr + split * stride_ps
    tsel = tl.arange(0, BLOCK_T)[:, None]  # [BT, 1]
    if QTYPE == 0 or USE_DOT:  # output columns [BD]
        cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)  # [BK]
            ok = (toks[:, None] < T) & (rows[None, :] < k_end)  # [BT, BK]
            fire = tl.load(m_ptr + toks[:, None] * stride_m + rows[None, :], mask=ok, other=0) != 0
            # a where the row fired, else 0 without reading it
            coef = tl.load(a_ptr + toks[:, None] * stride_a + rows[None, :], mask=ok & fire, other=0.0)
            live = tl.max((coef != 0).to(tl.int32), axis=0) > 0  # [BK]
            if tl.max(live.to(tl.int32), axis=0) > 0:  # rows nobody needs are not read
                row_ptr = w_ptr + rows[:, None].to(tl.int64) * stride_w  # [BK, 1]
                w = _load_rows(row_ptr, cols[None, :], live[:, None] & (cols < D)[None, :], QTYPE)  # [BK, BD]
                if USE_DOT:  # prefill: [BT, BK] x [BK, BD] on tensor cores
                    acc += tl.dot(coef, w, input_precision=PRECISION)
                else:  # decode: each token makes one pass over the tile in registers
                    for t in tl.static_range(BLOCK_T):
                        c = tl.sum(tl.where(tsel == t, coef, 0.0), axis=0)  # [BK]: row t of coef
                        acc += tl.where(tsel == t, tl.sum(c[:, None] * w, axis=0)[None, :], 0.0)
        tl.store(
            out_ptr + toks[:, None] * stride_pt + cols[None, :],
            acc,
            mask=(toks < T)[:, None] & (cols < D)[None, :],
        )
    else:  # decode, ggml blocks: output columns as [NB, 16] low and high halves of 32-value blocks
        blk = tl.program_id(0) * (BLOCK_D // 32) + tl.arange(0, BLOCK_D // 32)[None, :, None]  # [1, NB, 1]
        j = tl.arange(0, 16)[None, None, :]
        col = blk * 32 + j  # [1, NB, 16]
        tsel3 = tl.arange(0, BLOCK_T)[:, None, None]  # [BT, 1, 1]
        acc_lo = tl.zeros([BLOCK_T, BLOCK_D // 32, 16], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_T, BLOCK_D // 32, 16], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)  # [BK]
            ok = (toks[:, None] < T) & (rows[None, :] < k_end)  # [BT, BK]
            fire = tl.load(m_ptr + toks[:, None] * stride_m + rows[None, :], mask=ok, other=0) != 0
            coef = tl.load(a_ptr + toks[:, None] * stride_a + rows[None, :], mask=ok & fire, other=0.0)
            live = tl.max((coef != 0).to(tl.int32), axis=0) > 0  # [BK]
            if tl.max(live.to(tl.int32), axis=0) > 0:
                row_ptr = w_ptr + rows[:, None, None].to(tl.int64) * stride_w  # [BK, 1, 1]
                lo, hi = _load_halves(row_ptr, blk, j, live[:, None, None], D, QTYPE)  # [BK, NB, 16] x 2
                for t in tl.static_range(BLOCK_T):
                    c = tl.sum(tl.where(tsel == t, coef, 0.0), axis=0)[:, None, None]  # [BK, 1, 1]
                    acc_lo += tl.where(tsel3 == t, tl.sum(c * lo, axis=0)[None], 0.0)
                    acc_hi += tl.where(tsel3 == t, tl.sum(c * hi, axis=0)[None], 0.0)
        dst = out_ptr + toks[:, None, None] * stride_pt + col  # [BT, NB, 16]
        ok_t = toks[:, None, None] < T
        tl.store(dst, acc_lo, mask=ok_t & (col < D))
        tl.store(dst + 16, acc_hi, mask=ok_t & (col + 16 < D))


def hot_gather_matvec(
    w_hot: torch.Tensor,
    x: torch.Tensor,
    mask_hot: torch.Tensor,
    *,
    qtype: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t, k] = dot(w_hot[k], x[t]) where mask_hot[t, k], else 0; fp32 [T, K].

    w_hot: [K, D] float16 / bfloat16 / float32, or with qtype "q8_0" / "q4_0" the ggml blocks as
    uint8 [K, D / 32 * block_bytes]. x: [T, D] (computed in fp32). mask_hot: [T, K] bool.
    Rows that no token fires are not read.
    """
    w, code, d = _weights(w_hot, qtype, "hot_gather_matvec")
    k = w.shape[0]
    x, mask = _activations(x, mask_hot, w, d, k, "hot_gather_matvec", "x")
    t = x.shape[0]
    out = _out(out, (t, k), w.device, "hot_gather_matvec")
    if t == 0 or k == 0:
        return out.zero_()
    cfg = _config("matvec", t, w, code, d)
    grid = (triton.cdiv(k, cfg["BLOCK_K"]), triton.cdiv(t, cfg["BLOCK_T"]))
    launch(
        _matvec_kernel,
        grid,
        w, x, mask, out, k, d, t, w.stride(0), x.stride(0), mask.stride(0), out.stride(0), QTYPE=code, **cfg,
    )  # fmt: skip
    return out


def hot_axpy(
    w_hot_t: torch.Tensor,
    a: torch.Tensor,
    mask_hot: torch.Tensor,
    *,
    qtype: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k mask_hot[t, k] * a[t, k] * w_hot_t[k]; fp32 [T, D].

    w_hot_t: [K, D] rows of ffn_down_t (same formats as hot_gather_matvec). a: [T, K] (fp32).
    mask_hot: [T, K] bool. Rows with the mask false or a == 0 for every token are not read.
    Deterministic: per-split partial sums, added in a fixed order (no atomics).
    """
    w, code, d = _weights(w_hot_t, qtype, "hot_axpy")
    k = w.shape[0]
    a, mask = _activations(a, mask_hot, w, k, k, "hot_axpy", "a")
    t = a.shape[0]
    out = _out(out, (t, d), w.device, "hot_axpy")
    if t == 0 or k == 0 or d == 0:
        return out.zero_()
    cfg = _config("axpy", t, w, code, d)
    n_d = triton.cdiv(d, cfg["BLOCK_D"])
    n_blocks = triton.cdiv(k, cfg["BLOCK_K"])
    # Enough programs to fill the GPU (~4 per SM) even when D gives few column blocks.
    splits = max(1, min(n_blocks, triton.cdiv(4 * _sm_count(w.device), n_d)))
    rows_per_split = triton.cdiv(n_blocks, splits) * cfg["BLOCK_K"]
    splits = triton.cdiv(k, rows_per_split)
    # [S, T, D] partial sums; one split writes the result directly
    partial = out[None] if splits == 1 else torch.empty((splits, t, d), dtype=torch.float32, device=w.device)
    grid = (n_d, splits, triton.cdiv(t, cfg["BLOCK_T"]))
    launch(
        _axpy_kernel,
        grid,
        w,
        a,
        mask,
        partial,
        k,
        d,
        t,
        rows_per_split,
        w.stride(0),
        a.stride(0),
        mask.stride(0),
        partial.stride(0),
        partial.stride(1),
        QTYPE=code,
        **cfg,
    )
    return out if splits == 1 else torch.sum(partial, dim=0, out=out)


def _weights(w: torch.Tensor, qtype, who: str) -> tuple[torch.Tensor, int, int]:
    """(weights with unit column stride, kernel type code, D)."""
    if triton is None:
        raise RuntimeError(f"{who}: triton is not installed (pip install 'hotcold[gpu]')")
    name = _qtype_name(qtype, who)
    if w.ndim != 2:
        raise ValueError(f"{who}: weights must be 2-D [K, D], got shape {tuple(w.shape)}")
    if w.shape[1] > 1 and w.stride(1) != 1:
        w = w.contiguous()
    if name in _FLOAT_NAMES and w.dtype != _FLOAT_NAMES[name]:
        raise ValueError(f"{who}: qtype {name} does not match weights of dtype {w.dtype}")
    if name is None or name in _FLOAT_NAMES:
        name = None
        if w.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{who}: weights of dtype {w.dtype} need qtype='q8_0' or 'q4_0' (uint8 ggml blocks); "
                "float weights must be float16, bfloat16 or float32"
            )
        d = w.shape[1]
    else:
        block_bytes, block_values = QTYPES[name]
        if w.dtype != torch.uint8:
            raise ValueError(f"{who}: {name} weights must be uint8 ggml blocks, got dtype {w.dtype}")
        if w.shape[1] % block_bytes:
            raise ValueError(
                f"{who}: {name} rows of {w.shape[1]} bytes are not whole {block_bytes}-byte blocks"
            )
        d = w.shape[1] // block_bytes * block_values
        if w.data_ptr() % 2 or (w.shape[0] > 1 and w.stride(0) % 2):
            raise ValueError(f"{who}: {name} rows must start at even byte addresses (fp16 block scales)")
    if w.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            f"{who}: the weights are on the CPU; these kernels run on CUDA, or on the CPU only under "
            "the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported)"
        )
    return w, _QCODE[name], d


def _config(op: str, t: int, w: torch.Tensor, code: int, d: int) -> dict:
    """Block sizes: first guesses for the GPU, not tuned on one (see the module docstring); small
    tiles on the interpreter."""
    f32 = code == 0 and w.element_size() == 4
    precision = "ieee" if f32 else "tf32"
    if t >= DOT_MIN_TOKENS:  # a 64-token IEEE fp32 dot spills registers: F32 stops at 32
        block_t = min(16 if t <= 16 else 32 if t <= 32 else 64, 32 if f32 else 64)
        block_k = 64 if op == "matvec" else 32
        return dict(
            BLOCK_K=block_k, BLOCK_D=64, BLOCK_T=block_t, USE_DOT=True, PRECISION=precision, num_warps=4
        )
    block_t = triton.next_power_of_2(t)
    if w.device.type == "cpu":  # interpreter: small tiles so the tests cover several blocks and splits
        return dict(BLOCK_K=16, BLOCK_D=64, BLOCK_T=block_t, USE_DOT=False, PRECISION=precision)
    # [16, 256] tiles (F32: [16, 128]): 8 KiB of F16 per step, 16-byte loads over 4 warps; the matvec's
    # column loop pipelined 3 deep (its weight tiles as cp.async ahead of the sums)
    block_d = 128 if f32 else 256
    stages = {"STAGES": 3} if op == "matvec" else {}
    return dict(BLOCK_K=16, BLOCK_D=block_d, BLOCK_T=block_t, USE_DOT=False, PRECISION=precision, num_warps=4,
                **stages)  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a pretend GPU, so the tests see more than one row split
    return torch.cuda.get_device_properties(device).multi_processor_count
