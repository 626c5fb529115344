"""Open a model file, decide where everything lives (the device plan), and build the model on it: with
placement/ and sparse/hybrid.py, the one place that knows what lives where."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from hotcold import cores, hub, memory, registry
from hotcold.config import ModelConfig, config_from_file
from hotcold.device import CPU, DevicePlan
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.load_options import LoadOptions
from hotcold.placement.budget import (
    DEFAULT_CTX,
    GIB,
    BudgetPlan,
    default_budget_bytes,
    plan_budget,
    plan_offload,
)
from hotcold.placement.gpuidx import resolve_placement  # the .gpuidx cache: found, or solved and written
from hotcold.runtime import decoders, head_screen
from hotcold.sparse.ffn import DenseFFN, SparseFFN
from hotcold.storage.model import open_storage
from hotcold.storage.plan import process_rss
from hotcold.tokenizer.vocab import Tokenizer
from hotcold.weights import TensorSource

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo.powerinfer.gguf"
AUTO_BUDGET_STEP = 256 << 20  # an automatic budget is rounded down so the placement cache stays valid


def demo_model_path() -> Path:
    return Path(str(resources.files("hotcold") / "data" / DEMO_MODEL_NAME))


@dataclass
class LoadedModel:
    model: object
    tokenizer: Tokenizer
    config: ModelConfig
    file: ModelFile
    device: str
    dense: bool
    ctx_size: int
    notes: list[str] = field(default_factory=list)  # what went where, for `info` and the load line
    plan: BudgetPlan | None = None
    hot: list[np.ndarray] | None = None
    devices: DevicePlan | None = None
    vram_planned: dict[str, int] | None = None  # VRAM by part (dense, kv, scratch, hot); None: no plan
    storage: object | None = (
        None  # storage.model.ModelStorage under a RAM budget: cold rows read from the file
    )

    @property
    def decoder(self) -> str:
        """The decoder running decode steps: chosen at load (decoders.py), "eager" after a fast one failed."""
        return getattr(self.model, "decoder", "eager")


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' requested but no CUDA GPU is available (torch.cuda.is_available() is False)"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(
    path: str | os.PathLike[str] | None = None, options: LoadOptions | None = None, **kwargs
) -> LoadedModel:
    """Open a model file and build it as `options` say (or `LoadOptions(**kwargs)`), in stages: the options
    (validated when made), the device plan (plan_devices), the tensor source, the family's build, the decoder."""
    opts = options if options is not None else LoadOptions(**kwargs)
    overhead = process_rss()  # the process before load (Python, torch): reported beside a RAM budget
    path = hub.resolve(path) or demo_model_path()  # a model name (ORG/REPO[:TAG]) is pulled or found cached
    threads = opts.threads if opts.threads is not None else cores.default_threads()  # cores.py says why
    torch.set_num_threads(threads)
    device = resolve_device(opts.device)
    model_file = ModelFile(path)
    registry.require(model_file.architecture, str(path))
    config = config_from_file(model_file)
    check_small_tensors(model_file, path)
    module = registry.model_module(config, str(path))
    ctx = opts.ctx_size or min(config.n_ctx_train, DEFAULT_CTX)
    if ctx < 1:
        raise ValueError(f"ctx_size must be >= 1, got {ctx}")
    tokenizer = Tokenizer.from_metadata(model_file.metadata, source=str(path))
    notes: list[str] = []
    if ctx > config.n_ctx_train:  # as llama.cpp warns: positions past training are not extrapolated
        notes.append(
            f"warning: a {ctx}-token context is past the model's training context of {config.n_ctx_train} tokens:"
            " text beyond it may degrade"
        )
    thresholded = _thresholded_sparsity(model_file, config, opts.sparsity, opts.dense)
    dense = opts.dense or not config.sparse
    fast = _fast_device(opts, device, notes)
    placed = plan_devices(path, model_file, config, opts, fast=fast, dense=dense, ctx=ctx, notes=notes)
    from hotcold.kernels import cpu

    cpu.backend()  # compile the CPU kernels now if this machine has not yet: load time, not first-token time
    storage = open_storage(
        path, model_file, config, budget_gib=opts.ram_budget, ctx=ctx, kv_sequences=opts.kv_sequences,
        on_gpu=fast is not None, sparse=not dense and thresholded is None, overhead=overhead, notes=notes,
    )  # fmt: skip
    # packed copies where they fit (a RAM budget's plan counts what it keeps resident, packed, itself)
    packs = storage is not None or memory.fits_packed(memory.weight_bytes(model_file), notes)
    src, make_ffn = _tensor_source(
        path, model_file, config, placed.devices, opts, dense=dense, thresholded=thresholded, threads=threads,
        notes=notes, ctx=ctx, storage=storage, packs=packs,
    )  # fmt: skip
    model = module.build(src, make_ffn)
    if opts.head_screen and packs and storage is None:  # a copy no plan counts, nor a tight load has room for
        head_screen.attach_screen(model, threads=threads, notes=notes)
    model.storage_stats = None if storage is None else storage.stats  # what a request read (generation.py)
    notes.extend(getattr(model, "load_notes", ()))  # what a family says of its file (SmallThinker's gating)
    decoders.choose_decoder(model, requested=opts.decoder, ctx_size=ctx, notes=notes)
    mode = "dense" if dense and thresholded is None else "sparse"
    where = "cpu" if fast is None else f"cpu + {fast}"
    notes.insert(
        0,
        f"{config.arch} {mode} on {where}: {config.n_layer} layers, n_embd {config.n_embd}, n_ff {config.n_ff}",
    )
    dense = dense and thresholded is None  # a thresholded file runs sparse (on a dense device plan)
    return LoadedModel(
        model, tokenizer, config, model_file, device, dense, ctx, notes, placed.plan, placed.hot, placed.devices,
        placed.vram_planned, storage,
    )  # fmt: skip


def _fast_device(opts: LoadOptions, device: str, notes: list[str]) -> torch.device | None:
    """Where hot rows and offloaded layers go: the options' fast_device, the GPU when `device` resolved to
    cuda, or None (everything on the CPU; a VRAM budget of 0 says so too)."""
    cuda = torch.device("cuda") if device == "cuda" else None
    fast = torch.device(opts.fast_device) if opts.fast_device else cuda
    if fast is not None and fast.type == "cuda" and fast.index is None:
        # the plan names the device as its tensors will ("cuda:0"): torch.device("cuda") != "cuda:0"
        fast = torch.device("cuda", torch.cuda.current_device())
    if fast is None and opts.vram_budget:
        notes.append(
            f"--vram-budget {opts.vram_budget:g} GiB ignored: no CUDA GPU in use, everything runs on the CPU"
        )
    return None if opts.vram_budget == 0 else fast


@dataclass(frozen=True)
class PlacedModel:
    """Where everything lives (devices) and, with a VRAM budget, the budget's plan, the hot neurons per layer
    and the VRAM planned by part."""

    devices: DevicePlan
    plan: BudgetPlan | None = None
    hot: list[np.ndarray] | None = None
    vram_planned: dict[str, int] | None = None


def plan_devices(
    path: Path, model_file: ModelFile, config: ModelConfig, opts: LoadOptions, *, fast: torch.device | None,
    dense: bool, ctx: int, notes: list[str],
) -> PlacedModel:  # fmt: skip
    """The device plan: a sparse file at a VRAM budget (attention, predictors and output where the budget walk
    puts them, hot neurons from the placement cache or solved anew), a dense file's whole layers offloaded
    (-ngl, or as many as the budget holds on a GPU), or everything on the CPU."""
    n_gpu_layers = opts.n_gpu_layers
    placed = PlacedModel(DevicePlan.cpu_only(config.n_layer))
    if fast is not None and not dense:
        if opts.vram_budget is None and fast.type == "cuda":
            budget = default_budget_bytes() // AUTO_BUDGET_STEP * AUTO_BUDGET_STEP
        else:
            budget = int((opts.vram_budget or 0) * GIB)
        plan = plan_budget(
            model_file, config, budget, ctx_size=ctx, device_type=fast.type, kv_sequences=opts.kv_sequences,
            # with no hot rows to place, the value walk must not leave attention or the head on the CPU for them
            activations=None if opts.disable_gpu_index else "auto",
        )  # fmt: skip
        notes.append(plan.describe())
        hot = (
            None
            if opts.disable_gpu_index
            else resolve_placement(path, model_file, config, plan, opts.reset_gpu_index, notes)
        )
        if opts.disable_gpu_index:
            notes.append("--disable-gpu-index: every FFN neuron runs on the CPU")
        if hot is not None and fast.type == "cuda":
            from hotcold.kernels import triton as gpu_kernels

            if not gpu_kernels.available():
                raise ValueError(
                    "hot neurons on the GPU need Triton: pip install 'hotcold[gpu]' (or --vram-budget 0)"
                )
        placed = PlacedModel(
            sparse_device_plan(plan, fast, hot), plan, hot, plan.parts(hot_rows_bytes(plan, hot))
        )
    elif fast is not None and (n_gpu_layers or fast.type == "cuda"):
        if n_gpu_layers is None:  # dense on a GPU: as many whole layers as the budget holds
            budget = default_budget_bytes() if opts.vram_budget is None else int(opts.vram_budget * GIB)
            offload = plan_offload(
                model_file,
                config,
                budget,
                ctx_size=ctx,
                device_type=fast.type,
                kv_sequences=opts.kv_sequences,
            )
            devices = offload_device_plan(
                config.n_layer, offload.n_layers, fast, output=offload.output_on_gpu
            )
            notes.append(offload.describe(config.n_layer))
            placed = PlacedModel(devices, vram_planned=offload.parts())
        else:
            placed = PlacedModel(offload_device_plan(config.n_layer, n_gpu_layers, fast))
            n = min(n_gpu_layers, config.n_layer)
            notes.append(f"-ngl {n_gpu_layers}: {n} of {config.n_layer} layers on {fast}")
    if n_gpu_layers and (fast is None or placed.plan is not None):
        reason = "no GPU in use" if fast is None else "sparse files are placed by --vram-budget"
        notes.append(f"-ngl {n_gpu_layers} ignored: {reason}")
    return placed


def _tensor_source(
    path: Path, model_file: ModelFile, config: ModelConfig, devices: DevicePlan, opts: LoadOptions, *,
    dense: bool, thresholded, threads: int, notes: list[str], ctx: int, storage=None, packs: bool = True,
):  # fmt: skip
    """(TensorSource, make_ffn): the source made whole at once (a sparsified file's assets, the rows' order for
    batches), and the FFN maker the family asks for each layer's FFN."""
    order = None
    if (
        opts.kv_sequences
        > 1  # a batch's tokens share the hot rows; one sequence gains too little for the copy
        and not dense
        and thresholded is None
        and devices.hot is None
        and packs
        and storage is None  # stored layers read rows in the file's order; a tight load has no room
        and all(d.type == "cpu" for d in devices.ffn)
    ):
        order = neuron_order(path, config, notes)
    if thresholded is None:
        src = TensorSource(model_file, config, devices, neuron_order=order, ctx_size=ctx, packs=packs,
                           storage=storage)  # fmt: skip
        return src, ffn_maker(devices, dense=dense, threads=threads, storage=storage)
    from hotcold.sparse.attention_inputs import InputAssets
    from hotcold.sparse.thresholded import thresholded_maker

    assets, level = thresholded
    inputs = InputAssets.from_file(
        model_file, assets.grid, assets.method, config.n_layer, config.n_embd, config.n_head * config.head_dim
    )
    src = TensorSource(
        model_file, config, devices, thresholded=True, neuron_order=order, ctx_size=ctx, packs=packs,
        sparse_inputs=None if inputs is None else (inputs, level, threads),
    )  # fmt: skip
    also = " and of attention inputs" if inputs is not None else ""
    notes.append(
        f"sparsify ({assets.method}): skipping {100 * level:.0f}% of FFN neurons{also} per token "
        f"(the file was calibrated for {100 * assets.sparsity:.0f}%)"
    )
    return src, thresholded_maker(src, assets, level, threads=threads)


@dataclass(frozen=True)
class VramFigures:
    """VRAM planned (by part: dense tensors, KV cache, prefill scratch, hot rows) and what this process has
    allocated (torch.cuda.memory_allocated) and reserved at most (max_memory_reserved). Without a GPU in
    use: no parts and None."""

    planned: dict[str, int]
    used: int | None
    peak_reserved: int | None
    budget: int | None = None

    @property
    def planned_total(self) -> int:
        return sum(self.planned.values())


def vram_figures(loaded: LoadedModel) -> VramFigures:
    """The loaded model's VRAM plan beside what CUDA's caching allocator reports for this process now
    (every model and buffer of the process: the figure the budget is meant to bound)."""
    devices = getattr(loaded, "devices", None)
    places = [] if devices is None else [*devices.attention, *devices.ffn, devices.output, devices.fast]
    if not any(d is not None and d.type == "cuda" for d in places):
        return VramFigures({}, None, None)
    used = peak = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        used, peak = int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_reserved())
    plan = getattr(loaded, "plan", None)
    budget = plan.budget_bytes if plan is not None else None
    return VramFigures(dict(getattr(loaded, "vram_planned", None) or {}), used, peak, budget)


def hot_rows_bytes(plan: BudgetPlan, hot: list[np.ndarray] | None) -> int:
    """What the hot copies take on the fast device (Python ints: no int32 wrap above 2 GiB)."""
    if hot is None:
        return 0
    return sum(len(h) * int(b) for h, b in zip(hot, plan.bytes_per_neuron, strict=True))


def _thresholded_sparsity(model_file: ModelFile, config: ModelConfig, sparsity: float | None, dense: bool):
    """(assets, sparsity) when a `hotcold sparsify` file runs thresholded, None when it runs dense
    (dense=True, sparsity 0, or a file without thresholds). sparsity > 0 on such a file: ValueError."""
    if not config.sparsified:
        if sparsity:
            raise ValueError(
                f"{model_file.path}: sparsity {sparsity:g} needs a file written by `hotcold sparsify` (this one "
                "has no thresholds; run `hotcold sparsify -m MODEL -f corpus.txt -o OUT`)"
            )
        return None
    from hotcold.sparse.thresholded import SparsifyAssets

    assets = SparsifyAssets.from_file(model_file, config.n_layer, config.n_ff)
    level = assets.sparsity if sparsity is None else sparsity
    return None if dense or level == 0 else (assets, level)


def sparse_device_plan(plan: BudgetPlan, fast: torch.device, hot: list[np.ndarray] | None) -> DevicePlan:
    """A sparse file at a VRAM budget: attention (+KV) and predictors where the budget walk put them, the
    full FFN matrices on the CPU, hot rows copied to the fast device."""

    def where(on_fast: list[bool]) -> tuple[torch.device, ...]:
        return tuple(fast if f else CPU for f in on_fast)

    return DevicePlan(
        attention=where(plan.layer_on_gpu),
        predictor=where(plan.predictor_on_gpu),
        ffn=(CPU,) * len(plan.layer_on_gpu),
        output=fast if plan.output_on_gpu else CPU,
        fast=fast,
        hot=None if hot is None else tuple(hot),
    )


def offload_device_plan(
    n_layer: int, n_gpu_layers: int, fast: torch.device, *, output: bool | None = None
) -> DevicePlan:
    """llama.cpp's -ngl for dense files: the last N layers (attention and FFN) on the GPU; the output head
    there when `output` says so (a budget's OffloadPlan), or by llama.cpp's rule (N > n_layer) when None.
    Predictors stay on the CPU: a dense run never calls them."""
    on_fast = [i >= n_layer - n_gpu_layers for i in range(n_layer)]
    layers = tuple(fast if f else CPU for f in on_fast)
    head = n_gpu_layers > n_layer if output is None else output
    return DevicePlan(layers, (CPU,) * n_layer, layers, output=fast if head else CPU)


def ffn_maker(devices: DevicePlan, *, dense: bool, threads: int | None, storage=None):
    """make_ffn(layer, weights, predictor, norm, expert=None) for the families: dense, sparse on the CPU (its
    cold rows read from the file under a RAM budget: `storage`), or hybrid where the layer has hot rows; each FFN
    gets its norm on the device that computes it."""

    def make(layer: int, weights, predictor, norm, *, expert: int | None = None):
        if dense or predictor is None or weights.down_t is None:
            norm = None if norm is None else norm.to(devices.ffn[layer])
            return DenseFFN(weights, layer=layer, norm=norm, expert=expert)
        hot = devices.hot_rows(layer)
        if hot is None:
            norm = None if norm is None else norm.to(CPU)
            if storage is not None and expert is None:
                return storage.ffn(layer, weights, predictor, norm, threads=threads)
            return SparseFFN(weights, predictor, layer=layer, norm=norm, threads=threads, expert=expert)
        from hotcold.sparse.hybrid import HybridFFN

        # the hybrid FFN norms on the layer's device (where x is) and sends the normed input to both halves
        return HybridFFN(
            weights,
            predictor,
            torch.from_numpy(hot),
            devices.fast,
            layer=layer,
            norm=norm,
            threads=threads,
            expert=expert,
        )

    return make


def check_small_tensors(model_file: ModelFile, path: Path) -> None:
    """Refuse (GGUFError naming the tensor) NaN/inf in the 1-D float tensors: norms and biases, a few KB a layer,
    scanned at every load. One bad norm makes every output NaN; the matrices (GBs) are not scanned here: a NaN
    there shows in the logits, which generation checks (generation.check_finite) and Engine.stream locates."""
    from gguf import GGMLQuantizationType as Q

    for entry in model_file.tensors.values():
        if len(entry.shape) != 1 or entry.qtype not in (Q.F32, Q.F16, Q.BF16):
            continue
        data = np.asarray(entry.data)
        if entry.qtype == Q.BF16:  # stored as bytes: NaN / inf have every exponent bit set
            data = data.view(np.uint16)
            bad = int(np.count_nonzero((data & 0x7F80) == 0x7F80))
        else:
            bad = int(data.size - np.count_nonzero(np.isfinite(data)))
        if bad:
            raise GGUFError(
                f"{path}: tensor {entry.name} holds {bad} NaN/inf of its {data.size} values: the file is "
                "damaged, or was written from weights that had overflowed"
            )


def neuron_order(path: Path, config: ModelConfig, notes: list[str]) -> list[torch.Tensor | None] | None:
    """Per layer, the FFN neurons by activation count, hottest first (ties in the file's order), from the
    statistics beside the model (`hotcold profile` writes them; PowerInfer's models ship them). A sparse CPU
    layer of a model loaded for several sequences keeps its rows in this order, copied at load into memory
    with huge pages asked for: the rows a batch's tokens share, mostly the hottest, then lie side by side
    (8 prompts x 32 tokens of the 1B synthetic through generate_batch: 0.935x the time over 20 in-process A/B
    rounds, 0.91-0.99x in shorter runs; one sequence 0.95-1.06x, within this host's noise, against ~2.5 s of
    copying at load here, so a model loaded for one sequence is left as stored, mapped from the file). None without statistics, with
    unreadable ones (noted), or with HOTCOLD_NEURON_ORDER=0 (to compare the two); a layer already stored
    hottest first gets None (nothing to copy)."""
    if os.environ.get("HOTCOLD_NEURON_ORDER", "1") == "0":
        notes.append("FFN neurons in the file's order (HOTCOLD_NEURON_ORDER=0)")
        return None
    from hotcold.placement.profile import default_activation_dir, hottest_first

    activation_dir = default_activation_dir(path)
    try:
        counts = load_activations(activation_dir, config)
    except GGUFError as exc:
        notes.append(f"FFN neurons in the file's order: {exc}")
        return None
    if counts is None:
        return None
    orders = [None if torch.equal(o, torch.arange(len(o))) else o for o in hottest_first(counts)]
    moved = sum(o is not None for o in orders)
    notes.append(
        f"FFN neurons kept hottest first, by the activation statistics in {activation_dir} "
        f"({moved} of {len(orders)} layers reordered, the rest stored so)"
    )
    return orders if moved else None


def load_activations(activation_dir: Path, config: ModelConfig) -> list[torch.Tensor] | None:
    """The activation statistics beside a model as float counts (None without the folder; bad files named)."""
    from hotcold.placement.profile import read_activation_files

    counts = read_activation_files(activation_dir, config.n_layer, config.n_ff)
    return None if counts is None else [c.float() for c in counts]
