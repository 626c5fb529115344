"""Train PowerInfer predictors: per layer, a low-rank MLP that says which FFN neurons will fire.

Predictor = fc2 @ relu(fc1 @ p), no biases; fc1 [R, D], fc2 [F, R]; neuron i is computed iff its logit
>= the file's `sparse_threshold`. p is the architecture's predictor input (the residual after attention
for llama), exactly what an FFN observer (hotcold.runtime.state.Observer) receives as `pred_input`.

Method (CPU-friendly: the model runs once, then the layers are trained one by one):
1. Run the model densely over the corpus windows and keep, for the layers still to train, every token's
   predictor input (float16) and its true firing mask (activation != 0, bit-packed). Every k-th window
   (k = 1 / val_fraction) is held out for validation.
2. Per layer and per rank of the ladder (smallest first): train with BCE on the logits, positives
   weighted by `pos_weight` (default sqrt(#negatives / #positives), at most 8) so that missing a firing
   neuron costs more than computing an idle one; Adam (lr 1e-2, batches of 256 tokens, 4 epochs, cosine
   decay), inputs divided by their RMS (folded into fc1 afterwards, so the saved predictor takes the raw
   input). On the demo model's sparsest layer this selects 1.23x the firing neurons at 99% recall with
   rank 64, where lr 2e-3 with batches of 1024 selected 2.2x: small steps, many of them, matter most.
3. On the held-out tokens pick the layer's threshold as the largest one whose recall (firing neurons
   selected / firing neurons, over all tokens) reaches the target, and measure the selection ratio
   (selected / truly firing). The first rank whose ratio is <= max_selection is kept; when none is, the
   rank with the lowest ratio.
4. A file has one threshold for all layers, and a bias-free predictor cannot shift its logits, but it can
   scale them: fc2 is multiplied by |SPARSE_THRESHOLD| / |t_layer|, which maps the layer's threshold
   t_layer < 0 onto the shared SPARSE_THRESHOLD = -1 exactly.

Output: PowerInfer's predictor folder (`model_{i}.pt` with fc1.weight / fc2.weight as float32,
`config.json` with `sparse_threshold` and per-layer statistics), written as one set (atomic_directory): a
failure partway leaves the folder as it was, never a mix. Layers it already holds are kept, not retrained.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hotcold.atomic import atomic_directory, atomic_output, check_directory
from hotcold.placement.profile import (
    check_relu,
    ffn_widths,
    run_windows,
    save_tensor,
    token_windows,
    window_ctx,
)

log = logging.getLogger(__name__)

SPARSE_THRESHOLD = -1.0  # the shared threshold written to config.json; each layer's fc2 is scaled onto it
MAX_LAYER_THRESHOLD = -0.05  # a layer threshold above this is lowered to it (more neurons, recall kept)
DEFAULT_RANKS = (64, 128, 256, 512)
MIN_STEPS_PER_EPOCH = 200


@dataclass
class TrainConfig:
    ranks: tuple[int, ...] = DEFAULT_RANKS  # tried smallest first
    recall: float = 0.99  # recall target on the held-out tokens
    max_selection: float = 1.5  # a rank meets the target when selected / truly firing <= this
    epochs: int = 4
    batch_size: int = 256
    lr: float = 1e-2
    pos_weight: float | None = None  # None: sqrt(#negatives / #positives), clamped to [1, 8]
    val_fraction: float = 0.1
    device: str = "auto"  # "auto": CUDA when present
    seed: int = 0

    def __post_init__(self):
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"predictor ranks must be >= 1, got {self.ranks}")
        if not 0.0 < self.recall <= 1.0:
            raise ValueError(f"--recall must be in (0, 1], got {self.recall}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        self.ranks = tuple(sorted(set(self.ranks)))


@dataclass
class LayerSamples:
    """What one layer saw on the dense path: predictor inputs and true firing masks, one row per token."""

    inputs: torch.Tensor  # [N, D] float16
    masks: torch.Tensor  # [N, ceil(F/8)] uint8, bit j of byte k = neuron 8k+j fired
    n_ff: int

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def split(self, n_train: int) -> tuple[LayerSamples, LayerSamples]:
        return (
            LayerSamples(self.inputs[:n_train], self.masks[:n_train], self.n_ff),
            LayerSamples(self.inputs[n_train:], self.masks[n_train:], self.n_ff),
        )


@dataclass
class LayerResult:
    layer: int
    rank: int
    layer_threshold: float  # threshold on the unscaled logits, before folding onto SPARSE_THRESHOLD
    recall: float  # held-out, at the chosen threshold
    precision: float
    selection_ratio: float  # selected / truly firing
    firing_rate: float  # truly firing / all neurons
    pos_weight: float
    tried: list[dict] = field(default_factory=list)  # rank -> figures, every rank trained


# ------------------------------------------------------------------------------------------------
# Masks, packed 8 neurons to a byte (a 300k-token corpus of a 1024-wide layer: 38 MB instead of 300)
# ------------------------------------------------------------------------------------------------

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, F] -> uint8 [N, ceil(F/8)]"""
    n, f = mask.shape
    pad = -f % 8
    if pad:
        mask = F.pad(mask, (0, pad))
    m = mask.view(n, -1, 8).to(torch.uint8) * _BITS.to(mask.device)
    return m.sum(-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, n_ff: int) -> torch.Tensor:
    """uint8 [N, ceil(F/8)] -> bool [N, F]"""
    bits = (packed[..., None] & _BITS.to(packed.device)) != 0
    return bits.flatten(-2)[..., :n_ff]


# ------------------------------------------------------------------------------------------------
# Step 1: the model's own activations
# ------------------------------------------------------------------------------------------------


def collect_samples(
    llm, windows: Sequence[list[int]], layers: Sequence[int], *, progress: bool = False
) -> dict[int, LayerSamples]:
    """Dense forward over the windows; keeps predictor inputs and firing masks of `layers`."""
    check_relu(llm)
    widths = ffn_widths(llm)
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    masks: dict[int, list[torch.Tensor]] = {i: [] for i in layers}

    def observe(i: int, _x: torch.Tensor, p: torch.Tensor, a: torch.Tensor) -> None:
        if i in inputs:
            inputs[i].append(p.detach().to("cpu", torch.float16))
            masks[i].append(pack_mask((a != 0).cpu()))

    run_windows(llm, windows, observe, desc="collecting activations", progress=progress)
    return {i: LayerSamples(torch.cat(inputs[i]), torch.cat(masks[i]), widths[i]) for i in layers}


# ------------------------------------------------------------------------------------------------
# Steps 2-3: one layer
# ------------------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _batches(data: LayerSamples, size: int, order: torch.Tensor | None, device: torch.device):
    n = len(data)
    for s in range(0, n, size):
        idx = order[s : s + size] if order is not None else slice(s, s + size)
        x = data.inputs[idx].to(device, torch.float32, non_blocking=True)
        y = unpack_mask(data.masks[idx].to(device, non_blocking=True), data.n_ff)
        yield x, y


def firing_fraction(data: LayerSamples) -> float:
    ones = sum(int(unpack_mask(data.masks[s : s + 4096], data.n_ff).sum()) for s in range(0, len(data), 4096))
    return ones / (len(data) * data.n_ff)


def train_rank(
    train: LayerSamples,
    rank: int,
    cfg: TrainConfig,
    *,
    scale: float,
    pos_weight: float,
    device: torch.device,
    progress: bool = False,
    desc: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit fc1 [R, D], fc2 [F, R] on inputs divided by `scale`; returns them on the CPU (fc1 still scaled)."""
    gen = torch.Generator().manual_seed((cfg.seed * 1000 + rank) % 2**64)
    d, f = train.inputs.shape[1], train.n_ff
    fc1 = (torch.randn(rank, d, generator=gen) * math.sqrt(2.0 / d)).to(device).requires_grad_()
    fc2 = (torch.randn(f, rank, generator=gen) * math.sqrt(1.0 / rank)).to(device).requires_grad_()
    opt = torch.optim.Adam([fc1, fc2], lr=cfg.lr)
    batch = min(cfg.batch_size, max(32, len(train) // MIN_STEPS_PER_EPOCH))  # small corpora: smaller batches
    steps_per_epoch = math.ceil(len(train) / batch)
    total = cfg.epochs * steps_per_epoch
    warmup = max(1, total // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / total))),
    )
    pw = torch.tensor(pos_weight, device=device)
    with tqdm(total=total, desc=desc, unit="step", leave=False, disable=not progress) as bar:
        for _ in range(cfg.epochs):
            order = torch.randperm(len(train), generator=gen)
            for x, y in _batches(train, batch, order, device):
                logits = F.linear(torch.relu(F.linear(x / scale, fc1)), fc2)  # [B, F]
                loss = F.binary_cross_entropy_with_logits(logits, y.float(), pos_weight=pw)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    return fc1.detach().cpu(), fc2.detach().cpu()


@torch.no_grad()
def evaluate(
    val: LayerSamples, fc1: torch.Tensor, fc2: torch.Tensor, recall: float, device: torch.device
) -> dict[str, float]:
    """The largest threshold whose held-out recall reaches `recall`, with what it selects there.

    fc1 takes the raw input. Recall = selected firing (token, neuron) pairs / firing pairs, over all tokens."""
    fc1, fc2 = fc1.to(device), fc2.to(device)
    chunk = 4096

    def logits_of(x):
        return F.linear(torch.relu(F.linear(x, fc1)), fc2)

    pos_logits = []
    for x, y in _batches(val, chunk, None, device):
        pos_logits.append(logits_of(x)[y].float().cpu())
    pos = torch.cat(pos_logits)
    n_pos = pos.numel()
    threshold = MAX_LAYER_THRESHOLD  # a layer that never fires on the held-out tokens: recall is 1 anyway
    if n_pos:
        misses = min(int(math.floor((1.0 - recall) * n_pos + 1e-9)), n_pos - 1)
        threshold = min(float(torch.kthvalue(pos, misses + 1).values), MAX_LAYER_THRESHOLD)
    selected = hits = 0
    for x, y in _batches(val, chunk, None, device):
        chosen = logits_of(x) >= threshold
        selected += int(chosen.sum())
        hits += int((chosen & y).sum())
    return {
        "threshold": threshold,
        "recall": hits / n_pos if n_pos else 1.0,
        "precision": hits / selected if selected else 1.0,
        "selection_ratio": selected / n_pos if n_pos else float(selected > 0),
    }


def train_layer(
    layer: int,
    samples: LayerSamples,
    n_train: int,
    cfg: TrainConfig,
    *,
    device: torch.device,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], LayerResult]:
    """Train the rank ladder for one layer; returns the state dict to save (fc2 folded onto
    SPARSE_THRESHOLD) and the figures."""
    train, val = samples.split(n_train)
    rate = firing_fraction(train)
    pos_weight = cfg.pos_weight
    if pos_weight is None:
        pos_weight = min(8.0, max(1.0, math.sqrt((1 - rate) / rate))) if rate > 0 else 1.0
    scale = float(train.inputs.float().pow(2).mean().sqrt().clamp_min(1e-6))
    best = None
    tried = []
    for rank in cfg.ranks:
        fc1, fc2 = train_rank(
            train,
            rank,
            cfg,
            scale=scale,
            pos_weight=pos_weight,
            device=device,
            progress=progress,
            desc=f"layer {layer} rank {rank}",
        )
        fc1 = fc1 / scale  # the saved predictor takes the raw input
        figures = evaluate(val, fc1, fc2, cfg.recall, device)
        tried.append({"rank": rank, **{k: round(v, 5) for k, v in figures.items()}})
        log.info(
            "layer %d rank %d: recall %.4f, selection %.3fx, threshold %.3f",
            layer,
            rank,
            figures["recall"],
            figures["selection_ratio"],
            figures["threshold"],
        )
        if best is None or figures["selection_ratio"] < best[2]["selection_ratio"]:
            best = (fc1, fc2, figures, rank)
        if figures["selection_ratio"] <= cfg.max_selection:
            best = (fc1, fc2, figures, rank)
            break
    fc1, fc2, figures, rank = best
    fc2 = fc2 * (abs(SPARSE_THRESHOLD) / abs(figures["threshold"]))  # logit >= t_layer <=> scaled >= -1
    result = LayerResult(
        layer=layer,
        rank=rank,
        layer_threshold=figures["threshold"],
        recall=figures["recall"],
        precision=figures["precision"],
        selection_ratio=figures["selection_ratio"],
        firing_rate=rate,
        pos_weight=pos_weight,
        tried=tried,
    )
    return {"fc1.weight": fc1.contiguous(), "fc2.weight": fc2.contiguous()}, result


# ------------------------------------------------------------------------------------------------
# Step 4: the whole model, resumable
# ------------------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    threshold = config.get("sparse_threshold")
    if threshold is not None and float(threshold) != SPARSE_THRESHOLD:
        raise ValueError(
            f"{path}: the predictors there use sparse_threshold {threshold}, hotcold's trainer {SPARSE_THRESHOLD}; "
            "train into an empty folder"
        )
    return config


def _write_json(data: dict, path: Path, inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    with atomic_output(path, inputs, what="output file") as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")


def train_predictors(
    llm,
    ids: Sequence[int],
    out_dir: str | os.PathLike[str],
    *,
    ctx: int | None = None,
    config: TrainConfig | None = None,
    progress: bool = False,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> dict:
    """Train every layer's predictor that `out_dir` lacks; returns the folder's config.json content.

    `llm`: a hotcold Model loaded with dense=True; `ids`: corpus tokens (placement.profile.corpus_tokens);
    `inputs`: files the caller read (corpus, checkpoint), never overwritten (nor is the model file)."""
    cfg = config or TrainConfig()
    out_dir = Path(out_dir)
    inputs = [llm.path, *inputs]
    check_directory(out_dir, inputs, owns=is_predictor_file, what="predictor folder")  # before the slow part
    config_path = out_dir / "config.json"
    saved = _read_config(config_path)
    n_layer = llm.config.n_layer
    pending = [i for i in range(n_layer) if not (out_dir / f"model_{i}.pt").exists()]
    if len(pending) < n_layer and saved.get("sparse_threshold") != SPARSE_THRESHOLD:
        raise ValueError(
            f"{out_dir}: holds predictors that hotcold did not train (config.json lacks sparse_threshold "
            f"{SPARSE_THRESHOLD}); train into an empty folder"
        )
    layer_stats = {int(s["layer"]): s for s in saved.get("layers", [])}
    summary = {
        "sparse_threshold": SPARSE_THRESHOLD,
        "trainer": "hotcold train-predictors",
        "recall_target": cfg.recall,
        "max_selection": cfg.max_selection,
        "ranks_tried": list(cfg.ranks),
        "epochs": cfg.epochs,
        "layers": [],
    }
    if pending:
        check_relu(llm)
        ctx = window_ctx(ctx, llm.config.n_ctx_train)
        windows = token_windows(ids, ctx, llm.tokenizer.bos_id)
        n_tokens = sum(len(w) for w in windows)
        if len(windows) < 2:
            raise ValueError(
                f"the corpus gives {len(windows)} window of {ctx} tokens ({n_tokens} tokens): too few to hold "
                "some out for validation; use a longer corpus or a smaller -c"
            )
        # every k-th window is held out, so validation covers the whole corpus; training windows come first
        k = max(2, round(1 / cfg.val_fraction))
        held_out = set(range(k - 1, len(windows), k)) or {len(windows) - 1}
        train_windows = [w for j, w in enumerate(windows) if j not in held_out]
        windows = train_windows + [windows[j] for j in sorted(held_out)]
        n_train = sum(len(w) for w in train_windows)
        device = _device(cfg.device)
        log.info(
            "training %d layer(s) on %s: %d tokens, %d held out",
            len(pending),
            device,
            n_train,
            n_tokens - n_train,
        )
        samples = collect_samples(llm, windows, pending, progress=progress)
        summary.update(ctx=ctx, train_tokens=n_train, val_tokens=n_tokens - n_train, device=str(device))
    with atomic_directory(out_dir, inputs, owns=is_predictor_file, what="predictor folder") as staging:
        for i in range(n_layer):  # the layers the folder holds go into the new set as they are
            if i not in pending:
                _carry(out_dir / f"model_{i}.pt", staging / f"model_{i}.pt")
        for i in tqdm(pending, desc="training predictors", unit="layer", disable=not progress):
            state, result = train_layer(i, samples.pop(i), n_train, cfg, device=device, progress=progress)
            save_tensor(state, staging / f"model_{i}.pt", inputs)
            layer_stats[i] = _rounded(asdict(result))
        summary["layers"] = [layer_stats[k] for k in sorted(layer_stats)]
        merged = {**saved, **summary}
        _write_json(merged, staging / "config.json", inputs)
    return merged


PREDICTOR_FILE = re.compile(r"model_\d+\.pt|config\.json")


def is_predictor_file(name: str) -> bool:
    """An entry a predictor folder may hold (the set train_predictors replaces as a whole)."""
    return PREDICTOR_FILE.fullmatch(name) is not None


def _carry(old: Path, new: Path) -> None:
    """A file of the old set into the new one: a hard link (no copy; the old folder goes as a whole), else a copy."""
    try:
        os.link(old, new)
    except OSError:
        shutil.copy2(old, new)


def _rounded(d: dict) -> dict:
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in d.items()}
