"""cpu.attention_prefill (kernels/c/prefill_attention.c): a prompt chunk's causal attention over float32 caches, against
float64 attention, with the same bits for any thread count."""

from __future__ import annotations

import math

import pytest
import torch

from hotcold.kernels import cpu


def reference(q, kc, vc, pos):
    """float64 causal attention: query t at pos + t over cache rows 0..pos + t; query head h reads kv head h // G."""
    t, h, dh = q.shape
    g = h // kc.shape[1]
    keys, values = (
        kc[: pos + t].double().repeat_interleave(g, 1),
        vc[: pos + t].double().repeat_interleave(g, 1),
    )
    s = torch.einsum("thd,shd->hts", q.double(), keys) / math.sqrt(dh)
    mask = torch.arange(pos + t)[None, :] > (pos + torch.arange(t))[:, None]
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", p, values).reshape(t, h * dh)


@pytest.mark.parametrize("t,pos", [(2, 0), (37, 0), (100, 13)])
@pytest.mark.parametrize("dh", [64, 128])
def test_attention_prefill_is_causal_attention(t, pos, dh):
    if cpu.backend() != "c":
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(t + dh)
    h, hkv, n_ctx = 6, 2, 160
    q = torch.randn(t, h, dh, generator=gen)
    kc, vc = torch.randn(n_ctx, hkv, dh, generator=gen), torch.randn(n_ctx, hkv, dh, generator=gen)
    kc[pos + t :] = float("nan")  # rows past the chunk are never read
    vc[pos + t :] = float("nan")
    out = cpu.attention_prefill(q, kc, vc, pos, threads=1)
    if out is None:  # a head size with more vectors than this machine's path keeps in registers
        assert cpu.simd() != "avx512"
        return
    torch.testing.assert_close(out.double(), reference(q, kc, vc, pos), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, cpu.attention_prefill(q, kc, vc, pos, threads=2))
    assert torch.equal(out, cpu.attention_prefill(q, kc, vc, pos, threads=3))
    with pytest.raises(ValueError, match="do not hold"):
        cpu.attention_prefill(q, kc[: pos + t - 1], vc[: pos + t - 1], pos)
