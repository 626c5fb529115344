"""Regenerate kquants_ref.npz: a small fixed input and the bytes ggml's own reference quantizers give for it.

Run with llama.cpp built (the default path is where ../shared/anchors/build-llama-cpp.sh puts it):
    python tests/data/make_kquants_ref.py [path/to/libggml-base.so]
The functions called, quantize_row_*_ref in libggml-base, are what `llama-quantize` runs for these types
without an importance matrix (quantize_q4_K & co. call them when imatrix is NULL).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_1, Q.Q5_1]


def inputs() -> np.ndarray:
    """[10, 256] float32: Gaussian, heavy-tailed, edge rows (zeros, -0, constants, one huge value, tiny and
    subnormal values, a half-zero row, values huge enough to overflow the fp16 scales)."""
    rng = np.random.default_rng(13)
    n = 256
    rows = [
        rng.standard_normal(n),
        rng.standard_t(1.5, n),
        np.zeros(n),
        -np.zeros(n),
        np.full(n, 0.37),
        np.full(n, -2.5),
        np.where(np.arange(n) == 77, 1e4, rng.standard_normal(n)),
        rng.standard_normal(n) * 1e-38,  # products underflow to subnormals; a scale overflows to inf
        np.where(np.arange(n) < 128, 0.0, rng.standard_normal(n) * 1e-6),
        rng.standard_normal(n) * 1e30,  # x*x overflows: ggml's NaN/inf paths
    ]
    return np.stack(rows).astype(np.float32)


def main() -> None:
    default = Path.home() / ".cache/hotcold-anchors/llama.cpp/build/bin/libggml-base.so"
    lib = ctypes.CDLL(str(sys.argv[1] if len(sys.argv) > 1 else default))
    x = inputs()
    out = {"x": x}
    for t in TYPES:
        fn = getattr(lib, f"quantize_row_{t.name.lower().replace('_k', '_K')}_ref")
        dst = np.zeros(x.size // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1], np.uint8)
        fn(x.ctypes.data_as(ctypes.c_void_p), dst.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
        out[t.name] = dst.reshape(x.shape[0], -1)
    np.savez_compressed(Path(__file__).with_name("kquants_ref.npz"), **out)


if __name__ == "__main__":
    main()
