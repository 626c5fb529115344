"""The packed GEMM (kernels/c/packed_gemm.c): a prompt chunk's products over the packed copy of Q4_0, Q8_0, Q4_K and
Q6_K matrices. Each output must be the bits the one-token GEMV gives for that row and token, whatever the token count
(tiles of 8 and their tails), the row count (tiles of 16 rows: a lone last group, a short one) and the threads; and
the dot of the dequantized rows with the int8-quantized activations, to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from hotcold.kernels import cpu
from tests.kernels.test_cpu import assert_close, kernel_x, make_weight

GEMM_TOKENS = [8, 9, 23, 40]  # from the GEMM's first token count: one tile, a tail of 1, of 7, five tiles
ROWS = [36, 64]  # 36: five groups of 8 (the last row tile holds one group), the last group 4 rows; 64: even


@pytest.fixture(scope="module")
def c_kernels():
    if cpu.backend() != "c":
        pytest.skip("the C kernels are not built")


def packed(fmt: str, f: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w, w64 = make_weight(fmt, f, gen)
    p = cpu.pack(w)
    assert p.packed is not None
    return p, w64, gen


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("f", ROWS)
def test_gemm_is_the_gemv_bit_for_bit(c_kernels, fmt, f):
    p, w64, gen = packed(fmt, f, 31 + f)
    for t in GEMM_TOKENS:
        x = torch.randn(t, w64.shape[1], generator=gen) * 3
        out = cpu.matmul(p, x, threads=1)
        one = torch.stack([cpu.matmul(p, x[i], threads=1) for i in range(t)])  # the GEMV, a token at a time
        assert torch.equal(out, one), (fmt, f, t)
        assert torch.equal(out, cpu.matmul(p, x, threads=2)) and torch.equal(out, cpu.matmul(p, x, threads=3))
        xk = kernel_x("c", fmt, x)  # the same int8 activations, dequantized: the exact dot to fp32 rounding
        assert_close(out, xk.double() @ w64.T, xk.double().abs() @ w64.abs().T)


def test_gemm_token_bits_do_not_depend_on_the_batch(c_kernels):
    """A token's outputs are the same in any tile slot and next to any other tokens."""
    p, w64, gen = packed("q4_k", 40, 7)
    x = torch.randn(29, w64.shape[1], generator=gen)
    out = cpu.matmul(p, x, threads=2)
    assert torch.equal(cpu.matmul(p, x[5:22], threads=1), out[5:22])
    assert torch.equal(cpu.matmul(p, x.flip(0), threads=2), out.flip(0))


def test_gemm_group_mixing_types_is_separate_calls(c_kernels):
    """q/k/v-like matrices of two K-quant types in one call (a prompt chunk through MatvecGroup): the bits of
    separate calls, the RMS norm folded in."""
    p6, _, gen = packed("q6_k", 20, 3)
    p4, w64, _ = packed("q4_k", 45, 4)
    x = torch.randn(19, w64.shape[1], generator=gen)
    norm = (torch.rand(w64.shape[1], generator=gen) + 0.5, 1e-5)
    h = cpu.rms_norm(x, *norm)
    for threads in (1, 2):
        got = cpu.MatvecGroup([p4, p6, p4])(x, norm=norm, threads=threads)
        for g, w in zip(got, [p4, p6, p4], strict=True):
            assert torch.equal(g, torch.stack([cpu.matmul(w, h[i], threads=1) for i in range(19)]))


def test_gemm_nan_activation_stays_in_its_token(c_kernels):
    p, w64, gen = packed("q4_0", 36, 5)
    x = torch.randn(12, w64.shape[1], generator=gen)
    x[3, 7] = float("nan")
    out = cpu.matmul(p, x, threads=2)
    assert out[3].isnan().all() and not out[torch.arange(12) != 3].isnan().any()
    assert torch.equal(out[4], cpu.matmul(p, x[4], threads=1))
