"""Spending a VRAM budget, in the original's order minus its bugs.

Walk: each layer's attention block (attention matrices, norms and that layer's KV cache: attention runs
where its cache lives) from layer 0 up; then the predictors of layers on the GPU; then the output head;
what is left goes to hot FFN rows (the solver picks them). A unit that does not fit is skipped and the
walk goes on (the original stops at the first miss and then silently disables the FFN split). The
compute scratch space is reserved first, so `--vram-budget 8` never allocates much more than 8 GiB.
What a tensor costs once placed comes from the device policy (hotcold.device), the same rules the loader
places by. Pure functions of sizes, except `default_budget_bytes`, which asks CUDA for its free memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotcold import names
from hotcold.config import ModelConfig
from hotcold.device import kv_dtype, placed_nbytes
from hotcold.gguf_io import ModelFile

GIB = 1 << 30
PREFILL_CHUNK = 512  # tokens per prefill forward (engine.PREFILL_CHUNK)
FREE_VRAM_MARGIN = 512 << 20  # left untouched when the budget is "all free VRAM"


@dataclass
class BudgetPlan:
    budget_bytes: int
    scratch_bytes: int
    layer_on_gpu: list[bool]
    predictor_on_gpu: list[bool]
    output_on_gpu: bool
    hot_bytes: int  # what is left for hot FFN rows
    bytes_per_neuron: list[int]  # per layer: up + gate + down_t row bytes
    spent: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        n_gpu = sum(self.layer_on_gpu)
        parts = [
            f"VRAM budget {self.budget_bytes / GIB:.2f} GiB: scratch {self.scratch_bytes / 2**20:.0f} MiB"
        ]
        parts.append(
            f"attention+KV of {n_gpu}/{len(self.layer_on_gpu)} layers {self.spent.get('attention', 0) / 2**20:.0f} MiB"
        )
        parts.append(
            f"predictors of {sum(self.predictor_on_gpu)} layers {self.spent.get('predictors', 0) / 2**20:.0f} MiB"
        )
        parts.append(f"output {'on GPU' if self.output_on_gpu else 'on CPU'}")
        parts.append(f"{self.hot_bytes / 2**20:.0f} MiB left for hot FFN rows")
        return ", ".join(parts)


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


def scratch_bytes(config: ModelConfig) -> int:
    """Activations of one prefill chunk: projections, FFN intermediates, one row of logits."""
    c = config
    per_token = 4 * (3 * c.n_ff + 8 * c.n_embd + 2 * c.n_head * c.head_dim)
    return PREFILL_CHUNK * per_token + 4 * c.n_vocab * 2


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


def plan_budget(
    model_file: ModelFile,
    config: ModelConfig,
    budget_bytes: int,
    *,
    ctx_size: int,
    device_type: str = "cuda",
) -> BudgetPlan:
    """device_type: the fast device's type ("cuda"; tests use "cpu", a stand-in that keeps the file's
    blocks and float32 KV)."""
    if budget_bytes < 0:
        raise ValueError(f"VRAM budget must be >= 0, got {budget_bytes} bytes")
    L = config.n_layer
    dense, pred, ffn = layer_tensor_groups(model_file, L)
    size = placed_sizes(model_file, device_type)
    file_bytes = {name: e.n_bytes for name, e in model_file.tensors.items()}  # hot rows stay in their format
    left = budget_bytes
    scratch = scratch_bytes(config)
    spent = {"attention": 0, "predictors": 0, "output": 0}
    if scratch > left:
        left = 0
    else:
        left -= scratch
    kv = kv_bytes_per_layer(config, ctx_size, kv_dtype(torch.device(device_type)).itemsize)
    layer_on_gpu = []
    for i in range(L):
        need = sum(size[n] for n in dense[i]) + kv
        fits = need <= left
        layer_on_gpu.append(fits)
        if fits:
            left -= need
            spent["attention"] += need
    predictor_on_gpu = []
    for i in range(L):
        need = sum(size[n] for n in pred[i])
        fits = layer_on_gpu[i] and bool(pred[i]) and need <= left
        predictor_on_gpu.append(fits)
        if fits:
            left -= need
            spent["predictors"] += need
    need = sum(size[n] for n in output_tensors(model_file))
    output_on_gpu = need <= left  # the head is large and x is one row: worth a copy even from a CPU layer
    if output_on_gpu:
        left -= need
        spent["output"] = need
    per_neuron = []
    for i in range(L):
        n_ff = max(config.n_ff, 1)
        per_neuron.append(sum(file_bytes[n] for n in ffn[i] if n.endswith(".weight")) // n_ff)
    return BudgetPlan(
        budget_bytes, scratch, layer_on_gpu, predictor_on_gpu, output_on_gpu, left, per_neuron, spent
    )


def default_budget_bytes() -> int:
    """All free VRAM minus a safety margin (the original keeps 256 MiB; CUDA's own allocations need more)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    return max(0, free - FREE_VRAM_MARGIN)


def dense_layers_fitting(
    model_file: ModelFile, config: ModelConfig, budget_bytes: int, *, ctx_size: int
) -> int:
    """For dense execution with layer offload (llama.cpp's -ngl): how many whole layers, counted from the
    last, fit in the budget after the scratch space and the output head."""
    dense, pred, ffn = layer_tensor_groups(model_file, config.n_layer)
    size = placed_sizes(model_file, "cuda")
    left = budget_bytes - scratch_bytes(config)
    left -= sum(size[n] for n in output_tensors(model_file))
    kv = kv_bytes_per_layer(config, ctx_size, kv_dtype(torch.device("cuda")).itemsize)
    n = 0
    for i in reversed(range(config.n_layer)):
        need = sum(size[t] for t in dense[i] + ffn[i]) + kv
        if need > left:
            break
        left -= need
        n += 1
    return n
