"""hotcold.ops: the q/k/v group with its norm folded in, against norm then separate linears; prompt-chunk attention in C rows against SDPA."""

import pytest
import torch

from hotcold import ops
from hotcold.kernels import cpu
from hotcold.ops import LinearGroup, Norm, linear, rms_norm


@pytest.mark.parametrize("t", [1, 3, 6, 50])  # C norm in the call, torch norm then the call, GEMM path
def test_linear_group_with_norm_equals_norm_then_linears(t):
    gen = torch.Generator().manual_seed(21)
    d = 96
    ws = [(torch.randn(f, d, generator=gen) / 4).half() for f in (96, 32, 32)]
    norm = Norm(torch.randn(d, generator=gen), 1e-5)
    x = torch.randn(t, d, generator=gen) * 3
    group = LinearGroup(ws)
    got = group(x, norm)
    h = rms_norm(x, norm.weight, norm.eps)
    for g, w in zip(got, ws, strict=True):
        assert torch.equal(g, linear(h, w))
    if cpu.backend() == "c":
        assert group._group is not None  # the one-call path was taken
    assert [g.shape for g in group(x)] == [(t, 96), (t, 32), (t, 32)]  # no norm: x as given


def test_layer_norm_matches_torch():
    gen = torch.Generator().manual_seed(3)
    w, b, x = (
        torch.randn(64, generator=gen),
        torch.randn(64, generator=gen),
        torch.randn(5, 64, generator=gen),
    )
    norm = Norm(w, 1e-5, b, rms=False)
    x64 = x.double()  # the formula in float64, independent of torch's layer_norm that Norm calls
    mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
    ref = (x64 - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()
    assert torch.allclose(norm(x).double(), ref, atol=1e-5)
    rms = Norm(w, 1e-5)  # and the RMS norm, in C for a few tokens
    ref_rms = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(rms(x).double(), ref_rms, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_prompt_chunk_attention_in_rows_equals_sdpa(monkeypatch, window):
    """A CPU prompt chunk small enough for `attends_in_rows` runs as decode rows in C: every row equals
    rope + SDPA with the causal (and sliding-window) mask to float32 rounding, the caches hold the same rotated
    keys and values, and the rule follows rows x context alone."""
    if cpu.backend() != "c":
        pytest.skip("the C kernels did not build")
    gen = torch.Generator().manual_seed(3)
    t, pos, h, hkv, dh = 9, 4, 8, 2, 16
    q, k, v = (torch.randn(t, n, dh, generator=gen) for n in (h, hkv, hkv))
    cos, sin = torch.randn(t, dh // 2, generator=gen), torch.randn(t, dh // 2, generator=gen)
    history_k, history_v = torch.randn(pos, hkv, dh, generator=gen), torch.randn(pos, hkv, dh, generator=gen)
    results = {}
    for rows in (True, False):
        monkeypatch.setattr(ops, "ROWS_ATTENTION_MAX_WORK", 1 << 17 if rows else 0)
        kc, vc = torch.zeros(32, hkv, dh), torch.zeros(32, hkv, dh)
        kc[:pos], vc[:pos] = history_k, history_v
        out = ops.rope_attention(
            q.clone(), k.clone(), v, kc, vc, pos, cos, sin, neox=False, sliding_window=window
        )
        results[rows] = (out, kc, vc)
    (got, kc, vc), (want, kc_ref, vc_ref) = results[True], results[False]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc, vc_ref)
    monkeypatch.undo()
    cache = torch.zeros(600, hkv, dh)
    assert ops.attends_in_rows(52, 0, cache) and ops.attends_in_rows(128, 896, cache)
    assert not ops.attends_in_rows(129, 896, cache) and not ops.attends_in_rows(8, 0, cache.half())
