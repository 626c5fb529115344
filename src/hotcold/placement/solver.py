"""Which FFN neurons go to the GPU: the most often activated ones that fit in a byte budget.

PowerInfer states this as a binary ILP (reference §3.3): per layer, sort the activation counts
descending, cut them into groups of 256 and pick groups to maximise the activation mass kept on the
GPU under a capacity. With one cost per group, as in the original, the optimum is the globally
heaviest groups that fit, so we take them greedily. A per-layer minimum, and costs that differ
between layers (different weight types per layer: a knapsack, where taking by mass is no longer
optimal), go to `scipy.optimize.milp`; greedy stays the fallback if the MILP runs out of time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

MILP_TIME_LIMIT_S = 10.0  # the original gave GLPK 30 s; past the limit we keep the better of MILP and greedy


def solve_placement(
    activations: Sequence[torch.Tensor | np.ndarray],
    budget_bytes: int,
    bytes_per_neuron: int | Sequence[int],
    *,
    group: int = 256,
    min_per_layer: int = 0,
) -> list[np.ndarray]:
    """Per layer, the sorted int64 indices of the neurons to place on the GPU.

    activations[i]: 1-D counts or frequencies of layer i's neurons (length a multiple of `group`;
    it may differ per layer). A group of layer i costs `group * bytes_per_neuron[i]` bytes.
    The chosen neurons of a layer are its top-k by activation (ties: lower index first), k a
    multiple of `group`; the number of groups per layer maximises the activation mass on the GPU.
    min_per_layer: every layer gets at least that many groups (or all of its groups, if it has
    fewer); when the budget cannot give every layer that many, the largest minimum that fits is
    used instead, with a warning.
    """
    ranked, masses = _ranked_groups(activations, group)
    costs = _group_costs(bytes_per_neuron, len(ranked), group)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if min_per_layer < 0:
        raise ValueError(f"min_per_layer must be >= 0, got {min_per_layer}")
    budget = int(budget_bytes)

    minimum = _affordable_minimum(masses, costs, budget, min_per_layer)
    start = [min(minimum, len(m)) for m in masses]
    taken = _greedy(masses, costs, budget, start)
    if minimum > 0 or len(set(costs)) > 1:
        # Greedy is exact only for one cost and no minimum; otherwise it is the fallback.
        exact = _milp(masses, costs, budget, start)
        if exact is not None and _total(masses, exact) >= _total(masses, taken):
            taken = _greedy(masses, costs, budget, exact)  # spend what it left on zero-mass groups
    return [np.sort(order[: n * group]) for order, n in zip(ranked, taken)]


def _ranked_groups(
    activations: Sequence[torch.Tensor | np.ndarray], group: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer: neuron ids hottest first (ties: lower id first) and the mass of each group."""
    if group <= 0:
        raise ValueError(f"group must be > 0, got {group}")
    ranked, masses = [], []
    for i, act in enumerate(activations):
        a = act.detach().cpu().double().numpy() if isinstance(act, torch.Tensor) else np.asarray(act)
        a = a.astype(np.float64)
        if a.ndim != 1:
            raise ValueError(f"activations[{i}] must be 1-D, got shape {tuple(a.shape)}")
        if a.size % group:
            raise ValueError(
                f"activations[{i}] has {a.size} neurons, not a multiple of the group size {group}"
            )
        if not np.all(np.isfinite(a)):
            raise ValueError(f"activations[{i}] contains NaN or infinite values")
        if np.any(a < 0):
            raise ValueError(f"activations[{i}] contains negative counts (min {a.min()})")
        order = np.argsort(-a, kind="stable")  # [F] descending; stable keeps lower ids first on ties
        ranked.append(order.astype(np.int64))
        masses.append(a[order].reshape(-1, group).sum(axis=1))  # [F / group], non-increasing
    return ranked, masses


def _group_costs(bytes_per_neuron: int | Sequence[int], n_layers: int, group: int) -> list[int]:
    if isinstance(bytes_per_neuron, (int, np.integer)):
        per_layer = [int(bytes_per_neuron)] * n_layers
    else:
        per_layer = [int(b) for b in bytes_per_neuron]
        if len(per_layer) != n_layers:
            raise ValueError(f"bytes_per_neuron has {len(per_layer)} entries for {n_layers} layers")
    if any(b <= 0 for b in per_layer):
        raise ValueError(f"bytes_per_neuron must be > 0, got {bytes_per_neuron}")
    return [group * b for b in per_layer]


def _affordable_minimum(masses: list[np.ndarray], costs: list[int], budget: int, wanted: int) -> int:
    """The largest per-layer minimum <= wanted whose cost fits in the budget."""

    def cost(m: int) -> int:
        return sum(min(m, len(g)) * c for g, c in zip(masses, costs))

    m = wanted
    while m > 0 and cost(m) > budget:
        m -= 1
    if m < wanted:
        log.warning(
            "VRAM budget of %d bytes cannot give every layer %d neuron groups (needs %d); using %d per layer",
            budget,
            wanted,
            cost(wanted),
            m,
        )
    return m


def _total(masses: list[np.ndarray], taken: list[int]) -> float:
    return float(sum(m[:n].sum() for m, n in zip(masses, taken)))


def _greedy(masses: list[np.ndarray], costs: list[int], budget: int, start: list[int]) -> list[int]:
    """Groups per layer: from `start`, add groups by mass per byte, heaviest first, while they fit.

    With one cost for all layers this is the original's rule (the globally heaviest
    `budget // cost` groups; ties go to the lower layer) and optimal. A group that does not fit
    is skipped, and so are the rest of its layer: they cost the same and the budget only shrinks.
    """
    taken = list(start)
    left = budget - sum(n * c for n, c in zip(taken, costs))
    layer = np.concatenate(
        [np.full(len(m) - n, i) for i, (m, n) in enumerate(zip(masses, taken))] + [np.zeros(0)]
    )
    density = np.concatenate([m[n:] / c for m, n, c in zip(masses, taken, costs)] + [np.zeros(0)])
    for i in layer[np.argsort(-density, kind="stable")].astype(np.int64).tolist():
        if costs[i] <= left:
            taken[i] += 1
            left -= costs[i]
    return taken


def _milp(masses: list[np.ndarray], costs: list[int], budget: int, start: list[int]) -> list[int] | None:
    """Exact groups per layer: max mass s.t. cost <= budget, groups of a layer taken in order,
    at least `start[i]` groups in layer i. Variables x[i, j] in {0, 1} (layer i, j-th heaviest
    group). None if the solver found nothing in its time limit."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    sizes = [len(m) for m in masses]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(starts[-1])
    if n == 0:
        return [0] * len(masses)
    mass = np.concatenate(masses)
    cost = np.repeat(np.asarray(costs, dtype=np.float64), sizes)
    lower = np.zeros(n)
    for i, m in enumerate(start):
        lower[starts[i] : starts[i] + m] = 1.0

    constraints = [LinearConstraint(cost[None, :], -np.inf, float(budget))]
    # Order within a layer: x[i, j + 1] <= x[i, j]. Masses are sorted so this loses nothing, and it
    # makes the answer a prefix (the top-k neurons) and the problem smaller for the branch and bound.
    follow = np.setdiff1d(np.arange(1, n), starts[:-1])  # every (i, j) with j > 0
    if follow.size:
        rows = np.arange(follow.size)
        a = coo_array(
            (
                np.r_[np.ones(follow.size), -np.ones(follow.size)],
                (np.r_[rows, rows], np.r_[follow, follow - 1]),
            ),
            shape=(follow.size, n),
        )
        constraints.append(LinearConstraint(a, -np.inf, 0.0))

    res = milp(
        c=-mass,
        constraints=constraints,
        integrality=np.ones(n),
        bounds=Bounds(lower, np.ones(n)),
        options={"time_limit": MILP_TIME_LIMIT_S},
    )
    if res.x is None:
        log.warning("placement MILP found no solution (%s); using the greedy placement", res.message)
        return None
    if res.status != 0:
        log.warning(
            "placement MILP stopped early (%s); using the better of its placement and greedy", res.message
        )
    x = np.round(res.x).astype(np.int64)
    return [int(x[starts[i] : starts[i + 1]].sum()) for i in range(len(sizes))]
