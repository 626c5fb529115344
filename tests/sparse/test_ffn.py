"""Sparse FFN against the dense reference: all-firing, oracle masks, thread counts, batches."""

from __future__ import annotations

import pytest
import torch

from hotcold.sparse.ffn import DenseFFN, SparseFFN
from tests.fixtures import ffn_weights

F, D = 1280, 96


def weights(kind="gated", dtype=torch.float32, seed=0, bias=False):
    return ffn_weights(F, D, kind, dtype, seed=seed, bias=bias, scale=6)


CASES = [("gated", False), ("gated_both", False), ("plain", True)]


@pytest.mark.parametrize("kind, bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_firing_predictor_equals_dense(kind, bias, dtype):
    w = weights(kind, dtype, bias=bias)
    x = torch.randn(4, D)
    dense = DenseFFN(w)(x, x)
    sparse = SparseFFN(w, lambda p: torch.ones(p.shape[0], F, dtype=torch.bool))(x, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert (sparse - dense).abs().max() <= tol * dense.abs().max()


@pytest.mark.parametrize("kind, bias", CASES)
def test_oracle_mask_equals_dense_restricted_to_firing_neurons(kind, bias):
    """With the true firing set as the mask, the sparse FFN is the dense FFN over exactly those neurons;
    for ReLU models that is the dense FFN itself (non-firing neurons output exactly 0)."""
    w = weights(kind, bias=bias)
    x = torch.randn(6, D)
    seen = {}
    dense_ffn = DenseFFN(w)
    dense_ffn.observer = lambda ffn_in, p, a: seen.setdefault("a", a)
    dense = dense_ffn(x, x)
    firing = seen["a"] != 0
    assert 0.05 < firing.float().mean() < 0.95
    sparse = SparseFFN(w, lambda p: firing)(x, x)
    # reference restricted to the firing neurons, computed independently
    a = torch.where(firing, seen["a"], 0.0)
    restricted = a @ w.down_t + (w.down_bias if w.down_bias is not None else 0)
    assert (sparse - restricted).abs().max() <= 1e-5 * restricted.abs().max()
    if kind != "plain" or not bias:  # relu(b) of a non-firing neuron is 0 only without bias
        assert (sparse - dense).abs().max() <= 1e-5 * dense.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_identical_bits_for_any_thread_count(dtype):
    w = weights("gated", dtype)
    x = torch.randn(9, D)
    mask = torch.rand(9, F, generator=torch.Generator().manual_seed(1)) < 0.2
    outs = [SparseFFN(w, lambda p: mask, threads=t)(x, x) for t in (1, 2, 4)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prefill_batch_equals_token_by_token():
    w = weights("gated_both")
    x = torch.randn(12, D)
    mask = torch.rand(12, F, generator=torch.Generator().manual_seed(2)) < 0.15
    batch = SparseFFN(w, lambda p: mask)(x, x)
    single = torch.cat(
        [SparseFFN(w, lambda p, t=t: mask[t : t + 1])(x[t : t + 1], x[t : t + 1]) for t in range(12)]
    )
    assert (batch - single).abs().max() <= 1e-6 * batch.abs().max()


@pytest.mark.parametrize("kind, bias", CASES + [("gated", True)])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_step_equals_separate_kernels(kind, bias, t):
    """With a real predictor the CPU step runs as one C call; it must give the very bits of the
    kernel-by-kernel path (the same predictor behind a plain callable takes that path)."""
    from hotcold.kernels import cpu
    from hotcold.sparse.predictor import Predictor

    if cpu.backend() != "c":
        pytest.skip("C kernels unavailable")
    w = weights(kind, torch.float16, seed=3, bias=bias)
    g = torch.Generator().manual_seed(4)
    pred = Predictor(
        (torch.randn(32, D, generator=g) / 4).half(), (torch.randn(F, 32, generator=g) / 4).half(), 0.5
    )
    x, p = torch.randn(t, D, generator=g), torch.randn(t, D, generator=g)
    fused_ffn, plain_ffn = SparseFFN(w, pred, threads=2), SparseFFN(w, lambda q: pred(q), threads=3)
    fused, plain = fused_ffn(x, p), plain_ffn(x, p)
    assert torch.equal(fused, plain)
    assert fused_ffn.stats == plain_ffn.stats
    assert 0.05 < fused_ffn.stats.rate < 0.95  # a real mix of firing and silent neurons
    assert isinstance(fused_ffn._plan, cpu.SparseFFNPlan)  # the fused path really ran
    assert plain_ffn._plan is None


@pytest.mark.parametrize("t", [1, 3, 6])  # the norm inside the C call (t <= 4) and before it
def test_ffn_norm_inside_the_call_equals_norm_first(t):
    from hotcold.models.layers import rms_norm
    from hotcold.sparse.predictor import Predictor

    w = weights("gated", torch.float16, seed=5)
    g = torch.Generator().manual_seed(6)
    pred = Predictor(
        (torch.randn(32, D, generator=g) / 4).half(), (torch.randn(F, 32, generator=g) / 4).half(), 0.3
    )
    x = torch.randn(t, D, generator=g) * 2
    norm_w = torch.randn(D, generator=g)
    with_norm = SparseFFN(w, pred)(x, x, norm=(norm_w, 1e-5))
    norm_first = SparseFFN(w, pred)(rms_norm(x, norm_w, 1e-5), x)
    assert torch.equal(with_norm, norm_first)
    unfused = SparseFFN(w, lambda q: pred(q))(x, x, norm=(norm_w, 1e-5))  # kernel by kernel, torch glue
    assert torch.equal(with_norm, unfused)
