"""Spending a VRAM budget, in the original's order minus its bugs (the walk itself: placement.walk).

Walk: each layer's attention block (attention matrices, norms and that layer's KV cache: attention runs
where its cache lives) from layer 0 up; then the predictors of layers on the GPU; then the output head;
what is left goes to hot FFN rows (the solver picks them). A unit that does not fit is skipped and the
walk goes on (the original stops at the first miss and then silently disables the FFN split). With activation
statistics, the units that carry a fixed cost and so compete with hot rows (the first GPU layer's attention
scratch, the output head, attention blocks, predictors) are chosen by value instead (placement.value), so a
larger budget never keeps fewer bytes a token off the CPU than a smaller one.

The budget covers everything the process allocates for the model on the GPU: placed tensors, each GPU
layer's KV cache at the plan's context in that device's KV dtype, hot rows in the form they are copied in,
and the compute scratch space of the largest prefill forward (`scratch_parts`): the part every forward
needs is reserved first, attention's temporaries (scores over the whole context) with the first layer
whose attention goes to the GPU. What a tensor costs once placed comes from the device policy
(hotcold.device), the same rules the loader places by. Byte counts are Python ints throughout (PowerInfer's
int32 overflowed above 2 GiB). Pure functions of sizes, except `default_budget_bytes`, which asks CUDA, and
`plan_budget`, which reads the model's statistics unless given them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hotcold.config import ModelConfig
from hotcold.device import kv_dtype
from hotcold.gguf.io import ModelFile
from hotcold.placement import value

# the scratch space and the walk have their own modules; the budget's callers import these names from here
from hotcold.placement.scratch import (  # noqa: F401
    DEFAULT_CTX,
    LIBRARY_WORKSPACE_BYTES,
    default_ctx,
    scratch_bytes,
    scratch_parts,
)
from hotcold.placement.walk import (  # noqa: F401
    GIB,
    MIB,
    BudgetPlan,
    WalkCosts,
    _mib,
    hot_bytes_per_neuron,
    kv_bytes_per_layer,
    layer_tensor_groups,
    output_tensors,
    placed_sizes,
    walk,
    walk_costs,
)
from hotcold.runtime.generation import PREFILL_CHUNK  # noqa: F401 (re-exported)

FREE_VRAM_MARGIN = 512 << 20  # left untouched when the budget is "all free VRAM"


@dataclass
class OffloadPlan:
    """Dense layer offload (llama.cpp's -ngl) at a budget: the last `n_layers` layers and, where the plan
    reserved it, the output head on the GPU."""

    budget_bytes: int
    scratch_bytes: int
    n_layers: int
    output_on_gpu: bool
    spent: dict[str, int] = field(default_factory=dict)  # layers (weights), kv, output
    missed: list[str] = field(default_factory=list)

    def parts(self) -> dict[str, int]:
        dense = self.spent.get("layers", 0) + self.spent.get("output", 0)
        return {"dense": dense, "kv": self.spent.get("kv", 0), "scratch": self.scratch_bytes, "hot": 0}

    def describe(self, n_layer: int) -> str:
        text = (
            f"VRAM budget {self.budget_bytes / GIB:.2f} GiB for layer offload: scratch {self.scratch_bytes / MIB:.0f}"
            f" MiB, {self.n_layers}/{n_layer} layers {self.spent.get('layers', 0) / MIB:.0f} MiB + KV "
            f"{self.spent.get('kv', 0) / MIB:.0f} MiB, output {'on GPU' if self.output_on_gpu else 'on CPU'}"
        )
        if self.missed:
            text += "; did not fit: " + "; ".join(self.missed)
        return text


def plan_budget(
    model_file: ModelFile,
    config: ModelConfig,
    budget_bytes: int,
    *,
    ctx_size: int,
    device_type: str = "cuda",
    kv_sequences: int = 1,
    activations: Sequence[torch.Tensor] | None | str = "auto",
) -> BudgetPlan:
    """device_type: the fast device's type ("cuda"; tests use "cpu", a stand-in that keeps the file's
    blocks and float32 KV). kv_sequences: KV caches allocated at once (one per server slot), each of
    ctx_size. A budget below the scratch space places nothing; `missed` says what did not fit and what it
    needed.

    activations: per-layer activation counts; "auto": the statistics the loader finds for the model file
    (placement.value.statistics_for); None: none. With statistics the fixed-cost units that compete with hot
    rows (the first GPU layer's attention scratch, the output head, attention blocks, predictors) are chosen
    by value, bytes a token kept off the CPU (placement.value.choose_plan), and `choice` says why; without,
    the walk in the original's order."""
    if budget_bytes < 0:
        raise ValueError(f"VRAM budget must be >= 0, got {budget_bytes} bytes")
    budget_bytes = int(budget_bytes)
    costs = walk_costs(
        model_file, config, ctx_size=ctx_size, device_type=device_type, kv_sequences=kv_sequences
    )
    notes: list[str] = []
    if isinstance(activations, str):
        if activations != "auto":
            raise ValueError(f"activations must be counts per layer, None or 'auto', got {activations!r}")
        activations = value.statistics_for(model_file, config, notes)
    if activations is None or budget_bytes == 0:
        plan = walk(costs, budget_bytes)
        plan.choice = notes
        return plan
    return value.choose_plan(model_file, config, costs, budget_bytes, activations, notes=notes)


def default_budget_bytes() -> int:
    """All the VRAM this process could still allocate, minus a safety margin (the original keeps 256 MiB;
    CUDA's own allocations need more): the driver's free memory plus the caching allocator's free blocks
    (reserved by this process, not allocated: `mem_get_info` counts them as used)."""
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return max(0, int(free) + max(0, int(cached)) - FREE_VRAM_MARGIN)


def plan_offload(
    model_file: ModelFile,
    config: ModelConfig,
    budget_bytes: int,
    *,
    ctx_size: int,
    device_type: str = "cuda",
    kv_sequences: int = 1,
) -> OffloadPlan:
    """Dense execution with layer offload (llama.cpp's -ngl) at a budget: the scratch space first, then the
    output head where it fits (the plan places it: `output_on_gpu`), then whole layers (attention, norms,
    FFN matrices and the fp16 KV cache; predictors stay on the CPU: a dense run never calls them) counted
    from the last."""
    budget_bytes = int(budget_bytes)
    dense, _, ffn = layer_tensor_groups(model_file, config.n_layer)
    size = placed_sizes(model_file, device_type)
    scratch = scratch_bytes(config, ctx_size)
    missed: list[str] = []
    left = budget_bytes - scratch
    if left < 0:
        missed.append(f"the prefill scratch space needs {_mib(scratch)}: nothing placed on the GPU")
        return OffloadPlan(budget_bytes, 0, 0, False, {"layers": 0, "kv": 0, "output": 0}, missed)
    head = sum(size[n] for n in output_tensors(model_file))
    output_on_gpu = head <= left
    if output_on_gpu:
        left -= head
    else:
        missed.append(f"the output head ({_mib(head)})")
    kv = kv_sequences * kv_bytes_per_layer(config, ctx_size, kv_dtype(torch.device(device_type)).itemsize)
    n, weights = 0, 0
    for i in reversed(range(config.n_layer)):
        need = sum(size[t] for t in dense[i] + ffn[i])
        if need + kv > left:
            missed.append(f"{i + 1} more layers (layer {i}: {_mib(need + kv)} with {_mib(kv)} of KV)")
            break
        left -= need + kv
        weights += need
        n += 1
    spent = {"layers": weights, "kv": n * kv, "output": head if output_on_gpu else 0}
    return OffloadPlan(budget_bytes, scratch, n, output_on_gpu, spent, missed)


def dense_layers_fitting(
    model_file: ModelFile, config: ModelConfig, budget_bytes: int, *, ctx_size: int
) -> int:
    """How many whole layers `plan_offload` puts on the GPU."""
    return plan_offload(model_file, config, budget_bytes, ctx_size=ctx_size).n_layers
