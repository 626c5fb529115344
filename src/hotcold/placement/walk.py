"""The budget walk, in the original's order minus its bugs: what each unit costs once placed, and the walk
itself. placement.budget spends a budget with it (plan_budget); placement.value chooses among its variants.

Walk: each layer's attention block (attention matrices, norms and that layer's KV cache: attention runs
where its cache lives) from layer 0 up; then the predictors of layers on the GPU; then the output head;
what is left goes to hot FFN rows (the solver picks them). A unit that does not fit is skipped and the
walk goes on (the original stops at the first miss and then silently disables the FFN split).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotcold.config import ModelConfig
from hotcold.device import HOT_INDEX_BYTES, hot_row_nbytes, kv_dtype, placed_nbytes
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile
from hotcold.placement.scratch import LIBRARY_WORKSPACE_BYTES, scratch_bytes

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class BudgetPlan:
    budget_bytes: int
    scratch_bytes: (
        int  # reserved for a prefill forward's temporaries (attention's too once a layer is placed)
    )
    layer_on_gpu: list[bool]
    predictor_on_gpu: list[bool]
    output_on_gpu: bool
    hot_bytes: int  # what is left for hot FFN rows
    bytes_per_neuron: list[int]  # per layer: one hot neuron's up + gate + down_t rows as copied (+ its id)
    spent: dict[str, int] = field(default_factory=dict)  # attention (with KV), predictors, output
    kv_bytes: int = 0  # the KV caches of the GPU layers (inside spent["attention"])
    missed: list[str] = field(default_factory=list)  # what did not fit, with what it needed
    # chosen by value (placement.value): CPU bytes a token the plan keeps off the CPU by the statistics, hot
    # neurons it gives up for units read every token, and why (None / 0 / []: the walk without statistics)
    value_bytes: float | None = None
    displaced: int = 0
    choice: list[str] = field(default_factory=list)

    def parts(self, hot_used: int | None = None) -> dict[str, int]:
        """Planned VRAM by part: dense tensors, KV cache, scratch, hot rows (`hot_used`: what the solver
        placed; default what the plan left for them)."""
        dense = sum(self.spent.values()) - self.kv_bytes
        hot = self.hot_bytes if hot_used is None else hot_used
        return {"dense": dense, "kv": self.kv_bytes, "scratch": self.scratch_bytes, "hot": max(0, hot)}

    def describe(self) -> str:
        n_gpu = sum(self.layer_on_gpu)
        parts = [f"VRAM budget {self.budget_bytes / GIB:.2f} GiB: scratch {self.scratch_bytes / MIB:.0f} MiB"]
        parts.append(
            f"attention+KV of {n_gpu}/{len(self.layer_on_gpu)} layers {self.spent.get('attention', 0) / MIB:.0f} MiB"
            f" (KV {self.kv_bytes / MIB:.0f} MiB)"
        )
        parts.append(
            f"predictors of {sum(self.predictor_on_gpu)} layers {self.spent.get('predictors', 0) / MIB:.0f} MiB"
        )
        parts.append(f"output {'on GPU' if self.output_on_gpu else 'on CPU'}")
        parts.append(f"{max(0, self.hot_bytes) / MIB:.0f} MiB left for hot FFN rows")
        text = ", ".join(parts)
        if self.missed:
            text += "; did not fit: " + "; ".join(self.missed)
        if self.choice:
            text += "; " + "; ".join(self.choice)
        return text


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def layer_tensor_groups(
    model_file: ModelFile, n_layer: int
) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """Per layer: dense (attention + norms) tensor names, predictor names, FFN matrix names."""
    dense, pred, ffn = ([[] for _ in range(n_layer)] for _ in range(3))
    for name in model_file.tensors:
        layer = names.block_of(name)
        if layer is None or layer >= n_layer:
            continue
        if names.template_of(name, names.PREDICTOR_MATRICES):
            pred[layer].append(name)
        elif names.template_of(name, names.FFN_MATRICES):
            ffn[layer].append(name)
        else:
            dense[layer].append(name)
    return dense, pred, ffn


def kv_bytes_per_layer(config: ModelConfig, ctx_size: int, dtype_bytes: int) -> int:
    return 2 * ctx_size * config.n_head_kv * config.head_dim * dtype_bytes


def placed_sizes(model_file: ModelFile, device_type: str) -> dict[str, int]:
    """Bytes each tensor takes once placed on a device of `device_type` (hotcold.device.placed_nbytes)."""
    return {
        name: placed_nbytes(e.qtype.name, tuple(e.shape), e.n_bytes, device_type)
        for name, e in model_file.tensors.items()
    }


def output_tensors(model_file: ModelFile) -> list[str]:
    """The head's tensors; a tied head needs its own copy of the embedding on the GPU."""
    out = [names.tensor(names.OUTPUT_NORM), names.tensor(names.OUTPUT_NORM, suffix="bias")]
    head = (
        names.tensor(names.OUTPUT)
        if names.tensor(names.OUTPUT) in model_file.tensors
        else names.tensor(names.TOKEN_EMBD)
    )
    return [n for n in [*out, head] if n in model_file.tensors]


def hot_bytes_per_neuron(
    model_file: ModelFile, config: ModelConfig, layer: int, ffn: list[str], device_type: str
) -> int:
    """One hot neuron of a layer on the fast device: its up, gate and down_t rows as sparse/hybrid.py copies
    them, its up bias (float32), and on a GPU its int64 id. Layers without that layout (experts): the file
    bytes of the FFN matrices per neuron."""
    tensors = model_file.tensors
    rows = [names.tensor(t, layer) for t in (names.FFN_UP, names.FFN_GATE, names.FFN_DOWN_T)]
    rows = [n for n in rows if n in tensors]
    if not rows:
        return sum(int(tensors[n].n_bytes) for n in ffn if n.endswith(".weight")) // max(int(config.n_ff), 1)
    total = 0
    for n in rows:
        e = tensors[n]
        n_rows, row_values = int(e.shape[0]), int(e.shape[-1])
        total += hot_row_nbytes(e.qtype.name, row_values, int(e.n_bytes) // n_rows, device_type)
    if names.tensor(names.FFN_UP, layer, "bias") in tensors:
        total += 4
    return total + (HOT_INDEX_BYTES if device_type == "cuda" else 0)


@dataclass(frozen=True)
class WalkCosts:
    """What the budget walk prices, computed once per file, context and device (placed bytes)."""

    ctx_size: int
    base: int  # the scratch every GPU forward needs (no attention, no cuBLAS workspace)
    attention_scratch: int  # attention's temporaries + the library workspace: with the first GPU layer
    layer: list[int]  # per layer: attention matrices, norms, KV cache (all sequences), down bias
    kv: int  # one layer's KV caches (all sequences)
    kv_sequences: int
    predictor: list[int]  # per layer (0: none)
    head: int
    per_neuron: list[int]  # one hot neuron per layer, as copied (hot_bytes_per_neuron)


def walk_costs(
    model_file: ModelFile, config: ModelConfig, *, ctx_size: int, device_type: str, kv_sequences: int
) -> WalkCosts:
    L = config.n_layer
    dense, pred, ffn = layer_tensor_groups(model_file, L)
    size = placed_sizes(model_file, device_type)
    base = scratch_bytes(config, ctx_size, attention=False)
    kv = kv_sequences * kv_bytes_per_layer(config, ctx_size, kv_dtype(torch.device(device_type)).itemsize)
    # a hybrid layer keeps its FFN's down bias where its output goes: the layer's device (sparse/hybrid.py)
    down_bias = [sum(size[n] for n in ffn[i] if n.endswith(".bias") and "down" in n) for i in range(L)]
    return WalkCosts(
        ctx_size=ctx_size,
        base=base,
        attention_scratch=scratch_bytes(config, ctx_size) - base,
        layer=[sum(size[n] for n in dense[i]) + kv + down_bias[i] for i in range(L)],
        kv=kv,
        kv_sequences=kv_sequences,
        predictor=[sum(size[n] for n in pred[i]) for i in range(L)],
        head=sum(size[n] for n in output_tensors(model_file)),
        per_neuron=[hot_bytes_per_neuron(model_file, config, i, ffn[i], device_type) for i in range(L)],
    )


def walk(
    costs: WalkCosts,
    budget_bytes: int,
    *,
    max_layers: int | None = None,
    predictors: bool = True,
    head: bool = True,
) -> BudgetPlan:
    """The walk in the original's order: attention blocks from layer 0 up (at most `max_layers` of them), the
    predictors of GPU layers (unless predictors=False), the output head (unless head=False), the rest for hot
    rows. With the defaults: the order without statistics. A unit that does not fit is skipped."""
    c = costs
    L = len(c.layer)
    max_layers = L if max_layers is None else max_layers
    missed: list[str] = []
    if c.base > budget_bytes:
        if budget_bytes:
            missed.append(f"the prefill scratch space needs {_mib(c.base)}: nothing placed on the GPU")
        scratch, left = 0, 0
    else:
        scratch, left = c.base, budget_bytes - c.base
    spent = {"attention": 0, "predictors": 0, "output": 0}
    kv_total = 0
    layer_on_gpu: list[bool] = []
    first_miss = None
    for i in range(L):
        extra = 0 if any(layer_on_gpu) else c.attention_scratch
        need = c.layer[i]
        wanted = sum(layer_on_gpu) < max_layers
        fits = wanted and left > 0 and need + extra <= left
        layer_on_gpu.append(fits)
        if fits:
            left -= need + extra
            scratch += extra
            spent["attention"] += need
            kv_total += c.kv
        elif wanted and first_miss is None:
            first_miss = (i, need + extra)
    if first_miss is not None and budget_bytes:
        n_miss = min(L, max_layers) - sum(layer_on_gpu)
        missed.append(
            f"attention+KV of {n_miss} layers (from layer {first_miss[0]}: {_mib(first_miss[1])} "
            f"with {_mib(c.kv)} of KV at context {c.ctx_size})"
        )
    predictor_on_gpu = []
    for i in range(L):
        need = c.predictor[i]
        fits = predictors and layer_on_gpu[i] and need > 0 and need <= left
        predictor_on_gpu.append(fits)
        if fits:
            left -= need
            spent["predictors"] += need
    extra = 0 if any(layer_on_gpu) else LIBRARY_WORKSPACE_BYTES  # the head's matmul may be cuBLAS's first
    # the head is large and x is one row: worth a copy even from a CPU layer
    output_on_gpu = head and bool(budget_bytes) and scratch > 0 and c.head + extra <= left
    if output_on_gpu:
        left -= c.head + extra
        scratch += extra
        spent["output"] = c.head
    elif head and budget_bytes:
        missed.append(f"the output head ({_mib(c.head)})")
    return BudgetPlan(
        budget_bytes,
        scratch,
        layer_on_gpu,
        predictor_on_gpu,
        output_on_gpu,
        left,
        list(c.per_neuron),
        spent,
        kv_total,
        missed,
    )
