"""hotcold.gguf.kquants (and quants.quantize for every writable block type) against ggml.

The strongest check is byte-equality with ggml's reference quantizers on a recorded input
(tests/data/kquants_ref.npz, made by tests/data/make_kquants_ref.py from llama.cpp's libggml-base:
the functions llama-quantize runs without an importance matrix). The rest holds without llama.cpp:
the bytes are gguf's layout (gguf.quants.dequantize reads them), the error stays within each type's
measured bound, and edge inputs behave.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from hotcold.gguf import kquants, quants

K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
REF = Path(__file__).parents[1] / "data" / "kquants_ref.npz"
# RMS error / RMS value on N(0, 1) rows, measured (0.296, 0.150, 0.071, 0.036, 0.0177) plus a margin
RMS_CEILING = {Q.Q2_K: 0.31, Q.Q3_K: 0.16, Q.Q4_K: 0.076, Q.Q5_K: 0.039, Q.Q6_K: 0.019}
# the largest |error| in a sub-block, in units of that sub-block's quantization step (d * its scale), on
# Gaussian and uniform rows: the least-squares scales clip the extremes a little (measured 1.43, 1.16,
# 1.04, 1.17, 0.73); with heavy tails a sub-block whose 4/6-bit scale rounds to 0 loses more
STEP_CEILING = {Q.Q2_K: 1.5, Q.Q3_K: 1.25, Q.Q4_K: 1.25, Q.Q5_K: 1.25, Q.Q6_K: 0.8}


def dequant(raw: np.ndarray, qtype: Q, shape) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(shape)


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def steps(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """uint8 [N, block bytes] -> each sub-block's step |d * scale| [N, sub-blocks], read from the layout."""
    if qtype == Q.Q2_K:
        return f16(raw[:, 80:82])[:, None] * (raw[:, :16] & 15)
    if qtype in (Q.Q4_K, Q.Q5_K):
        s = raw[:, 4:16].astype(np.int32)
        ls = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
        return f16(raw[:, 0:2])[:, None] * ls
    if qtype == Q.Q3_K:
        s = raw[:, 96:108].astype(np.int32)
        low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)
        high = np.stack([(s[:, 8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)], axis=1)
        return np.abs(f16(raw[:, 108:110])[:, None] * ((low | (high << 4)) - 32))
    return np.abs(f16(raw[:, 208:210])[:, None] * raw[:, 192:208].view(np.int8))  # Q6_K


@pytest.mark.parametrize("qtype", K_TYPES + [Q.Q4_1, Q.Q5_1], ids=lambda t: t.name)
def test_bytes_equal_ggml_reference(qtype):
    """The recorded input (Gaussian, heavy-tailed and edge rows) gives ggml's bytes exactly."""
    ref = np.load(REF)
    x = ref["x"]
    got = quants.quantize(x, qtype)
    assert got.shape == ref[qtype.name].shape
    differ = [i for i in range(len(x)) if (got[i] != ref[qtype.name][i]).any()]
    assert not differ, f"{qtype.name}: rows {differ} differ from ggml's quantize_row_{qtype.name.lower()}_ref"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_round_trip_error_within_the_types_bound(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (64, quants.row_bytes(qtype, 1024))
    y = dequant(raw, qtype, x.shape)
    # hotcold's own reader gives the same floats as gguf's: the layout is ggml's
    np.testing.assert_array_equal(quants.dequantize(raw, qtype, x.shape).numpy(), y)
    rms = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert rms < RMS_CEILING[qtype], f"{qtype.name}: relative RMS error {rms:.4f}"
    for values in (x, rng.uniform(-3, 3, (64, 1024)).astype(np.float32)):
        raw = quants.quantize(values, qtype)
        step = steps(raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype)  # [N, n_sub]
        err = np.abs(dequant(raw, qtype, values.shape) - values).reshape(step.shape[0], step.shape[1], -1)
        ratio = err.max(axis=-1) / step
        assert ratio.max() <= STEP_CEILING[qtype], f"{qtype.name}: error {ratio.max():.3f} steps"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_edge_rows(qtype):
    n = 512
    for zeros in (np.zeros((2, n), np.float32), -np.zeros((2, n), np.float32)):
        assert not dequant(quants.quantize(zeros, qtype), qtype, zeros.shape).any()
    for c in (0.37, -2.5, 1e-3):
        const = np.full((1, n), c, np.float32)
        y = dequant(quants.quantize(const, qtype), qtype, const.shape)
        assert np.abs(y - c).max() <= 0.05 * abs(c), (c, np.abs(y - c).max())
    rng = np.random.default_rng(0)
    spike = rng.standard_normal((1, n)).astype(np.float32)
    spike[0, 300] = 1e4
    y = dequant(quants.quantize(spike, qtype), qtype, spike.shape)
    assert np.isfinite(y).all() and abs(y[0, 300] - 1e4) <= 0.07 * 1e4
    assert np.abs(y - spike)[0, :256].max() <= 0.7 * 3 * np.abs(spike[0, :256]).max()  # the other super-block
    for scale in (1e-6, 1e-30, 1e-42):  # fp16 scales underflow to 0 or subnormals: never NaN, never large
        tiny = (rng.standard_normal((2, n)) * scale).astype(np.float32)
        y = dequant(quants.quantize(tiny, qtype), qtype, tiny.shape)
        assert np.isfinite(y).all() and np.abs(y).max() <= 2 * np.abs(tiny).max() + 1e-7


@pytest.mark.parametrize("qtype", K_TYPES + [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused(qtype, bad):
    x = np.ones((2, 256), np.float32)
    x[1, 7] = bad
    with pytest.raises(ValueError, match=f"cannot quantize to {qtype.name}: .*NaN or inf"):
        quants.quantize(x, qtype)


def test_shapes_threads_and_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 512)).astype(np.float32)
    for qtype in K_TYPES:
        flat = quants.quantize(x.reshape(15, 512), qtype)
        np.testing.assert_array_equal(quants.quantize(x, qtype).reshape(15, -1), flat)
        np.testing.assert_array_equal(quants.quantize(torch.from_numpy(x), qtype).reshape(15, -1), flat)
    # work split over threads and chunks of super-blocks: the same bytes whatever the split
    big = rng.standard_normal((kquants._CHUNK + 3, 256)).astype(np.float32)
    for qtype in (Q.Q3_K, Q.Q4_K):
        np.testing.assert_array_equal(
            kquants.quantize(big, qtype, threads=1), kquants.quantize(big, qtype, threads=2)
        )
    with pytest.raises(ValueError, match="multiple of 256, got 320"):
        quants.quantize(np.zeros((1, 320), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="not Q8_0"):
        kquants.quantize(np.zeros((1, 256), np.float32), Q.Q8_0)
