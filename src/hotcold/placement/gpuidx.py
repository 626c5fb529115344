"""The placement cache `<model path>.generated.gpuidx`, in the original's layout.

Written beside the model, as PowerInfer does, unless the model sits inside the installed hotcold package (the
bundled demo model) or in a folder that cannot be written: then in the user cache (user_cache_dir:
~/.cache/hotcold/gpuidx by default), under the model's name and a digest of its path. The loader looks in both.

A `PWRI`-magic GGUF with arch `generic.gpu_index`, keys `generic.gpu_index.block_count` (u32) and
`split.vram_capacity` (u64), and per layer, in numeric layer order, `blk.{i}.gpu_idx` (I32 [n_ff], 1 = on
the GPU) then `blk.{i}.gpu_bucket` (I32 [k], the sorted GPU neuron ids). Integer tensors carry PowerInfer's
type number 18 so the original reads our files. We add keys recording what the placement was solved
from (model file size and mtime, a digest of the activation files), so a changed model or new
statistics trigger a new solve; the original ignores unknown keys.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile, TensorSpec, write_model_file
from hotcold.placement.user_cache import cache_name, cache_root, writes_beside

if TYPE_CHECKING:
    from hotcold.config import ModelConfig
    from hotcold.placement.budget import BudgetPlan

ARCH = names.GPU_INDEX_ARCH


SUFFIX = ".generated.gpuidx"


def beside_path(model_path: str | os.PathLike[str]) -> Path:
    """`<model path>.generated.gpuidx`: where PowerInfer reads and writes the cache."""
    return Path(str(model_path) + SUFFIX)


def user_cache_dir() -> Path:
    """Where placement caches go when the model's folder cannot take one: gpuidx/ in hotcold's cache folder."""
    return cache_root() / "gpuidx"


def cached_path(model_path: str | os.PathLike[str]) -> Path:
    """The user-cache file for one model."""
    return user_cache_dir() / f"{cache_name(model_path)}{SUFFIX}"


def gpuidx_path(model_path: str | os.PathLike[str]) -> Path:
    """Where a model's placement cache is written: beside the model, else in the user cache (writes_beside)."""
    return beside_path(model_path) if writes_beside(model_path) else cached_path(model_path)


def gpuidx_candidates(model_path: str | os.PathLike[str]) -> list[Path]:
    """Where a model's placement cache is looked for, in order: beside the model (PowerInfer's own, or one
    hotcold wrote there), then the user cache."""
    return [beside_path(model_path), cached_path(model_path)]


def model_inputs(model_path: str | os.PathLike[str]) -> list[Path]:
    """What a model's placement cache is solved from: the model file and the activation files beside it."""
    from hotcold.placement.profile import default_activation_dir

    model = Path(model_path)
    activation_dir = default_activation_dir(model)
    found = sorted(activation_dir.glob("activation_*.pt")) if activation_dir.is_dir() else []
    return [model, *found]


def placement_inputs(path: str | os.PathLike[str]) -> list[Path]:
    """What a placement cache beside its model is solved from (model_inputs of the model its name names)."""
    path = Path(path)
    if not path.name.endswith(SUFFIX):
        return []
    return model_inputs(path.with_name(path.name[: -len(SUFFIX)]))


@dataclass(frozen=True)
class Placement:
    hot: list[np.ndarray]  # per layer: sorted int64 neuron ids placed on the GPU
    n_ff: list[int]
    vram_capacity: int  # bytes the solver was given for hot neurons
    source: dict[str, str]  # what it was solved from (for cache validity)

    @property
    def n_layer(self) -> int:
        return len(self.hot)

    def hot_fraction(self) -> float:
        total = sum(self.n_ff)
        return sum(len(h) for h in self.hot) / total if total else 0.0


def source_signature(model_path: Path, activation_dir: Path | None) -> dict[str, str]:
    """Size + mtime of the model file and a digest of the activation files' bytes."""
    stat = model_path.stat()
    digest = hashlib.sha256()
    if activation_dir is not None and activation_dir.is_dir():
        for path in sorted(activation_dir.glob("activation_*.pt"), key=lambda p: p.name):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return {
        names.MODEL_SIZE: str(stat.st_size),
        names.MODEL_MTIME_NS: str(stat.st_mtime_ns),
        names.ACTIVATION_SHA256: digest.hexdigest(),
    }


def write_gpuidx(
    path: str | os.PathLike[str], placement: Placement, inputs: list[str | os.PathLike[str]] | None = None
) -> Path:
    """Write the cache atomically; `inputs` (default: placement_inputs(path)) may not be overwritten."""
    meta = [
        (names.key(names.BLOCK_COUNT, ARCH), placement.n_layer, V.UINT32),
        (names.VRAM_CAPACITY, int(placement.vram_capacity), V.UINT64),
        *[(k, v, V.STRING) for k, v in placement.source.items()],
    ]
    specs = []
    for i, (hot, n_ff) in enumerate(zip(placement.hot, placement.n_ff, strict=True)):
        gpu_idx = np.zeros(n_ff, dtype=np.int32)
        gpu_idx[hot] = 1
        bucket = np.sort(hot).astype(np.int32)
        specs.append(TensorSpec(names.bare(names.GPU_IDX, i), (n_ff,), Q.I32, lambda a=gpu_idx: a))
        specs.append(TensorSpec(names.bare(names.GPU_BUCKET, i), (len(bucket),), Q.I32, lambda a=bucket: a))
    inputs = placement_inputs(path) if inputs is None else inputs
    return write_model_file(path, ARCH, meta, specs, sparse=True, inputs=inputs)


def read_gpuidx(path: str | os.PathLike[str]) -> Placement:
    mf = ModelFile(path)
    if mf.metadata.get(names.ARCHITECTURE) != ARCH:
        raise GGUFError(
            f"{path}: not a GPU index file ({names.ARCHITECTURE} is {mf.metadata.get(names.ARCHITECTURE)!r})"
        )
    if names.VRAM_CAPACITY not in mf.metadata:
        raise GGUFError(f"{path}: missing metadata key {names.VRAM_CAPACITY}")
    entries = list(mf.tensors.values())
    if len(entries) % 2:
        raise GGUFError(f"{path}: {len(entries)} tensors, expected gpu_idx/gpu_bucket pairs")
    hot, n_ff = [], []
    # by position, as the original reads them: tensor 2i is layer i's gpu_idx, 2i+1 its bucket
    for i in range(len(entries) // 2):
        idx = np.asarray(entries[2 * i].data).astype(np.int64)
        bucket = np.asarray(entries[2 * i + 1].data).astype(np.int64)
        if not np.array_equal(np.flatnonzero(idx), np.sort(bucket)):
            raise GGUFError(f"{path}: layer {i}: gpu_bucket does not list the neurons gpu_idx marks")
        hot.append(np.sort(bucket))
        n_ff.append(len(idx))
    source = {k: v for k, v in mf.metadata.items() if k.startswith(names.HOTCOLD_PREFIX)}
    return Placement(hot, n_ff, int(mf.metadata[names.VRAM_CAPACITY]), source)


def resolve_placement(
    path: Path,
    model_file: ModelFile,
    config: ModelConfig,
    plan: BudgetPlan,
    reset: bool,
    notes: list[str],
    *,
    strict: bool = False,
) -> list[np.ndarray] | None:
    """The hot neurons per layer: from a `.generated.gpuidx` cache (gpuidx_candidates: beside the model, then in
    the user cache) solved for this budget, model file and statistics, else solved anew from
    `<model dir>/activation/` and cached. strict: a cache that cannot be written raises (hotcold place, whose
    job it is), instead of a note."""
    from hotcold.placement.profile import default_activation_dir, read_activation_files
    from hotcold.placement.solver import solve_placement

    activation_dir = default_activation_dir(path)
    signature = source_signature(path, activation_dir)
    n_ff = [config.n_ff] * config.n_layer
    if not reset:
        stale = False
        for found in (c for c in gpuidx_candidates(path) if c.exists()):
            try:
                cached = read_gpuidx(found)
            except GGUFError as exc:
                notes.append(f"ignoring unreadable placement cache ({exc}): solving again")
                continue
            if cached.vram_capacity == plan.hot_bytes and cached.source == signature and cached.n_ff == n_ff:
                notes.append(
                    f"placement from {found.name}: {100 * cached.hot_fraction():.1f}% of FFN neurons hot"
                )
                return cached.hot
            stale = True
        if stale:
            notes.append(
                f"{gpuidx_path(path).name} was solved for another budget, model or statistics: solving again"
            )
    if plan.hot_bytes <= 0:
        notes.append("no VRAM left for hot FFN neurons: every FFN neuron runs on the CPU")
        return None
    # an MoE model's statistics count each expert's routings (placement/profile.py), not neurons
    counts = None if config.n_expert else read_activation_files(activation_dir, config.n_layer, config.n_ff)
    activations = None if counts is None else [c.float() for c in counts]
    if activations is None:
        notes.append(
            f"no activation statistics in {activation_dir}: cannot choose hot neurons, every FFN neuron runs on the "
            f"CPU. Run `hotcold profile -m {path} -f corpus.txt` to create them."
        )
        return None
    hot = solve_placement(activations, plan.hot_bytes, plan.bytes_per_neuron)
    placement = Placement(hot, n_ff, plan.hot_bytes, signature)
    cache = gpuidx_path(path)
    try:
        write_gpuidx(cache, placement, model_inputs(path))
        if cache.parent != path.parent:
            notes.append(
                f"placement cache written to {cache} (the model's folder is the installed package or read-only)"
            )
    except OSError as exc:
        if strict:
            raise
        notes.append(
            f"could not write the placement cache {cache} ({exc}); using the placement without caching it"
        )
    notes.append(f"placement solved: {100 * placement.hot_fraction():.1f}% of FFN neurons hot")
    return hot
