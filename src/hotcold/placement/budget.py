"""Spending a VRAM budget, in the original's order minus its bugs.

Walk: each layer's attention block (attention matrices, norms and that layer's KV cache: attention runs
where its cache lives) from layer 0 up; then the predictors of layers on the GPU; then the output head;
what is left goes to hot FFN rows (the solver picks them). A unit that does not fit is skipped and the
walk goes on (the original stops at the first miss and then silently disables the FFN split).

The budget covers everything the process allocates for the model on the GPU: placed tensors, each GPU
layer's KV cache at the plan's context in that device's KV dtype, hot rows in the form they are copied in,
and the compute scratch space of the largest prefill forward (`scratch_parts`): the part every forward
needs is reserved first, attention's temporaries (scores over the whole context) with the first layer
whose attention goes to the GPU. What a tensor costs once placed comes from the device policy
(hotcold.device), the same rules the loader places by. Byte counts are Python ints throughout (PowerInfer's
int32 overflowed above 2 GiB). Pure functions of sizes, except `default_budget_bytes`, which asks CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotcold import names
from hotcold.config import ModelConfig
from hotcold.device import HOT_INDEX_BYTES, hot_row_nbytes, kv_dtype, placed_nbytes
from hotcold.generation import PREFILL_CHUNK
from hotcold.gguf_io import ModelFile

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_CTX = 2048  # the context a model gets without --ctx-size (capped by the file's training context)
FREE_VRAM_MARGIN = 512 << 20  # left untouched when the budget is "all free VRAM"
# cuBLAS's workspace lives in the caching allocator (PyTorch's default: 32 MiB per handle on Hopper), charged
# with the first tensor that cuBLAS multiplies on the GPU (hot rows use Triton): an allowance from
# PyTorch's defaults, not a measurement (nothing here has run on a GPU yet)
LIBRARY_WORKSPACE_BYTES = 32 << 20


def default_ctx(config: ModelConfig) -> int:
    return min(config.n_ctx_train, DEFAULT_CTX)


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
        return text


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


def scratch_parts(config: ModelConfig, ctx_size: int | None = None) -> dict[str, int]:
    """Peak temporaries of the largest prefill forward on the GPU, by phase (bytes). T tokens: the largest
    prefill chunk (generation.PREFILL_CHUNK, at most the context); S: the context size. Within a phase
    every temporary is counted as live at once; phases follow each other, so the peak is the residual
    stream plus the largest phase.

    residual: x, its copy on the layer's device, x + attention, x + FFN ([T, D] float32 each);
    attention: the norm's temporaries and an fp16 copy, q/k/v (fp16 products and float32 copies), RoPE,
      the cache up to S as float32 keys/values and expanded to every head (GQA), the scores and their
      softmax [H, T, S], the causal mask [T, S] (bool and as a float bias), the output and wo's product;
    ffn: the predictor ([T, R] with R <= D, logits [T, n_ff], the mask and its copy), up and gate
      (fp16 products and float32 copies), the activation, the product, the masked copy, its fp16 copy and
      the down product;
    head: the last row's norm and logits [1, V] (a prefill only asks for the last row);
    fixed: the RoPE tables [S, head_dim]; workspace: cuBLAS's (with the first matmul on the GPU)."""
    c = config
    S = int(ctx_size or default_ctx(c))
    T = max(1, min(PREFILL_CHUNK, S))
    D, F, V = int(c.n_embd), int(c.n_ff), int(c.n_vocab)
    H, Dh = int(c.n_head), int(c.head_dim)
    q, kv = H * Dh, int(c.n_head_kv) * Dh
    f32, f16 = 4, 2
    attention = (
        T * D * (3 * f32 + f16)  # norm
        + T * (q + 2 * kv) * (f16 + f32)  # q, k, v
        + 3 * T * (q + kv) * f32  # RoPE on q and k
        + 2 * S * (kv + q) * f32  # keys/values up to S as float32, expanded to every head
        + 2 * H * T * S * f32  # scores and softmax
        + T * S * (1 + f32)  # causal mask, as bool and as a float bias
        + 2 * T * q * f32  # attention output and its [T, H*Dh] copy
        + T * D * (f16 + f32)  # wo
    )
    ffn = (
        T * D * f32 * 2  # predictor hidden layer and its ReLU (rank <= n_embd)
        + T * F * (f32 + 2)  # predictor logits, the mask and its copy on the device
        + T * F * (2 * (f16 + f32) + 3 * f32 + f16)  # up, gate; act, product, masked copy; fp16 for down
        + T * D * (f16 + f32)  # down
    )
    head = D * (3 * f32 + f16) + V * (f16 + f32)
    return {
        "residual": 4 * T * D * f32,
        "attention": attention,
        "ffn": ffn,
        "head": head,
        "fixed": S * Dh * f32,
        "workspace": LIBRARY_WORKSPACE_BYTES,
    }


def scratch_bytes(config: ModelConfig, ctx_size: int | None = None, *, attention: bool = True) -> int:
    """The prefill scratch reserve at `ctx_size` (default: the loader's default context). attention=False:
    without attention's temporaries and cuBLAS's workspace (what a plan with no matmul on the GPU needs: hot
    rows only)."""
    p = scratch_parts(config, ctx_size)
    if not attention:
        return p["residual"] + max(p["ffn"], p["head"]) + p["fixed"]
    return p["residual"] + max(p["attention"], p["ffn"], p["head"]) + p["fixed"] + p["workspace"]


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


def plan_budget(
    model_file: ModelFile,
    config: ModelConfig,
    budget_bytes: int,
    *,
    ctx_size: int,
    device_type: str = "cuda",
    kv_sequences: int = 1,
) -> BudgetPlan:
    """device_type: the fast device's type ("cuda"; tests use "cpu", a stand-in that keeps the file's
    blocks and float32 KV). kv_sequences: KV caches allocated at once (one per server slot), each of
    ctx_size. A budget below the scratch space places nothing; `missed` says what did not fit and what it
    needed."""
    if budget_bytes < 0:
        raise ValueError(f"VRAM budget must be >= 0, got {budget_bytes} bytes")
    budget_bytes = int(budget_bytes)
    L = config.n_layer
    dense, pred, ffn = layer_tensor_groups(model_file, L)
    size = placed_sizes(model_file, device_type)
    missed: list[str] = []
    base = scratch_bytes(config, ctx_size, attention=False)
    attention_scratch = scratch_bytes(config, ctx_size) - base  # comes with the first GPU layer
    if base > budget_bytes:
        if budget_bytes:
            missed.append(f"the prefill scratch space needs {_mib(base)}: nothing placed on the GPU")
        scratch, left = 0, 0
    else:
        scratch, left = base, budget_bytes - base
    spent = {"attention": 0, "predictors": 0, "output": 0}
    kv = kv_sequences * kv_bytes_per_layer(config, ctx_size, kv_dtype(torch.device(device_type)).itemsize)
    kv_total = 0
    layer_on_gpu: list[bool] = []
    first_miss = None
    # a hybrid layer keeps its FFN's down bias where its output goes: the layer's device (sparse/hybrid.py)
    down_bias = [sum(size[n] for n in ffn[i] if n.endswith(".bias") and "down" in n) for i in range(L)]
    for i in range(L):
        extra = 0 if any(layer_on_gpu) else attention_scratch
        need = sum(size[n] for n in dense[i]) + kv + down_bias[i]
        fits = left > 0 and need + extra <= left
        layer_on_gpu.append(fits)
        if fits:
            left -= need + extra
            scratch += extra
            spent["attention"] += need
            kv_total += kv
        elif first_miss is None:
            first_miss = (i, need + extra)
    if first_miss is not None and budget_bytes:
        n_miss = L - sum(layer_on_gpu)
        missed.append(
            f"attention+KV of {n_miss} layers (from layer {first_miss[0]}: {_mib(first_miss[1])} "
            f"with {_mib(kv)} of KV at context {ctx_size})"
        )
    predictor_on_gpu = []
    for i in range(L):
        need = sum(size[n] for n in pred[i])
        fits = layer_on_gpu[i] and bool(pred[i]) and need <= left
        predictor_on_gpu.append(fits)
        if fits:
            left -= need
            spent["predictors"] += need
    need = sum(size[n] for n in output_tensors(model_file))
    extra = 0 if any(layer_on_gpu) else LIBRARY_WORKSPACE_BYTES  # the head's matmul may be cuBLAS's first
    # the head is large and x is one row: worth a copy even from a CPU layer
    output_on_gpu = bool(budget_bytes) and scratch > 0 and need + extra <= left
    if output_on_gpu:
        left -= need + extra
        scratch += extra
        spent["output"] = need
    elif budget_bytes:
        missed.append(f"the output head ({_mib(need)})")
    per_neuron = [hot_bytes_per_neuron(model_file, config, i, ffn[i], device_type) for i in range(L)]
    return BudgetPlan(
        budget_bytes,
        scratch,
        layer_on_gpu,
        predictor_on_gpu,
        output_on_gpu,
        left,
        per_neuron,
        spent,
        kv_total,
        missed,
    )


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
