"""quants.py against gguf's numpy port of ggml (the reference), bit for bit. (The C kernels'
dequantization, cpu.dequantize_rows, is pinned to the same reference in tests/kernels/test_cpu.py.)"""

import ast
import inspect

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from hotcold.gguf import kquants, quants
from hotcold.gguf.quants import QuantTensor
from tests.fixtures import random_blocks

BLOCK_TYPES = sorted(quants.SUPPORTED - quants.FLOAT_TYPES)  # every readable block type


def test_imports_nothing_from_the_kernels():
    """The block formats are the bottom layer: the kernels import them, never the other way round; the
    only hotcold module they use is kquants (the K-quant quantizers), which imports none at all."""
    for module in (quants, kquants):
        tree = ast.parse(inspect.getsource(module))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        for n in ast.walk(tree):
            if isinstance(
                n, ast.ImportFrom
            ):  # "from hotcold.gguf import x" -> hotcold.gguf.x; relative -> "."
                base = "." if n.level else n.module or ""
                names += [
                    f"{base}.{a.name}" if base in ("hotcold", "hotcold.gguf", ".") else base for a in n.names
                ]
        used = {m for m in names if m.startswith(("hotcold", "."))}
        assert used <= ({"hotcold.gguf.kquants"} if module is quants else set()), (module.__name__, used)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantize_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 1024, rng)
    bs = GGML_QUANT_SIZES[qtype][0]
    ref = gguf.quants.dequantize(raw, qtype).reshape(-1)
    for shape in [(1024 * bs,), (16, 64 * bs)]:
        got = quants.dequantize(raw, qtype, shape)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.numpy().reshape(-1).view(np.uint32), ref.view(np.uint32))
    # the torch path (used for tensors on other devices)
    got = quants.dequantize_torch(torch.from_numpy(raw.reshape(16, -1)), qtype)
    np.testing.assert_array_equal(got.numpy().reshape(-1).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_dequantize_float_types(qtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 96)) * 100).astype(np.float32)
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (8, quants.row_bytes(qtype, 96))
    ref = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(8, 96)
    got = quants.dequantize(raw, qtype, (8, 96))
    np.testing.assert_array_equal(got.numpy(), ref)
    # typed arrays as the gguf reader hands them out are accepted too
    if qtype == Q.F16:
        np.testing.assert_array_equal(quants.dequantize(x.astype(np.float16), qtype, (8, 96)).numpy(), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.BF16, Q.F16])
def test_quantize_matches_ggml(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 256)) * rng.standard_normal((64, 1)) * 5).astype(np.float32)
    x[0] = 0.0  # zero row: d = 0
    x[1, :32] = 1e-30  # tiny: scale underflows fp16
    x[2, 5] = 3.0e4  # one large value per block
    x[3, :32] = -2.0  # ties on the max magnitude
    ref = gguf.quants.quantize(x, qtype)
    got = quants.quantize(torch.from_numpy(x), qtype)
    np.testing.assert_array_equal(got, np.ascontiguousarray(ref).view(np.uint8).reshape(got.shape))


@pytest.mark.parametrize(("qtype", "levels"), [(Q.Q8_0, 127), (Q.Q4_0, 8), (Q.Q5_0, 16)])
def test_quantize_roundtrip_error_bound(qtype, levels):
    torch.manual_seed(0)
    x = torch.randn(128, 512) * torch.rand(128, 1) * 10
    back = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    err = (back - x).abs().reshape(-1, 32)
    amax = x.abs().reshape(-1, 32).amax(1, keepdim=True)
    # half a step for in-range values; Q4_0/Q5_0 clip the most negative code to one full step
    step = amax / levels
    bound = (step / 2 if qtype == Q.Q8_0 else step) + amax * 2.0**-10  # + fp16 rounding of d
    assert (err <= bound * 1.0001).all()


def test_row_bytes_and_is_quantized():
    assert quants.row_bytes(Q.Q4_0, 4096) == 4096 // 32 * 18
    assert quants.row_bytes(Q.Q6_K, 512) == 2 * 210
    assert quants.row_bytes(Q.F16, 7) == 14
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.row_bytes(Q.Q8_0, 100)
    assert quants.is_quantized(Q.Q8_0) and quants.is_quantized(Q.Q6_K)
    assert not any(quants.is_quantized(t) for t in (Q.F32, Q.F16, Q.BF16))


def test_unsupported_types_are_rejected():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        quants.dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="cannot quantize to IQ2_XXS"):
        quants.quantize(np.zeros((1, 256), np.float32), Q.IQ2_XXS)
    with pytest.raises(ValueError, match="holds 10 bytes, expected 34"):
        quants.dequantize(np.zeros(10, np.uint8), Q.Q8_0, (32,))


def test_quant_tensor():
    torch.manual_seed(0)
    w = torch.randn(50, 96)
    qt = QuantTensor.from_float(w, Q.Q4_0)
    assert qt.shape == (50, 96) and qt.data.shape == (50, 54) and qt.nbytes == 50 * 54
    full = qt.dequantize()
    assert torch.allclose(full, w, atol=w.abs().max().item() / 8)
    rows = torch.tensor([3, 0, 49, 3])
    assert torch.equal(qt.dequantize(rows), full[rows])
    mask = torch.zeros(50, dtype=torch.bool)
    mask[[1, 7]] = True
    assert torch.equal(qt.dequantize(mask), full[mask])
    sub = qt.select_rows(rows)
    assert sub.shape == (4, 96) and torch.equal(sub.dequantize(), full[rows])
    # a view into a larger buffer (row stride > row bytes) as a memory map may give
    big = torch.zeros(50, 64, dtype=torch.uint8)
    big[:, :54] = qt.data
    strided = QuantTensor(big[:, :54], Q.Q4_0, (50, 96))
    assert torch.equal(strided.dequantize(), full)


def test_quant_tensor_validation():
    with pytest.raises(ValueError, match="needs uint8 data of shape"):
        QuantTensor(torch.zeros(4, 30, dtype=torch.uint8), Q.Q8_0, (4, 32))
    with pytest.raises(ValueError, match="needs uint8 data"):
        QuantTensor(torch.zeros(4, 34), Q.Q8_0, (4, 32))
    with pytest.raises(ValueError, match="2-D"):
        QuantTensor(torch.zeros(4, 34, dtype=torch.uint8), Q.Q8_0, (4, 32, 1))


def mxfp4_block(e: int, nibbles: list[int]) -> np.ndarray:
    """One MXFP4 block: the E8M0 byte, then value j in the low nibble of byte j and value 16 + j in its high one."""
    qs = [nibbles[j] | (nibbles[16 + j] << 4) for j in range(16)]
    return np.array([e, *qs], dtype=np.uint8)


def test_mxfp4_dequantizes_a_hand_computed_block():
    """ggml type 39 (gpt-oss's experts): E2M1 values (ggml's kvalues_mxfp4 hold them doubled, the scale is
    2^(e - 128) to match), one E8M0 scale per 32 values; written out by hand, not from a reference port. E2M1's
    -0 (nibble 8) is +0.0 as ggml's int8 table has it."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    nibbles = [(7 * j + 3) % 16 for j in range(32)]
    blocks = [(127, 1.0), (130, 8.0), (120, 2.0**-7), (1, 2.0**-126), (0, 2.0**-127)]  # (e, 2^(e - 127))
    raw = np.stack([mxfp4_block(e, nibbles) for e, _ in blocks])
    expected = torch.tensor([[scale * e2m1[n] for n in nibbles] for _, scale in blocks], dtype=torch.float32)
    assert gguf.GGMLQuantizationType(39) == Q.MXFP4 and GGML_QUANT_SIZES[Q.MXFP4] == (32, 17)
    got = quants.dequantize(raw, Q.MXFP4, (5, 32))  # gguf's numpy port on the CPU
    assert torch.equal(got, expected)
    assert torch.equal(
        got.view(torch.int32), expected.view(torch.int32)
    )  # nibble 8 (E2M1's -0) gives +0.0: ggml's table is int8
    assert torch.equal(quants.dequantize_torch(torch.from_numpy(raw), Q.MXFP4), expected)  # the torch path
    assert torch.equal(expected.to(torch.bfloat16).float(), expected)  # BF16 holds every MXFP4 value


def test_mxfp4_random_blocks_bit_exact():
    rng = np.random.default_rng(39)
    raw = rng.integers(0, 256, size=(512, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(0, 250, size=512)  # keep the largest values finite (e 254: 12 * 2^126 overflows)
    ref = gguf.quants.dequantize(raw, Q.MXFP4).reshape(16, -1)
    got = quants.dequantize_torch(torch.from_numpy(raw.reshape(16, -1)), Q.MXFP4)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), ref.view(np.uint32))
    qt = QuantTensor(torch.from_numpy(raw.reshape(16, -1).copy()), Q.MXFP4, (16, 1024))  # kept as file bytes
    np.testing.assert_array_equal(qt.dequantize().numpy().view(np.uint32), ref.view(np.uint32))


def test_mxfp4_quantize_matches_gguf_and_roundtrips():
    """MXFP4 quantization (hotcold quantize mxfp4_moe's experts): gguf-py's port of ggml's quantize_row_mxfp4_ref
    (tests/models/test_gpt_oss.py compares a whole file with llama-quantize's bytes); MXFP4 values come back as
    they were, others within 4 x their block's scale d = 2^(floor(log2 amax) - 3) (half the widest gap, 8d to
    12d, or the clip of values above 12d = 1.5 x 2^floor(log2 amax))."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((8, 128)) * rng.standard_normal((8, 1)) * 3).astype(np.float32)
    x[0] = 0.0
    got = quants.quantize(torch.from_numpy(x), Q.MXFP4)
    ref = gguf.quants.quantize(x, Q.MXFP4)
    np.testing.assert_array_equal(got, np.ascontiguousarray(ref).view(np.uint8).reshape(got.shape))
    back = quants.dequantize(got, Q.MXFP4, x.shape)
    assert torch.equal(quants.dequantize(quants.quantize(back, Q.MXFP4), Q.MXFP4, x.shape), back)
    amax = np.abs(x).reshape(-1, 32).max(1, keepdims=True)
    bound = 4 * 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1))) - 3)
    assert (np.abs(back.numpy() - x).reshape(-1, 32) <= bound).all()
