"""KVCache: zeroed, writable, in the layer's dtype, and on the CPU not written out in full at allocation."""

from __future__ import annotations

import sys

import pytest
import torch

from hotcold.runtime.state import KVCache


def test_cache_is_zero_and_holds_what_is_written():
    kv = KVCache(3, 4096, 4, 64, dtypes=[torch.float32, torch.float16, torch.float32])
    assert [t.dtype for t in kv.k] == [torch.float32, torch.float16, torch.float32]
    for t in kv.k + kv.v:
        assert t.shape == (4096, 4, 64) and t.is_contiguous()
        assert not t.any()
    kv.k[1][7] = 1.5
    kv.v[2][4095, 3, 63] = -2.0
    assert kv.k[1][7].eq(1.5).all() and float(kv.v[2][4095, 3, 63]) == -2.0
    assert not kv.k[0].any() and not kv.k[2].any()  # every tensor its own memory


def test_small_and_bf16_caches_are_zero_too():
    kv = KVCache(1, 8, 2, 4, dtypes=[torch.bfloat16])
    assert kv.k[0].dtype == torch.bfloat16 and not kv.k[0].any() and not kv.v[0].any()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cpu_cache_memory_grows_with_the_positions_written():
    """A 2 GiB cache (22 layers x 2 x 4096 positions x 1536 floats) costs next to nothing until positions
    are written: torch.zeros wrote all of it at once (0.72 s for 8 sequences of the 1B synthetic)."""
    before = _rss_bytes()
    kv = KVCache(22, 4096, 12, 128)
    assert _rss_bytes() - before < (64 << 20)
    for t in kv.k + kv.v:
        t[:16] = 1.0  # a short prompt's positions
    assert _rss_bytes() - before < (256 << 20)
    assert float(kv.k[21][:16].sum()) == 16 * 12 * 128
