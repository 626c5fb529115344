import itertools
import logging

import numpy as np
import pytest
import torch

from hotcold.placement.solver import solve_placement


def _random_layers(rng: np.random.Generator, n_layers: int, groups: list[int] | int, group: int) -> list:
    if isinstance(groups, int):
        groups = [groups] * n_layers
    return [rng.gamma(0.5, 10.0, size=g * group) for g in groups]


def _mass(acts, placement) -> float:
    return float(sum(np.asarray(a, dtype=np.float64)[p].sum() for a, p in zip(acts, placement)))


def _brute_force(acts, budget: int, bytes_per_neuron: list[int], group: int, min_per_layer: int = 0):
    """Every subset of every layer's groups (hottest-first groups); the heaviest one that fits."""
    cells = []  # (layer, mass, cost)
    for i, a in enumerate(acts):
        s = np.sort(np.asarray(a, dtype=np.float64))[::-1].reshape(-1, group).sum(axis=1)
        cells += [(i, m, group * bytes_per_neuron[i]) for m in s]
    best, best_mass = None, -1.0
    for bits in itertools.product((0, 1), repeat=len(cells)):
        if sum(c for (_, _, c), b in zip(cells, bits) if b) > budget:
            continue
        counts = np.bincount([i for (i, _, _), b in zip(cells, bits) if b], minlength=len(acts))
        if np.any(counts < min_per_layer):
            continue
        m = sum(m for (_, m, _), b in zip(cells, bits) if b)
        if m > best_mass:
            best, best_mass = counts, m
    return best, best_mass


def _original_rule(acts, budget: int, bytes_per_neuron: int, group: int = 256) -> list[np.ndarray]:
    """PowerInfer's rule as the reference states it (§0 fact 10, §3.4): the globally largest
    floor(capacity / 256) groups, capacity = budget / bytes; layer i takes torch.topk of that many."""
    capacity = budget // bytes_per_neuron
    groups = []
    for i, a in enumerate(acts):
        s = torch.sort(torch.as_tensor(a), descending=True).values.view(-1, group).sum(1)
        groups += [(float(m), i) for m in s]
    groups.sort(key=lambda g: -g[0])
    counts = np.bincount([i for _, i in groups[: capacity // group]], minlength=len(acts))
    return [
        np.sort(torch.topk(torch.as_tensor(a), k=int(n) * group).indices.numpy())
        for a, n in zip(acts, counts)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    group, bpn = 4, 3
    acts = _random_layers(rng, 3, [3, 2, 4], group)
    for budget in (0, 11, 12, 40, 60, 108, 1000):
        placement = solve_placement(acts, budget, bpn, group=group)
        counts, mass = _brute_force(acts, budget, [bpn] * 3, group)
        assert [len(p) // group for p in placement] == counts.tolist()
        assert _mass(acts, placement) == pytest.approx(mass)
        assert sum(len(p) for p in placement) * bpn <= budget


@pytest.mark.parametrize("seed", range(3))
def test_equals_the_original_rule(seed):
    rng = np.random.default_rng(100 + seed)
    n_layers, n_ff, bpn = 12, 1024, 30720
    # Counts as the profiler writes them: integers, so there are ties inside and across layers.
    acts = [
        torch.as_tensor(rng.poisson(rng.gamma(0.3, 50.0, size=n_ff)), dtype=torch.float32)
        for _ in range(n_layers)
    ]
    for budget in (0, 256 * bpn - 1, 4096 * bpn, 7 * 256 * bpn + 123, 10**12):
        placement = solve_placement(acts, budget, bpn)
        ref = _original_rule(acts, budget, bpn)
        # Counts per layer are the same; the neurons too wherever a layer's counts have no tie at the cut.
        assert [len(p) for p in placement] == [len(r) for r in ref]
        for a, p, r in zip(acts, placement, ref):
            assert a[p].sum().item() == pytest.approx(a[r].sum().item())


def test_top_k_per_layer_ties_to_lower_index():
    acts = [np.array([1, 5, 5, 0, 5, 2, 0, 0], dtype=np.float64)]
    (p,) = solve_placement(acts, 2 * 2 * 10, 10, group=2)
    # hottest first with ties by index: 1, 2, 4, 5, 0, ...; two groups of two -> {1, 2, 4, 5}
    assert p.tolist() == [1, 2, 4, 5]
    assert p.dtype == np.int64


def test_monotone_in_budget():
    rng = np.random.default_rng(7)
    acts = _random_layers(rng, 5, [4, 6, 2, 8, 4], 8)
    prev_mass, prev_n = -1.0, -1
    for budget in range(0, 24 * 8 * 2 + 40, 7):
        placement = solve_placement(acts, budget, 2, group=8)
        mass, n = _mass(acts, placement), sum(len(p) for p in placement)
        assert mass >= prev_mass and n >= prev_n
        prev_mass, prev_n = mass, n


def test_zero_budget_and_huge_budget():
    rng = np.random.default_rng(1)
    acts = _random_layers(rng, 4, 3, 16)
    acts[2][:] = 0  # a layer that never fires is still placed when everything fits
    assert all(p.size == 0 and p.dtype == np.int64 for p in solve_placement(acts, 0, 100, group=16))
    full = solve_placement(acts, 10**15, 100, group=16)
    assert all(np.array_equal(p, np.arange(len(a))) for p, a in zip(full, acts))
    full = solve_placement(acts, 10**15, 100, group=16, min_per_layer=1)
    assert all(np.array_equal(p, np.arange(len(a))) for p, a in zip(full, acts))
    assert solve_placement([], 1000, 10) == []


@pytest.mark.parametrize("seed", range(4))
def test_min_per_layer_is_respected_and_optimal(seed):
    rng = np.random.default_rng(seed)
    group = 2
    # one layer nearly dead: the plain optimum would give it nothing
    acts = _random_layers(rng, 3, [3, 3, 2], group)
    acts[1] = acts[1] * 1e-3
    bpn = [5, 5, 5]
    for budget in (30, 40, 55, 80):
        placement = solve_placement(acts, budget, bpn, group=group, min_per_layer=1)
        counts = [len(p) // group for p in placement]
        assert min(counts) >= 1
        ref_counts, ref_mass = _brute_force(acts, budget, bpn, group, min_per_layer=1)
        assert _mass(acts, placement) == pytest.approx(ref_mass)
        assert counts == ref_counts.tolist()


def test_min_per_layer_lowered_when_budget_too_small(caplog):
    rng = np.random.default_rng(3)
    acts = _random_layers(rng, 4, 4, 4)
    with caplog.at_level(logging.WARNING, logger="hotcold.placement.solver"):
        placement = solve_placement(acts, 5 * 4, 1, group=4, min_per_layer=2)  # room for 5 groups, not 8
    assert [len(p) // 4 for p in placement].count(0) == 0  # the minimum that fits: 1 per layer
    assert sum(len(p) for p in placement) == 20
    assert "cannot give every layer 2" in caplog.text


@pytest.mark.parametrize("seed", range(4))
def test_costs_that_differ_per_layer_are_solved_exactly(seed):
    # Greedy by mass is not optimal when a layer's groups cost more: this is a knapsack.
    rng = np.random.default_rng(50 + seed)
    group = 2
    acts = _random_layers(rng, 3, [3, 2, 3], group)
    bpn = [3, 7, 5]
    for budget in (10, 25, 37, 64):
        placement = solve_placement(acts, budget, bpn, group=group)
        _, ref_mass = _brute_force(acts, budget, bpn, group)
        assert _mass(acts, placement) == pytest.approx(ref_mass)
        assert sum(len(p) * b for p, b in zip(placement, bpn)) <= budget


def test_greedy_fallback_keeps_the_minimum(monkeypatch):
    import hotcold.placement.solver as solver

    rng = np.random.default_rng(4)
    acts = _random_layers(rng, 3, 4, 2)
    acts[0] = acts[0] * 1e-3
    monkeypatch.setattr(solver, "_milp", lambda *args: None)  # as if the MILP timed out with nothing
    placement = solve_placement(acts, 6 * 2, 1, group=2, min_per_layer=1)
    assert [len(p) // 2 for p in placement].count(0) == 0
    assert sum(len(p) for p in placement) == 12


def test_torch_and_numpy_inputs_and_per_layer_widths():
    rng = np.random.default_rng(9)
    counts = [rng.integers(0, 1000, size=512), rng.integers(0, 1000, size=256)]  # n_ff differs per layer
    as_np = solve_placement([c.astype(np.float64) for c in counts], 3 * 256 * 10, 10)
    as_torch = solve_placement(
        [torch.from_numpy(counts[0]), torch.from_numpy(counts[1]).float()], 3 * 256 * 10, 10
    )
    assert sum(len(p) for p in as_np) == 3 * 256
    assert all(np.array_equal(a, b) for a, b in zip(as_np, as_torch))
    assert all(np.all(np.diff(p) > 0) for p in as_np)


@pytest.mark.parametrize(
    "acts, budget, bpn, kwargs, match",
    [
        ([np.array([1.0, -1.0])], 10, 1, {"group": 2}, "negative"),
        ([np.array([1.0, np.nan])], 10, 1, {"group": 2}, "NaN"),
        ([np.ones(3)], 10, 1, {"group": 2}, "multiple of the group size"),
        ([np.ones(4)], -1, 1, {"group": 2}, "budget_bytes"),
        ([np.ones((2, 2))], 10, 1, {"group": 2}, "1-D"),
        ([np.ones(4)], 10, 0, {"group": 2}, "bytes_per_neuron"),
        ([np.ones(4)], 10, [1, 2], {"group": 2}, "2 entries for 1 layers"),
        ([np.ones(4)], 10, 1, {"group": 0}, "group"),
        ([np.ones(4)], 10, 1, {"group": 2, "min_per_layer": -1}, "min_per_layer"),
    ],
)
def test_bad_inputs(acts, budget, bpn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_placement(acts, budget, bpn, **kwargs)
