"""hotcold.ops: the q/k/v group with its norm folded in, against norm then separate linears."""

import pytest
import torch

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
