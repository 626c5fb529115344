"""Choosing the VRAM plan by value: bytes a token kept off the CPU, by the activation statistics.

The walk in the original's order (placement.walk.walk) places attention, predictors and the output head
whenever they fit, before any hot FFN row. Per byte that is right once paid for: each of them is read every
token, a hot row only when its neuron fires. But some units carry a fixed cost that buys nothing read: the
first GPU layer brings attention's scratch and the library workspace (tens of MiB), a head without a GPU
layer the workspace. On a small model that fixed cost displaces every hot row, so a larger budget held fewer
hot neurons than a smaller one (#47: the demo model held 100% of its FFN neurons hot at 0.05 GiB, 0% at
0.06).

So with statistics the plan is the best of the walk's variants: at most k attention blocks (k = 0..L),
predictors or not, the head or not, each followed by the hot rows the solver would pick with what is left.
Value, in CPU bytes read per token that the plan moves to the GPU:
- an attention block: its weights (file bytes) and half its KV cache (a context filled to its end, on
  average); predictors and the output head: their file bytes; all read every token;
- a hot neuron of layer i: its up / gate / down rows as the CPU reads them, times its frequency, taken as
  count / the largest count of the layer's file: at least the true firing rate (count / tokens profiled),
  so hot rows are never under-valued against the units read every token.
The hot rows of each variant are the solver's greedy choice (groups by activation mass per byte), valued
without solving: exact when every layer's neurons cost the same, a lower bound otherwise.

Every variant possible at one budget is possible at a larger one, with at least as many bytes for rows (where
the attention blocks are of one size, as in every family here: a larger budget cannot swap which k layers fit),
so the value never decreases as the budget grows. The hot-neuron count may, where units read every token are
worth more than the rows they displace: the plan's `choice` then says so, with both figures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.config import ModelConfig
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.placement.solver import _ranked_groups
from hotcold.placement.walk import (
    MIB,
    BudgetPlan,
    WalkCosts,
    hot_bytes_per_neuron,
    layer_tensor_groups,
    output_tensors,
    walk,
)

log = logging.getLogger(__name__)

GROUP = 256  # the solver's group of neurons


def statistics_for(model_file: ModelFile, config: ModelConfig, notes: list[str]) -> list[torch.Tensor] | None:
    """The activation counts the loader finds for `model_file` (placement.profile.default_activation_dir), or
    None: no path, no statistics, or unreadable ones (noted: the walk then keeps the original's order)."""
    from hotcold.placement.profile import default_activation_dir, read_activation_files

    path = getattr(model_file, "path", None)
    if (
        path is None or config.n_expert
    ):  # an MoE model's statistics count experts, not the neurons placed here
        return None
    folder = default_activation_dir(path)
    try:
        return read_activation_files(folder, config.n_layer, config.n_ff)
    except GGUFError as exc:
        notes.append(f"units placed in the original's order: unreadable activation statistics ({exc})")
        return None


@dataclass(frozen=True)
class Values:
    """CPU bytes a token each unit keeps off the CPU once on the GPU."""

    attention: list[float]  # per layer
    predictor: list[float]  # per layer
    head: float
    rows_cost: np.ndarray  # cumulative GPU bytes of the solver's groups, in the order it takes them
    rows_value: np.ndarray  # cumulative CPU bytes a token they save
    rows_neurons: np.ndarray  # cumulative neurons

    def rows(self, hot_bytes: int) -> tuple[int, float]:
        """(neurons, bytes a token) of the hot rows the solver's greedy takes in `hot_bytes`."""
        n = int(np.searchsorted(self.rows_cost, max(0, hot_bytes), side="right"))
        return (int(self.rows_neurons[n - 1]), float(self.rows_value[n - 1])) if n else (0, 0.0)

    def fixed(self, plan: BudgetPlan) -> float:
        return (
            sum(v for v, on in zip(self.attention, plan.layer_on_gpu) if on)
            + sum(v for v, on in zip(self.predictor, plan.predictor_on_gpu) if on)
            + (self.head if plan.output_on_gpu else 0.0)
        )


def unit_values(
    model_file: ModelFile, config: ModelConfig, costs: WalkCosts, activations: Sequence[torch.Tensor]
) -> Values:
    L = len(costs.layer)
    dense, pred, ffn = layer_tensor_groups(model_file, L)
    file_bytes = {name: int(e.n_bytes) for name, e in model_file.tensors.items()}
    kv = costs.kv / max(1, costs.kv_sequences)  # a token reads its own sequence's cache
    attention = [sum(file_bytes[n] for n in dense[i]) + kv / 2 for i in range(L)]
    predictor = [float(sum(file_bytes[n] for n in pred[i])) for i in range(L)]
    head = float(sum(file_bytes[n] for n in output_tensors(model_file)))
    # the CPU's bytes per neuron: the rows as stored (hot_bytes_per_neuron for a device that keeps blocks)
    cpu_row = [hot_bytes_per_neuron(model_file, config, i, ffn[i], "cpu") for i in range(L)]
    ranked, masses = _ranked_groups(activations, GROUP)  # the solver's groups, hottest first per layer
    layer = np.concatenate([np.full(len(m), i) for i, m in enumerate(masses)] + [np.zeros(0, np.int64)])
    gpu_cost = np.asarray([GROUP * b for b in costs.per_neuron], dtype=np.float64)
    top = [float(np.max(np.asarray(a, dtype=np.float64))) if len(a) else 0.0 for a in activations]
    scale = np.asarray([cpu_row[i] / top[i] if top[i] > 0 else 0.0 for i in range(L)])
    mass = np.concatenate(masses + [np.zeros(0)])
    layer = layer.astype(np.int64)
    order = np.argsort(-(mass / gpu_cost[layer]), kind="stable")  # solver._greedy's order
    return Values(
        attention,
        predictor,
        head,
        np.cumsum(gpu_cost[layer[order]]),
        np.cumsum((mass * scale[layer])[order]),
        np.cumsum(np.full(len(order), GROUP)),
    )


@dataclass(frozen=True)
class _Candidate:
    plan: BudgetPlan
    fixed: float
    neurons: int
    rows: float

    @property
    def value(self) -> float:
        return self.fixed + self.rows


def choose_plan(
    model_file: ModelFile,
    config: ModelConfig,
    costs: WalkCosts,
    budget_bytes: int,
    activations: Sequence[torch.Tensor],
    *,
    notes: list[str] | None = None,
) -> BudgetPlan:
    """The walk's variant that keeps the most bytes a token off the CPU (ties: more hot neurons, then the
    original's order); its `choice` says why, where it holds fewer hot neurons than another variant or
    differs from the original's order."""
    if any(len(a) % GROUP for a in activations):  # the solver refuses them too, with the reason
        plan = walk(costs, budget_bytes)
        plan.choice = [
            *(notes or []),
            f"units placed in the original's order: statistics not in groups of {GROUP}",
        ]
        return plan
    values = unit_values(model_file, config, costs, activations)
    L = len(costs.layer)
    candidates = []
    for k in range(L, -1, -1):  # the original's order first: it wins ties
        for predictors in (True, False) if k else (True,):
            for head in (True, False):
                plan = walk(costs, budget_bytes, max_layers=k, predictors=predictors, head=head)
                neurons, rows = values.rows(plan.hot_bytes)
                candidates.append(_Candidate(plan, values.fixed(plan), neurons, rows))
    best = candidates[0]
    for c in candidates[1:]:
        if (c.value, c.neurons) > (best.value, best.neurons):
            best = c
    most = max(candidates, key=lambda c: (c.neurons, c.value))  # first of the ties
    plan = best.plan
    plan.value_bytes = best.value
    plan.choice = list(notes or [])
    if most.neurons > best.neurons:
        plan.displaced = most.neurons - best.neurons
        plan.choice.append(
            f"{_units(best.plan, most.plan, L) or 'units read every token'} on the GPU: read every token "
            f"({_mib(best.fixed - most.fixed)} a token), more than the {plan.displaced} hot neurons "
            f"displaced (at most {_mib(most.rows - best.rows)} a token by the statistics)"
        )
    default = candidates[0]
    if best is not default:
        d = default.plan
        plan.choice.append(
            f"the original's order (attention+KV of {sum(d.layer_on_gpu)}/{L} layers, predictors of "
            f"{sum(d.predictor_on_gpu)}, output on {'GPU' if d.output_on_gpu else 'CPU'}, {default.neurons} hot "
            f"neurons) would keep {_mib(default.value)} a token off the CPU by the statistics"
        )
    if best.value > 0:
        plan.choice.append(f"the plan keeps {_mib(best.value)} a token off the CPU by the statistics")
    return plan


def _units(plan: BudgetPlan, other: BudgetPlan, n_layer: int) -> str:
    """What `plan` puts on the GPU that `other` does not, in words."""
    parts = []
    extra = sum(a and not b for a, b in zip(plan.layer_on_gpu, other.layer_on_gpu))
    if extra:
        parts.append(f"attention+KV of {extra}/{n_layer} layers")
    extra = sum(a and not b for a, b in zip(plan.predictor_on_gpu, other.predictor_on_gpu))
    if extra:
        parts.append(f"predictors of {extra} layers")
    if plan.output_on_gpu and not other.output_on_gpu:
        parts.append("the output head")
    return ", ".join(parts)


def _mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"
