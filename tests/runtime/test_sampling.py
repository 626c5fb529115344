"""Sampling: pure functions with llama.cpp's semantics."""

from __future__ import annotations

import math

import pytest
import torch

from hotcold.runtime.sampling import (
    SamplingParams,
    apply_repeat_penalty,
    make_generator,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)


def test_greedy_is_argmax_and_deterministic():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams()) == 1
    assert sample(logits, SamplingParams(temperature=1e-9)) == 1


def test_top_k_keeps_exactly_k_even_with_ties():
    kept = top_k_filter(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]), 2)
    assert torch.isfinite(kept).sum() == 2


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = top_p_filter(probs.log(), 0.75)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_min_p_relative_to_best():
    probs = torch.tensor([0.6, 0.3, 0.05, 0.05])
    kept = min_p_filter(probs.log(), 0.1)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_repeat_penalty_llama_cpp_rule():
    out = apply_repeat_penalty(torch.tensor([2.0, -2.0, 1.0]), [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_seeded_sampling_reproducible_and_distribution_sane():
    logits = torch.tensor([0.0, math.log(3.0)])
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [sample(logits, params, generator=make_generator(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    gen = make_generator(0)
    ones = sum(sample(logits, params, generator=gen) for _ in range(2000))
    assert 0.7 < ones / 2000 < 0.8  # p(1) = 0.75


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=float("nan")),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(min_p=2.0),
        dict(top_k=-1),
    ],
)
def test_bad_parameters_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**64, 2**70, -1, -(2**63)])
def test_seed_out_of_range_is_a_clear_error(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        make_generator(seed)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_seed_range_edges_work():
    for seed in (0, 2**63, 2**64 - 1):
        a, b = make_generator(seed), make_generator(seed)
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("field", ["repeat_penalty", "temperature", "top_p", "min_p"])
def test_nan_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be"):
        SamplingParams(**{field: float("nan")})
