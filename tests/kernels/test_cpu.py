"""hotcold.kernels.cpu (both backends) against a float64 torch reference, and hotcold.kernels.build.

Rows that no token needs are filled with NaN (float weights) or NaN block scales (ggml blocks):
a kernel that reads one of them shows NaN in its output. Every public op returns a result on both
backends (never None).
"""

import ctypes
import mmap
import os
import sys
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hotcold.gguf import quants
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import build, cabi, cpu
from tests.fixtures import E8M0_FIELDS, FP16_FIELDS, random_blocks

FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4"]
FORMATS += ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"]
FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QTYPE = {f: Q[f.upper()] for f in FORMATS if f not in FLOAT}
QUANTIZABLE = {"q8_0", "q4_0", "q5_0"}  # the others are random blocks with moderate scales
F = 1001  # not a multiple of any thread count
D_FLOAT = 100  # float types: a column tail that is not a multiple of the SIMD width
D_QUANT = 96
D_FOR = {f: 256 for f in QTYPE if gguf.GGML_QUANT_SIZES[QTYPE[f]][0] == 256}  # super-blocks of 256
NAN_F16 = np.array([np.nan], dtype=np.float16).view(np.uint8)


def make_weight(
    fmt: str, f: int, gen: torch.Generator, poison: torch.Tensor | None = None, d: int | None = None
):
    """(weight in its format, float64 reference [F, D]); rows in `poison` are NaN."""
    d = d or D_FOR.get(fmt, D_FLOAT if fmt in FLOAT else D_QUANT)
    w = torch.randn(f, d, generator=gen)
    if fmt in FLOAT:
        w = w.to(FLOAT[fmt])
        ref = w.double()
        if poison is not None:
            w[poison] = float("nan")
        return w, ref
    qtype = QTYPE[fmt]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if fmt in QUANTIZABLE:
        qt = QuantTensor.from_float(w, qtype)
    else:
        raw = random_blocks(qtype, f * d // block, np.random.default_rng(int(qtype) + f))
        for off in FP16_FIELDS[qtype.name]:  # scales (and mins) of a few hundredths
            scale = (np.random.default_rng(off).random(raw.shape[0]) * 0.02).astype(np.float16)
            raw[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        if qtype.name in E8M0_FIELDS:  # power-of-two scales 2^-11..2^-4 (values up to 0.75)
            raw[:, E8M0_FIELDS[qtype.name]] = np.random.default_rng(f).integers(117, 125, raw.shape[0])
        qt = QuantTensor(torch.from_numpy(raw.reshape(f, -1)), qtype, (f, d))
    ref = qt.dequantize().double()
    if poison is not None and qtype.name in E8M0_FIELDS:  # E8M0 has no NaN: the largest scale, inf once used
        qt.data.view(f, -1, size)[poison, :, E8M0_FIELDS[qtype.name]] = 254
    elif poison is not None:  # NaN scale in every block of a poisoned row
        off = FP16_FIELDS[qtype.name][0]
        qt.data.view(f, -1, size)[poison, :, off : off + 2] = torch.from_numpy(NAN_F16)
    return qt, ref


def masks(t: int, f: int, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    return {
        "random": torch.rand(t, f, generator=gen) < 0.2,
        "none-set": torch.zeros(t, f, dtype=torch.bool),
        "all-set": torch.ones(t, f, dtype=torch.bool),
        "dense": None,
    }


def ref_gather(w64: torch.Tensor, x: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w64.T
    return out if m is None else torch.where(m, out, torch.zeros((), dtype=torch.float64))


def ref_axpy(w64: torch.Tensor, a: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    active = (a != 0) if m is None else (a != 0) & m
    return torch.where(active, a.double(), torch.zeros((), dtype=torch.float64)) @ w64


def kernel_x(backend: str, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """The activations a gather over `fmt` weights multiplies: block weights on the C backend take x
    quantized to int8 per 32 values (scale amax / 127, float32, round half to even), as
    _cpu_kernels.c's xq_make does; everything else takes x itself."""
    if backend != "c" or fmt in FLOAT:
        return x
    c = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = c.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(c * inv).clamp(-127, 127)
    return (q.double() * (amax / torch.tensor(127.0)).double()).reshape(x.shape)


def assert_close(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor):
    """fp32 accumulation error is a small multiple of eps * sum |w * x| (`bound`); dropping or
    adding a single term is far larger."""
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * bound.max().item() + 1e-30)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 3, 17])
def test_gather_matvec(backend, fmt, t):
    gen = torch.Generator().manual_seed(t)
    for name, m in masks(t, F, gen).items():
        poison = None if m is None else ~m.any(0)
        w, w64 = make_weight(fmt, F, gen, poison)
        x = torch.randn(t, w64.shape[1], generator=gen)
        out = cpu.gather_matvec(w, x, m)
        assert out.shape == (t, F), name
        if m is not None:
            assert (out[~m] == 0).all(), name  # exactly zero, never NaN from a poisoned row
        xk = kernel_x(backend, fmt, x)  # the integer path: exact dot with the quantized x, to fp32 rounding
        assert_close(out, ref_gather(w64, xk, m), ref_gather(w64.abs(), xk.abs(), m))
        if xk is not x:  # and within the activations' rounding (half a step per value) of the true dot
            err = (out.double() - ref_gather(w64, x, m)).abs()
            step = (x.abs().reshape(t, -1, 32).amax(-1, keepdim=True) / 127).expand(-1, -1, 32).reshape(t, -1)
            assert (err <= ref_gather(w64.abs(), step.double() / 2, m) * 1.0001 + 1e-6).all(), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 3, 17])
def test_sparse_axpy(backend, fmt, t):
    gen = torch.Generator().manual_seed(100 + t)
    for name, m in masks(t, F, gen).items():
        a = torch.relu(torch.randn(t, F, generator=gen))  # about half exactly 0, as after a ReLU
        active = (a != 0) if m is None else (a != 0) & m
        w, w64 = make_weight(fmt, F, gen, ~active.any(0))
        out = cpu.sparse_axpy(w, a, m)
        assert out.shape == (t, w64.shape[1]), name
        assert_close(out, ref_axpy(w64, a, m), ref_axpy(w64.abs(), a.abs(), m))


@pytest.mark.parametrize("fmt", FORMATS)
def test_deterministic_across_threads_and_batching(backend, fmt):
    """Bit-identical for 1, 2 and 4 threads, and a 17-token batch equals token by token."""
    gen = torch.Generator().manual_seed(7)
    w, w64 = make_weight(fmt, F, gen)
    t = 17
    x = torch.randn(t, w64.shape[1], generator=gen)
    a = torch.relu(torch.randn(t, F, generator=gen))
    m = torch.rand(t, F, generator=gen) < 0.3
    g = {n: cpu.gather_matvec(w, x, m, threads=n) for n in (1, 2, 4)}
    y = {n: cpu.sparse_axpy(w, a, m, threads=n) for n in (1, 2, 4)}
    assert torch.equal(g[1], g[2]) and torch.equal(g[1], g[4])
    assert torch.equal(y[1], y[2]) and torch.equal(y[1], y[4])
    g_tok = torch.stack([cpu.gather_matvec(w, x[i], m[i], threads=2) for i in range(t)])
    y_tok = torch.stack([cpu.sparse_axpy(w, a[i], m[i], threads=2) for i in range(t)])
    if backend == "c":
        assert torch.equal(g[1], g_tok) and torch.equal(y[1], y_tok)
    else:  # torch's GEMM blocks differently for different T
        torch.testing.assert_close(g[1], g_tok, rtol=1e-5, atol=1e-5 * g[1].abs().max().item())
        torch.testing.assert_close(y[1], y_tok, rtol=1e-5, atol=1e-5 * y[1].abs().max().item())


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("t", [4, 8, 17, 52, 130])  # 130: past the listed tokens (HC_WANT_MAX)
def test_gather_rows_most_tokens_want(backend, fmt, t):
    """Masks whose rows range from wanted by no token to wanted by all (row i by about i / F of them), as a
    batch's hot and cold neurons: float rows that most tokens want take the every-token tile and set the
    others back to 0, the rest a pass over their own tokens. The float64 answer, exact zeros where not
    wanted (rows no token wants are NaN), and with the C backend the bits of 1 and 2 threads and of each
    token alone."""
    gen = torch.Generator().manual_seed(t)
    share = torch.arange(F, dtype=torch.float64) / F
    m = torch.rand(t, F, generator=gen, dtype=torch.float64) < share
    w, w64 = make_weight(fmt, F, gen, ~m.any(0), d=130)
    x = torch.randn(t, 130, generator=gen)
    out = {n: cpu.gather_matvec(w, x, m, threads=n) for n in (1, 2)}
    assert (out[1][~m] == 0).all()
    assert_close(out[1], ref_gather(w64, x, m), ref_gather(w64.abs(), x.abs(), m))
    if backend == "c":
        assert torch.equal(out[1], out[2])
        alone = torch.stack([cpu.gather_matvec(w, x[i], m[i], threads=2) for i in range(t)])
        assert torch.equal(out[1], alone)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
@pytest.mark.parametrize("d", [768, 1024])
def test_kquant_rows_over_several_super_blocks(backend, fmt, d):
    """Rows of 3 and 4 super-blocks: the kernels that decode a super-block's scales once, or unroll its
    chunks, step from block to block. With 2 threads the batch axpy splits 1024 columns at a block edge
    (its block-at-a-time path) and 768 inside a block (its chunk loop). The float64 answer for gathers and
    axpys, and the same bits for 1, 2 and 3 threads and for each token alone."""
    gen = torch.Generator().manual_seed(d)
    w, w64 = make_weight(fmt, 203, gen, d=d)
    t = 3
    x = torch.randn(t, d, generator=gen)
    a = torch.relu(torch.randn(t, 203, generator=gen))
    m = torch.rand(t, 203, generator=gen) < 0.4
    xk = kernel_x(backend, fmt, x)
    g = {n: cpu.gather_matvec(w, x, m, threads=n) for n in (1, 2, 3)}
    y = {n: cpu.sparse_axpy(w, a, m, threads=n) for n in (1, 2, 3)}
    assert_close(g[1], ref_gather(w64, xk, m), ref_gather(w64.abs(), xk.abs(), m))
    assert_close(y[1], ref_axpy(w64, a, m), ref_axpy(w64.abs(), a.abs(), m))
    if backend == "c":
        assert torch.equal(g[1], g[2]) and torch.equal(g[1], g[3])
        assert torch.equal(y[1], y[2]) and torch.equal(y[1], y[3])
        for i in range(t):
            for n in (1, 2):
                assert torch.equal(cpu.gather_matvec(w, x[i], m[i], threads=n), g[1][i])
                assert torch.equal(cpu.sparse_axpy(w, a[i], m[i], threads=n), y[1][i])


def test_axpy_blocks_and_wide_rows(backend):
    """Several 64-row blocks, several 256-column ranges of the ordered block sum, a column tail, three
    threads: still the float64 answer, and bit-identical by threads and batching (C backend)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1400, 600, generator=gen).half()  # 600 = 2 * 256 + 88: ranges and a tail of 24
    a = torch.relu(torch.randn(5, 1400, generator=gen))
    m = torch.rand(5, 1400, generator=gen) < 0.6  # ~420 active rows a token: 7 blocks
    check_batch_axpy(backend, w, a, m, token_threads=(1, 3))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [229, 433, 704])
def test_axpy_batch_every_chunk_remainder(backend, fmt, d):
    """The float batch axpy of more than HC_TBLOCK_MAX_T (16) tokens passes over a column item's chunks
    AXPY_CHUNKS at a time (3 on AVX2, 4 on AVX-512) and then the rest: these widths and thread counts give
    items of every length mod 3 and mod 4, with and without a column tail (AVX-512 once read and wrote a 4th
    chunk past an item of 3)."""
    gen = torch.Generator().manual_seed(d)
    w = torch.randn(300, d, generator=gen).to(FLOAT[fmt])
    a = torch.relu(torch.randn(17, 300, generator=gen))
    m = torch.rand(17, 300, generator=gen) < 0.6  # ~90 active rows a token: two 64-row blocks
    check_batch_axpy(backend, w, a, m, token_threads=(2,))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("t", [2, 8, 16])
def test_batch_axpy_by_token_blocks(backend, fmt, t):
    """Float rows and up to HC_TBLOCK_MAX_T (16) tokens: each token's blocks of 64 rows computed one by one, all
    tokens' blocks handed out by their first rows (hot rows most tokens take, cold rows one token takes, rows
    hundreds apart), then added in block order: the float64 answer, the same bits for 1, 2 and 3 threads and
    for each token alone, rows nobody takes never read, a NaN coefficient in its own token's output only."""
    # 7 chunks and a column tail of 6; hot rows ~5 blocks a token; the NaN coefficient in the last token
    check_hot_cold_far_axpy(
        backend, fmt, t, 230, hot=(300, 0.9), cold_end=1200, far_step=37, seed=t, weights=2
    )


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_0"])
@pytest.mark.parametrize("d", [224, 416, 704])  # 7, 13, 22 blocks: every remainder mod 3 and mod 4
def test_one_chunk_blocks_batch_axpy_every_chunk_remainder(backend, fmt, d):
    """Q8_0, Q4_0 and Q5_0 take the float batch axpy's register-held sums too (a block is one chunk): the
    float64 answer, the same bits for any thread count and for each token alone."""
    gen = torch.Generator().manual_seed(d)
    w = QuantTensor.from_float(torch.randn(300, d, generator=gen), QTYPE[fmt])
    a = torch.relu(torch.randn(5, 300, generator=gen))
    m = torch.rand(5, 300, generator=gen) < 0.6
    check_batch_axpy(backend, w, a, m, token_threads=(2,))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0"])
def test_batch_axpy_copied_and_direct_groups(backend, fmt):
    """The listed batch axpy copies a group's rows side by side where its tokens take them twice on average
    or more, and reads the matrix where they do not: here the first rows are taken by most of 24 tokens
    (copied groups), the next by one token each (read in place), and the last few lie hundreds of rows
    apart (a group spanning most of the matrix). NaN rows nobody takes, a NaN coefficient, blocks of 64
    rows and a column tail: the float64 answer, and the same bits for any thread count and token alone."""
    d = 100 if fmt in FLOAT else 96
    check_hot_cold_far_axpy(
        backend, fmt, 24, d, hot=(400, 0.8), cold_end=1000, far_step=97, seed=24, weights=1
    )


def check_hot_cold_far_axpy(backend, fmt, t, d, *, hot, cold_end, far_step, seed, weights) -> None:
    """A batch axpy over 1500 rows of d columns: rows [0, hot[0]) taken by a share hot[1] of the t tokens, then
    to cold_end by about one token each, then every far_step-th row by half of them; coefficients 0 or 3 where the
    mask is not set. check_batch_axpy, then: rows nobody takes NaN are never read, and a NaN coefficient of the
    last token reaches that token's output only."""
    gen = torch.Generator().manual_seed(seed)
    f = 1500
    share = torch.zeros(f, dtype=torch.float64)
    share[: hot[0]] = hot[1]
    share[hot[0] : cold_end] = 1.0 / t
    share[cold_end::far_step] = 0.5
    m = torch.rand(t, f, generator=gen, dtype=torch.float64) < share
    a = torch.rand(t, f, generator=gen) + 0.1
    a[m.logical_not()] = torch.where(torch.rand(t, f, generator=gen) < 0.5, 0.0, 3.0)[m.logical_not()]
    w, _ = make_weight(fmt, f, torch.Generator().manual_seed(weights), d=d)
    check_batch_axpy(backend, w, a, m, token_threads=(1, 2))
    y = cpu.sparse_axpy(w, a, m, threads=2)
    poisoned, _ = make_weight(fmt, f, torch.Generator().manual_seed(weights), ~m.any(0), d=d)
    assert torch.equal(cpu.sparse_axpy(poisoned, a, m, threads=2), y)
    a[t - 1, 5], m[t - 1, 5] = float("nan"), True
    y = cpu.sparse_axpy(w, a, m, threads=2)
    assert y[t - 1].isnan().all() and not y[: t - 1].isnan().any()


def check_batch_axpy(backend, w, a, m, *, token_threads) -> None:
    """sparse_axpy of a batch at 1, 2 and 3 threads: the float64 answer; with the C backend the same bits
    for every thread count, and for each token alone at `token_threads`."""
    w64 = w.dequantize().double() if isinstance(w, QuantTensor) else w.double()
    ref = ref_axpy(w64, a, m)
    bound = ref_axpy(w64.abs(), a.abs(), m)
    y = {n: cpu.sparse_axpy(w, a, m, threads=n) for n in (1, 2, 3)}
    for n in (1, 2, 3):
        assert_close(y[n], ref, bound)
    if backend == "c":
        assert torch.equal(y[1], y[2]) and torch.equal(y[1], y[3])
        for i in range(a.shape[0]):
            for n in token_threads:
                assert torch.equal(cpu.sparse_axpy(w, a[i], m[i], threads=n), y[1][i])


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_1", "q3_k", "q4_k", "q6_k"])
@pytest.mark.parametrize(
    "t", [1, 50, 100, 200]
)  # 50: the C kernels for many tokens; 100, 200: see runs_c_kernel
def test_matmul(backend, fmt, t):
    gen = torch.Generator().manual_seed(3)
    w, w64 = make_weight(fmt, 300, gen)
    x = torch.randn(t, w64.shape[1], generator=gen)
    xk = kernel_x(backend, fmt, x) if cpu.runs_c_kernel(w, t) else x  # else dequantize + GEMM
    assert_close(cpu.matmul(w, x), xk.double() @ w64.T, xk.double().abs() @ w64.abs().T)
    x0 = kernel_x(backend, fmt, x[:1])
    assert_close(cpu.matmul(w, x[0]), (x0.double() @ w64.T)[0], x0.double().abs() @ w64.abs().T)


@pytest.mark.parametrize("fmt", ["f16", "bf16", "q4_0", "q8_0"])
def test_matmul_past_gemm_min_tokens_keeps_each_rows_bits(fmt, monkeypatch):
    """Packed weights (any T) and float tiles (below FLOAT_TILE_MAX_TOKENS) stay in the C kernels past
    GEMM_MIN_TOKENS: each token's row equals that token multiplied alone."""
    # the C backend whichever `backend` parameter is active (its torch one sets HOTCOLD_NO_CEXT), and that
    # one's library again afterwards (the reset runs before monkeypatch restores the variable)
    monkeypatch.delenv("HOTCOLD_NO_CEXT", raising=False)
    cpu._reset_for_tests()
    try:
        _matmul_past_gemm_min_tokens(fmt)
    finally:
        cpu._reset_for_tests()


def _matmul_past_gemm_min_tokens(fmt):
    if cpu.backend() != "c":
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(21)
    w, _ = make_weight(fmt, 96, gen)
    if isinstance(w, QuantTensor):
        w = cpu.pack(w)
        assert w.packed is not None
    t = cpu.GEMM_MIN_TOKENS + 24
    assert t < cpu.FLOAT_TILE_MAX_TOKENS and cpu.runs_c_kernel(w, t)
    x = torch.randn(t, w.shape[1], generator=gen)
    out = cpu.matmul(w, x, threads=2)
    for i in (0, 57, t - 1):
        assert torch.equal(out[i], cpu.matmul(w, x[i], threads=1))


@pytest.mark.parametrize("t", [1, 3])
def test_matvec_group_equals_separate_calls(backend, t):
    """q, k, v-like matrices of different row counts and types in one call: the very bits of matmul."""
    gen = torch.Generator().manual_seed(12)
    d = D_QUANT
    ws = [
        torch.randn(200, d, generator=gen).half(),
        QuantTensor.from_float(torch.randn(37, d, generator=gen), Q.Q8_0),
        torch.randn(64, d, generator=gen).bfloat16(),
    ]
    x = torch.randn(t, d, generator=gen)
    for threads in (1, 2, 3):
        got = cpu.MatvecGroup(ws)(x, threads=threads)
        for g, w in zip(got, ws, strict=True):
            assert torch.equal(g, cpu.matmul(w, x, threads=1))
    assert [g.shape for g in cpu.MatvecGroup(ws)(x[0])] == [(200,), (37,), (64,)]


def test_dequantize_rows(backend):
    gen = torch.Generator().manual_seed(4)
    for fmt in FORMATS:
        w, w64 = make_weight(fmt, 50, gen)
        assert torch.equal(cpu.dequantize_rows(w, 5, 20).double(), w64[5:20])


def test_strided_and_shared_mask_inputs(backend):
    """Row views of a larger matrix (row stride > D) and a [F] mask shared by all tokens."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(F, 160, generator=gen).half()
    w = big[:, :D_FLOAT]
    x = torch.randn(3, D_FLOAT, generator=gen)
    m = torch.rand(F, generator=gen) < 0.5
    ref = ref_gather(w.double(), x, m.expand(3, -1))
    assert_close(cpu.gather_matvec(w, x, m), ref, ref_gather(w.double().abs(), x.abs(), m.expand(3, -1)))
    a = torch.randn(3, F, generator=gen)
    mm = m.expand(3, -1)
    assert_close(
        cpu.sparse_axpy(w, a, m), ref_axpy(w.double(), a, mm), ref_axpy(w.double().abs(), a.abs(), mm)
    )


def test_bad_inputs(backend):
    w = torch.randn(64, 32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"x has shape \(2, 31\), expected \[T, 32\]"):
        cpu.gather_matvec(w, torch.randn(2, 31), None)
    with pytest.raises(ValueError, match=r"rows mask has shape \(2, 63\), expected \[2, 64\]"):
        cpu.gather_matvec(w, x, torch.ones(2, 63, dtype=torch.bool))
    with pytest.raises(ValueError, match="rows must be a bool mask"):
        cpu.sparse_axpy(w, torch.randn(2, 64), torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight rows must be contiguous"):
        cpu.gather_matvec(torch.randn(32, 64).T, x, None)
    with pytest.raises(ValueError, match="2-D float32/float16/bfloat16"):
        cpu.gather_matvec(torch.randn(64, 32).double(), x, None)
    with pytest.raises(TypeError, match="torch.Tensor or a QuantTensor"):
        cpu.gather_matvec(np.zeros((64, 32), np.float32), x, None)


def test_fallback_without_compiler(monkeypatch, caplog):
    """A broken compiler means the torch kernels and one warning, never an error."""
    monkeypatch.delenv("HOTCOLD_NO_CEXT", raising=False)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu._reset_for_tests()
    try:
        with caplog.at_level("WARNING", logger="hotcold.kernels.build"):
            assert cpu.backend() == "torch"
            w = torch.randn(64, 32)
            x = torch.randn(1, 32)
            torch.testing.assert_close(cpu.gather_matvec(w, x, None), x @ w.T)
            assert cpu.backend() == "torch"
        assert sum("torch" in r.message for r in caplog.records) == 1
    finally:
        monkeypatch.undo()
        cpu._reset_for_tests()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "c"))
    assert build._cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HOTCOLD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build._cache_dir() == tmp_path / "hotcold"


def test_unwritable_cache_dir_falls_back(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(blocked / "sub"))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    d = build._writable_cache_dir()
    assert d is not None and d.parent == tmp_path / "tmp"


def test_rms_norm(backend):
    """A tensor on both backends, for any input (the C path takes float32 [T, D]; the rest is torch)."""
    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(3, 300, generator=gen) * 5, torch.randn(300, generator=gen)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu.rms_norm(x[None], w, 1e-5)[0].double(), ref, rtol=1e-5, atol=1e-5)
    half = cpu.rms_norm(x.half(), w.half(), 1e-5)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), ref, rtol=1e-2, atol=1e-2)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """float64 RoPE of x [H, Dh] with cos/sin [R/2]: pairs (2j, 2j+1), or (j, j+R/2) for neox; the rest
    passes through."""
    out, half = x.double().clone(), cos.shape[0]
    a = torch.arange(half) if neox else 2 * torch.arange(half)
    b = a + half if neox else a + 1
    x0, x1 = out[:, a].clone(), out[:, b].clone()
    out[:, a], out[:, b] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize(
    "neox, rope_dim, window, n_kv, cache_dtype",
    [
        (False, 64, None, 2, torch.float32),
        (True, 32, None, 8, torch.float32),
        (False, 64, 5, 1, torch.float32),
        (True, 48, 4, 2, torch.float16),  # fp16 caches (a GPU in the model): torch on both backends
    ],
)
def test_attention_decode(backend, neox, rope_dim, window, n_kv, cache_dtype):
    """RoPE (normal and neox, partial rotary dims), GQA / MHA / MQA and a sliding window over 12 positions
    of a cache, against a float64 reference; q and k are rotated in place on both backends."""
    gen = torch.Generator().manual_seed(14)
    h, dh, steps, n_ctx = 8, 64, 12, 32
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_t, sin_t = angles.cos().float(), angles.sin().float()
    kc, vc = (torch.zeros(n_ctx, n_kv, dh, dtype=cache_dtype) for _ in range(2))
    keys, values = [], []
    tol = 1e-5 if cache_dtype == torch.float32 else 3e-3
    for pos in range(steps):
        q = torch.randn(1, h, dh, generator=gen)
        k, v = torch.randn(1, n_kv, dh, generator=gen), torch.randn(1, n_kv, dh, generator=gen)
        cos, sin = cos_t[pos : pos + 1], sin_t[pos : pos + 1]
        q_rot, k_rot = (
            ref_rope(q[0], cos[0].double(), sin[0].double(), neox),
            ref_rope(k[0], cos[0].double(), sin[0].double(), neox),
        )
        keys.append(k_rot)
        values.append(v[0].double())
        lo = max(0, pos - window + 1) if window else 0
        kk, vv = torch.stack(keys[lo:]), torch.stack(values[lo:])  # [S, Hkv, Dh]
        kv_head = torch.arange(h) // (h // n_kv)
        scores = torch.einsum("hd,shd->hs", q_rot, kk[:, kv_head]) / dh**0.5
        ref = torch.einsum("hs,shd->hd", scores.softmax(-1), vv[:, kv_head]).reshape(1, h * dh)
        q2, k2 = q.clone(), k.clone()
        got = cpu.attention_decode(
            q2, k2, v, kc, vc, pos, cos, sin, neox=neox, sliding_window=window, threads=2
        )
        assert got.shape == (1, h * dh) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(q2[0].double(), q_rot, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k2[0].double(), k_rot, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kc[pos].double(), k_rot, rtol=tol, atol=tol)
        assert torch.equal(vc[pos], v[0].to(cache_dtype))


@pytest.mark.parametrize("softcap, sinks", [(0.0, False), (2.5, False), (0.0, True)])
@pytest.mark.parametrize("dh", [32, 64, 80, 128])
def test_attention_decode_long_context(backend, dh, softcap, sinks):
    """Contexts past the vector width (the C kernel scores, exponentiates and sums VL positions at a time, with
    scalar tails): positions 15-120, odd and even counts, a window, against float64; GQA with 12 query heads a
    kv head (the kernel takes them 8 and 4 at a time); head sizes that are and are not a multiple of the vector
    width (80 takes the scalar path on AVX-512); scores soft-capped (Gemma 2: cap * tanh(s / cap)) or not; a sink
    logit per head in each softmax's denominator (gpt-oss) or not."""
    gen = torch.Generator().manual_seed(dh)
    h, n_kv, n_ctx = 24, 2, 128
    cos_t, sin_t = torch.rand(n_ctx, dh // 2, generator=gen), torch.rand(n_ctx, dh // 2, generator=gen)
    kc, vc = torch.randn(n_ctx, n_kv, dh, generator=gen), 3 * torch.randn(n_ctx, n_kv, dh, generator=gen)
    for pos, window in [(15, None), (16, None), (47, None), (120, None), (120, 37)]:
        q = 2 * torch.randn(1, h, dh, generator=gen)
        k, v = torch.randn(1, n_kv, dh, generator=gen), torch.randn(1, n_kv, dh, generator=gen)
        cos, sin = cos_t[pos : pos + 1], sin_t[pos : pos + 1]
        q_rot = ref_rope(q[0], cos[0].double(), sin[0].double(), False)
        k_rot = ref_rope(k[0], cos[0].double(), sin[0].double(), False)
        keys, values = kc.double().clone(), vc.double().clone()
        keys[pos], values[pos] = k_rot, v[0].double()
        lo = max(0, pos - window + 1) if window else 0
        kv_head = torch.arange(h) // (h // n_kv)
        kk, vv = keys[lo : pos + 1][:, kv_head], values[lo : pos + 1][:, kv_head]
        scores = torch.einsum("hd,shd->hs", q_rot, kk) / dh**0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        sink = 3 * torch.randn(h, generator=gen) if sinks else None
        if sinks:  # a column in the denominator that attends to nothing
            probs = torch.cat([scores, sink.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        ref = torch.einsum("hs,shd->hd", probs, vv).reshape(1, h * dh)
        got = cpu.attention_decode(q.clone(), k.clone(), v, kc, vc, pos, cos, sin, neox=False,
                                   sliding_window=window, softcap=softcap, sinks=sink, threads=2)  # fmt: skip
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_attention_decode_bad_inputs(backend):
    q, k = torch.randn(1, 4, 16), torch.randn(1, 2, 16)
    kc, vc = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="context overflow: position 9 exceeds the context size 8"):
        cpu.attention_decode(q, k, k.clone(), kc, vc, 8, cos, sin, neox=False)
    with pytest.raises(ValueError, match="caches"):
        cpu.attention_decode(torch.randn(1, 3, 16), k, k.clone(), kc, vc, 0, cos, sin, neox=False)
    with pytest.raises(ValueError, match="caches"):
        cpu.attention_decode(torch.randn(2, 4, 16), k, k.clone(), kc, vc, 0, cos, sin, neox=False)
    with pytest.raises(ValueError, match="cos/sin"):
        cpu.attention_decode(q, k, k.clone(), kc, vc, 0, torch.ones(1, 9), torch.ones(1, 9), neox=False)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_decode_rows_equals_each_row_alone(backend, window):
    """A batched decode step's attention (one token of each of 3 sequences, each over its own cache at its
    own position) equals attention_decode of each row alone, bit for bit, caches included."""
    gen = torch.Generator().manual_seed(15)
    h, n_kv, dh, n_ctx, r = 8, 2, 16, 16, 8
    positions = [0, 6, 11]
    cos_t, sin_t = torch.rand(n_ctx, r // 2, generator=gen), torch.rand(n_ctx, r // 2, generator=gen)
    caches = [[torch.randn(n_ctx, n_kv, dh, generator=gen) for _ in range(2)] for _ in positions]
    alone_caches = [[c.clone() for c in kv] for kv in caches]
    q, k, v = (torch.randn(3, n, dh, generator=gen) for n in (h, n_kv, n_kv))
    idx = torch.tensor(positions)
    got = cpu.attention_decode_rows(
        q.clone(),
        k.clone(),
        v,
        [c[0] for c in caches],
        [c[1] for c in caches],
        positions,
        cos_t[idx],
        sin_t[idx],
        neox=False,
        sliding_window=window,
        threads=2,
    )
    for j, p in enumerate(positions):
        kc, vc = alone_caches[j]
        alone = cpu.attention_decode(
            q[j : j + 1].clone(),
            k[j : j + 1].clone(),
            v[j : j + 1],
            kc,
            vc,
            p,
            cos_t[p : p + 1],
            sin_t[p : p + 1],
            neox=False,
            sliding_window=window,
            threads=1,
        )
        assert torch.equal(got[j : j + 1], alone)
        assert torch.equal(caches[j][0], kc) and torch.equal(caches[j][1], vc)
    with pytest.raises(ValueError, match="context overflow: position 17"):
        cpu.attention_decode_rows(
            q,
            k,
            v,
            [c[0] for c in caches],
            [c[1] for c in caches],
            [0, 6, 16],
            cos_t[idx],
            sin_t[idx],
            neox=False,
        )


@pytest.mark.parametrize("t", [1, 3, 50])  # 50: separate matmuls (the blocked-GEMM path)
def test_matvec_group_with_norm(backend, t):
    """The norm inside the call (C, few tokens) or rms_norm first: the same bits as norm-then-matmul."""
    gen = torch.Generator().manual_seed(16)
    d = D_QUANT
    ws = [
        torch.randn(70, d, generator=gen).half(),
        QuantTensor.from_float(torch.randn(40, d, generator=gen), Q.Q4_0),
    ]
    x = torch.randn(t, d, generator=gen)
    norm = (torch.rand(d, generator=gen) + 0.5, 1e-6)
    h = cpu.rms_norm(x, *norm)
    for g, w in zip(cpu.MatvecGroup(ws)(x, norm=norm, threads=2), ws, strict=True):
        assert torch.equal(g, cpu.matmul(w, h, threads=1))


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED - quants.FLOAT_TYPES))
def test_dequantize_rows_bit_exact_with_ggml(backend, qtype):
    """Whole tensors, row ranges, index and mask rows, into `out`: gguf's numpy port of ggml, bit for bit."""
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 1024, rng)
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(16, 64 * bs))
    qt = QuantTensor(torch.from_numpy(raw.reshape(16, -1)), qtype, (16, 64 * bs))
    bits = lambda t: t.view(torch.int32)  # noqa: E731 (NaN-safe, -0-aware equality)
    assert torch.equal(bits(cpu.dequantize_rows(qt)), bits(ref))
    assert torch.equal(bits(cpu.dequantize_rows(qt, 3, 11)), bits(ref[3:11]))
    idx = torch.tensor([15, 0, 7, 7])
    assert torch.equal(bits(cpu.dequantize_rows(qt, index=idx)), bits(ref[idx]))
    mask = torch.zeros(16, dtype=torch.bool)
    mask[[2, 9]] = True
    out = torch.full((2, 64 * bs), 5.0)
    assert cpu.dequantize_rows(qt, index=mask, out=out) is out and torch.equal(bits(out), bits(ref[mask]))
    assert torch.equal(bits(cpu.dequantize_rows(qt)), bits(qt.dequantize()))  # the pure path agrees


def test_dequantize_rows_bad_inputs(backend):
    qt = QuantTensor.from_float(torch.randn(10, 64), Q.Q8_0)
    with pytest.raises(ValueError, match=r"rows \[5, 11\)"):
        cpu.dequantize_rows(qt, 5, 11)
    with pytest.raises(ValueError, match="out of range"):
        cpu.dequantize_rows(qt, index=torch.tensor([10]))
    with pytest.raises(ValueError, match="either a row range or an index"):
        cpu.dequantize_rows(qt, 1, index=torch.tensor([0]))
    with pytest.raises(ValueError, match="out must be"):
        cpu.dequantize_rows(qt, out=torch.empty(10, 32))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q6_k", "mxfp4"])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_packed_matmul(backend, fmt, t):
    """Q4_0, Q8_0, Q4_K, Q6_K and MXFP4 repacked for whole-matrix products (rows in groups of 8; 1001 rows: a padded last group):
    the dot with the quantized x to fp32 rounding, bit-identical for any thread count and for a batch
    against token by token; the row kernel's answer to a few ulps."""
    gen = torch.Generator().manual_seed(21)
    w, w64 = make_weight(fmt, F, gen)
    d = w64.shape[1]
    before = w.data.clone()
    p = cpu.pack(w)
    assert torch.equal(w.data, before)  # memory that is not a file mapping is never handed back
    if backend == "torch":  # no C kernels: nothing to pack for
        assert p is w
        return
    per_group = {
        "q4_0": d // 32 * 144,
        "q8_0": d // 32 * 272,
        "q4_k": d // 256 * (32 + 8 * 144),
        "q6_k": d // 256 * 8 * 210,
        "mxfp4": d // 32 * 8 * 17,
    }[fmt]
    assert p.packed is not None and p.packed.numel() == (F + 7) // 8 * per_group
    assert torch.equal(p.data, w.data) and p == w  # the rows themselves are untouched
    x = torch.randn(t, d, generator=gen)
    xk = kernel_x(backend, fmt, x)
    out = {n: cpu.matmul(p, x, threads=n) for n in (1, 2, 3)}
    assert_close(out[1], xk.double() @ w64.T, xk.double().abs() @ w64.abs().T)
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])
    assert torch.equal(torch.stack([cpu.matmul(p, x[i]) for i in range(t)]), out[1])
    torch.testing.assert_close(out[1], cpu.matmul(w, x), rtol=0, atol=1e-5 * out[1].abs().max().item())
    assert p.select_rows(torch.tensor([0, 5])).packed is None and p.to("cpu").packed is None
    # a group of packed matrices (q, k, v) is one C call with the bits of separate calls, norm included
    # another packed type as wide; 36 rows: a short last group
    other = {"q4_0": "q8_0", "q8_0": "q4_0", "q4_k": "q6_k", "q6_k": "q4_k", "mxfp4": "q4_0"}[fmt]
    p2 = cpu.pack(make_weight(other, 36, gen)[0])
    assert_group_is_separate_calls([p, p2, p], x, (torch.rand(d, generator=gen) + 0.5, 1e-5))
    with pytest.raises(ValueError, match="all packed or none"):
        cpu.MatvecGroup([p, w])


def assert_group_is_separate_calls(mats, x, norm):
    """A group of packed matrices (q, k, v) is one C call with the bits of separate calls, its norm included,
    for 1 and 2 threads."""
    h = cpu.rms_norm(x, *norm)
    for threads in (1, 2):
        got = cpu.MatvecGroup(mats)(x, norm=norm, threads=threads)
        want = [cpu.matmul(q, h, threads=3) for q in mats]
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))


def test_pack_leaves_other_weights_alone(backend):
    gen = torch.Generator().manual_seed(22)
    for fmt in ("q5_0", "q5_k"):
        w, _ = make_weight(fmt, 64, gen)
        assert cpu.pack(w) is w
    f32 = torch.randn(8, 64, generator=gen)
    assert cpu.pack(f32) is f32  # float32 goes to torch's own products


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 8, 13])  # 8: two token tiles, which take shorter passes
def test_packed_f16_is_one_chain_per_output(backend, t, dtype):
    """A float16 / bfloat16 matrix packs too (rows in vector blocks, tokens broadcast): each (row, token) is one fma chain
    over the columns in order, so a token's result is the same bits alone, in any batch, with any thread count;
    the values are the matrix product; a group mixing it with a packed block type is one call, same bits."""
    gen = torch.Generator().manual_seed(23)
    f, d = 70, 96  # a short last block of rows
    w = torch.randn(f, d, generator=gen).to(dtype)
    p = cpu.pack(w)
    if backend == "torch":
        assert p is w
        return
    assert isinstance(p, QuantTensor) and p.packed is not None and torch.equal(p.data.view(dtype), w)
    x = torch.randn(t, d, generator=gen)
    out = {n: cpu.matmul(p, x, threads=n) for n in (1, 2, 3)}
    want = x.double() @ w.double().T
    torch.testing.assert_close(out[1].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])
    assert torch.equal(torch.stack([cpu.matmul(p, x[i]) for i in range(t)]), out[1])
    chain = torch.zeros(t, f)  # the chain in column order, float32 (addcmul need not fuse: a tolerance)
    for k in range(d):
        chain = torch.addcmul(chain, x[:, k : k + 1], w[:, k].float().unsqueeze(0))
    torch.testing.assert_close(out[1], chain, rtol=0, atol=1e-5 * want.abs().max().item())
    q4 = cpu.pack(make_weight("q4_0", 36, gen, d=d)[0])
    assert_group_is_separate_calls([p, q4, p], x, (torch.rand(d, generator=gen) + 0.5, 1e-5))
    assert p.select_rows(torch.tensor([0, 5])).packed is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore are Linux's")
def test_prefetch_pages_reads_a_mapped_weight_in_ahead(tmp_path):
    """The embedding is read a row at a time in no order: prefetch_pages has the OS read all of a mapped
    weight in (MADV_WILLNEED, in chunks: one call reads only a few MiB), so a new token's row does not wait
    for the disk."""
    path = tmp_path / "w.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    w = torch.from_numpy(np.memmap(path, dtype=np.float16, mode="c").reshape(-1, 4096))  # as the reader maps
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = w.numel() * 2
    pages = (ctypes.c_ubyte * ((n + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()

    def resident() -> float:
        libc.mincore(ctypes.c_void_p(w.data_ptr()), ctypes.c_size_t(n), pages)
        return sum(p & 1 for p in pages) / len(pages)

    if resident() > 0.5:
        pytest.skip("this file system keeps the file's pages (tmpfs?): nothing to read in")
    assert cpu.prefetch_pages(w) is w
    deadline = time.monotonic() + 20
    while resident() < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident() >= 0.99


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return set()


@pytest.mark.skipif(
    not {"avx512_vnni", "avx_vnni"} & _cpu_flags(),
    reason="this CPU has no VNNI: the native build and a build without VNNI are the same code",
)
def test_vnni_kernels_give_the_bits_of_the_kernels_without_vnni(tmp_path):
    """The integer-dot kernels use dpbusd where the CPU has VNNI (AVX512-VNNI, AVX-VNNI) and maddubs +
    madd elsewhere; Q4_0's one-token rows take a 512-bit kernel. The integer sums are exact either way,
    so a build with VNNI compiled out must give the same bits: row gathers (one token and a batch, with
    and without a mask, odd chunk counts) and packed GEMVs, for every block type."""
    lib = build.get_lib()
    if lib is None or build.simd() == "generic":
        pytest.skip("no native C build")
    cc = os.environ.get("CC") or "cc"
    out = tmp_path / "novnni.so"
    if not build._compile(cc, ["-O3", "-march=native", "-mno-avx512vnni", "-mno-avxvnni", "-fopenmp"], out):
        pytest.skip("the compiler does not take -mno-avx512vnni / -mno-avxvnni")
    plain = ctypes.CDLL(str(out))
    cabi.bind(plain)
    rng = np.random.default_rng(5)
    packable = {Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4}
    for fmt in [f for f in FORMATS if f not in FLOAT]:
        qtype = QTYPE[fmt]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        for d in (block, 3 * block, 5 * block, 2048):  # odd chunk counts: the 512-bit kernel's last chunk
            f = 37
            raw = random_blocks(qtype, f * (d // block), rng).reshape(f, -1)
            wt, stride = build.WT[qtype], raw.shape[1]
            for t in (1, 3):
                x = rng.standard_normal((t, d)).astype(np.float32)
                mask = (rng.random((t, f)) < 0.5).astype(np.uint8)
                for m in (None, mask):
                    outs = []
                    for k in (lib, plain):
                        o = np.full((t, f), 7.0, np.float32)
                        mp = None if m is None else m.ctypes.data
                        assert (
                            k.hc_gather_matvec(
                                wt, raw.ctypes.data, stride, f, d, x.ctypes.data, t, mp, o.ctypes.data, 2
                            )
                            == 0
                        )
                        outs.append(o)
                    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (
                        fmt,
                        d,
                        t,
                        m is None,
                    )
                if qtype in packable and lib.hc_packed_nbytes(wt, f, d) > 0:
                    outs = []
                    for k in (lib, plain):
                        packed = np.zeros(k.hc_packed_nbytes(wt, f, d), np.uint8)
                        assert k.hc_pack(wt, raw.ctypes.data, stride, f, d, packed.ctypes.data) == 0
                        o = np.full((t, f), 7.0, np.float32)
                        assert (
                            k.hc_packed_matvec(
                                wt, packed.ctypes.data, f, d, x.ctypes.data, t, o.ctypes.data, 2
                            )
                            == 0
                        )
                        outs.append(o)
                    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (
                        "packed",
                        fmt,
                        d,
                        t,
                    )
