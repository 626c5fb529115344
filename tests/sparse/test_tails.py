"""hotcold.sparse.tails: a layer's tail is chosen once, from its FFN's tail_type, with its C plan made then; the
tail's one call gives the bits of the layer's ops one by one, and answers None for forwards it does not take."""

from __future__ import annotations

import pytest
import torch

from hotcold.kernels import build, cpu
from hotcold.ops import Norm, linear
from hotcold.sparse.ffn import FFN, DenseFFN, SparseFFN
from hotcold.sparse.predictor import Predictor
from hotcold.sparse.tails import DenseTail, SparseTail, layer_tail
from tests.fixtures import ffn_state, ffn_weights

F, D, HD = 256, 64, 64


def parts(dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = ffn_weights(F, D, "gated", dtype, seed=seed, scale=6)
    norm = Norm(torch.rand(D, generator=g) + 0.5, 1e-5)
    wo = (torch.randn(D, HD, generator=g) / 8).to(dtype)
    pred = Predictor(
        (torch.randn(16, D, generator=g) / 4).half(), (torch.randn(F, 16, generator=g) / 4).half(), 0.0
    )
    return w, norm, wo, pred


def test_the_tail_comes_from_the_ffns_class_attribute():
    w, norm, wo, pred = parts()
    assert type(layer_tail(DenseFFN(w, layer=0, norm=norm), wo)) is DenseTail
    assert type(layer_tail(SparseFFN(w, pred, layer=0, norm=norm), wo)) is SparseTail
    assert FFN.tail_type is None and layer_tail(object(), wo) is None  # op by op


@pytest.mark.skipif(build.get_lib() is None, reason="no C build")
@pytest.mark.parametrize("sparse", [False, True])
def test_one_call_equals_the_ops_and_declines_what_it_does_not_take(sparse):
    w, norm, wo, pred = parts()
    ffn = SparseFFN(w, pred, layer=0, norm=norm) if sparse else DenseFFN(w, layer=0, norm=norm)
    tail = layer_tail(ffn, wo)
    assert tail.plan is not None  # made at load, not on the first request
    g = torch.Generator().manual_seed(3)
    attn, x = torch.randn(2, HD, generator=g), torch.randn(2, D, generator=g)
    got = tail(attn, x, ffn_state())
    y = x + linear(attn, wo)
    want = y + ffn(y, ffn_state())
    assert torch.equal(got, want)
    assert tail(attn, x.to("meta"), ffn_state()) is None  # not a CPU row: the layer's ops run it
    t = cpu.GEMM_MIN_TOKENS  # a prompt chunk of GEMM rows
    assert tail(torch.randn(t, HD), torch.randn(t, D), ffn_state()) is None
    fields = tail.c_fields(dense=False)
    assert fields["fields"]["sparse"] == int(sparse) and fields["fields"]["wo"].rows == D
    assert tail.c_fields(dense=True)["fields"]["sparse"] == 0  # a dense forward: every neuron
