"""hotcold.models.layers: the q/k/v group with its norm folded in, against norm then separate linears."""

import pytest
import torch

from hotcold.kernels import cpu
from hotcold.models.layers import LinearGroup, linear, rms_norm


@pytest.mark.parametrize("t", [1, 3, 6, 50])  # C norm in the call, torch norm then the call, GEMM path
def test_linear_group_with_norm_equals_norm_then_linears(t):
    gen = torch.Generator().manual_seed(21)
    d = 96
    ws = [(torch.randn(f, d, generator=gen) / 4).half() for f in (96, 32, 32)]
    norm_w, eps = torch.randn(d, generator=gen), 1e-5
    x = torch.randn(t, d, generator=gen) * 3
    group = LinearGroup()
    got = group(x, ws, norm=(norm_w, eps))
    h = rms_norm(x, norm_w, eps)
    for g, w in zip(got, ws, strict=True):
        assert torch.equal(g, linear(h, w))
    if cpu.backend() == "c":
        assert group._group is not None  # the one-call path was taken
    assert [g.shape for g in group(x, ws)] == [(t, 96), (t, 32), (t, 32)]  # no norm: x as given
