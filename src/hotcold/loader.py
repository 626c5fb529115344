"""Open a model file and build the model for the chosen devices: the one place (with placement/ and
sparse/hybrid.py) that knows what lives where."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from hotcold import registry
from hotcold.config import ModelConfig, config_from_file
from hotcold.gguf_io import ModelFile
from hotcold.sparse.ffn import FFNFactory
from hotcold.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo.powerinfer.gguf"


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
    notes: list[str] = field(default_factory=list)  # what went where, for `info` and the load line


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
    path: str | os.PathLike[str] | None = None,
    *,
    dense: bool = False,
    threads: int | None = None,
    device: str = "auto",
    vram_budget: float | None = None,
) -> LoadedModel:
    path = Path(path) if path is not None else demo_model_path()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    device = resolve_device(device)
    model_file = ModelFile(path)
    module = registry.model_module(model_file.architecture, str(path))
    config = config_from_file(model_file)
    tokenizer = Tokenizer.from_metadata(model_file.metadata, source=str(path))
    notes = []
    if vram_budget is not None and vram_budget > 0 and device == "cpu":
        notes.append(f"--vram-budget {vram_budget} GiB ignored: running on the CPU (no CUDA GPU in use)")
    factory = FFNFactory(dense=dense or not config.sparse, threads=threads)
    model = module.build(model_file, config, factory)
    mode = "dense" if factory.dense else "sparse"
    notes.append(
        f"{config.arch} {mode} on {device}: {config.n_layer} layers, n_embd {config.n_embd}, n_ff {config.n_ff}"
    )
    return LoadedModel(model, tokenizer, config, model_file, device, factory.dense, notes)
