"""Reading Hugging Face checkpoints and PowerInfer predictor folders, lazily (one tensor at a time)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message names the file and the problem."""


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: not a folder (expected a Hugging Face checkpoint folder)")
    if not path.exists():
        raise ConvertError(f"{path}: missing (every Hugging Face checkpoint has a config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc})") from exc


def rope_theta(config: dict[str, Any]) -> float | None:
    """transformers 5.x writes rope_theta inside rope_parameters, older versions at the top level."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return None


def rope_scaling_params(config: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(rope type, its parameters) from rope_scaling (transformers 4) or rope_parameters (5)."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling.get("rope_type") or scaling.get("type"), scaling


def rope_scaling(config: dict[str, Any], *, llama3: bool = False) -> tuple[str, float] | None:
    """("linear", factor) for linear RoPE scaling, None for none (or, with llama3, for Llama 3.1's, which
    `llama3_rope_factors` writes as a tensor); anything else is refused, named."""
    kind, scaling = rope_scaling_params(config)
    if kind in (None, "default") or (llama3 and kind == "llama3"):
        return None
    if kind != "linear":
        supported = "linear, llama3" if llama3 else "linear"
        raise ConvertError(f"rope scaling {kind!r} is not supported (only {supported})")
    return "linear", float(scaling["factor"])


def llama3_rope_factors(config: dict[str, Any], head_dim: int) -> torch.Tensor | None:
    """Llama 3.1's RoPE scaling as per-dimension divisors of the rotation frequencies, [head_dim / 2] float32, as
    upstream llama.cpp's converter writes them (`rope_freqs.weight`): 1 for wavelengths under
    original_max_position_embeddings / high_freq_factor, `factor` above it / low_freq_factor, a smooth blend
    between (transformers' llama3 rope: inv_freq / f). None without llama3 scaling."""
    kind, s = rope_scaling_params(config)
    if kind != "llama3":
        return None
    try:
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"config.json: llama3 rope scaling lacks or mangles {exc}") from None
    if not (factor > 0 and old_ctx > 0 and high > low > 0):
        raise ConvertError(
            f"config.json: llama3 rope scaling {s} (need factor > 0, high_freq_factor > low_freq_factor > 0)"
        )
    base = rope_theta(config) or 10000.0
    # in float32 throughout, as upstream computes them, so the tensor has upstream's bits
    freqs = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    one, full = torch.ones_like(freqs), torch.full_like(freqs, factor)
    return torch.where(wavelen < old_ctx / high, one, torch.where(wavelen > old_ctx / low, full, blended))


@dataclass(frozen=True)
class Encoded:
    """A tensor a converter hands over in its GGUF bytes (a `load` of a family's plan may return one): written as
    it is, whatever --outtype says (gpt-oss's MXFP4 experts, repacked from the checkpoint's blocks). The bytes are
    made when the writer gets to the tensor, once."""

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # in values, numpy order
    produce: Callable[[], np.ndarray]  # -> uint8, the tensor's bytes


class Checkpoint:
    """Tensor names -> lazy loaders over safetensors (sharded or not) or pytorch .bin files."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        self._loaders: dict[str, Callable[[], torch.Tensor]] = {}
        files = sorted(hf_dir.glob("*.safetensors"))
        if files:
            from safetensors import safe_open

            for file in files:
                try:
                    handle = safe_open(str(file), "pt")
                    keys = list(handle.keys())  # noqa: SIM118 (safe_open is not a dict)
                except Exception as exc:  # SafetensorError, OSError: a torn or foreign file, named
                    raise unreadable(file, exc) from exc
                for name in keys:
                    self._loaders[name] = lambda h=handle, n=name, f=file: _read(f, n, h.get_tensor)
        else:
            bins = sorted(hf_dir.glob("pytorch_model*.bin")) or sorted(hf_dir.glob("*.bin"))
            if not bins:
                raise ConvertError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights found")
            for file in bins:
                try:
                    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                except Exception as exc:  # a torn pickle or zip, not a state dict: named, no traceback
                    raise unreadable(file, exc) from exc
                if not isinstance(state, dict):
                    raise ConvertError(
                        f"{file}: not a state dict of tensors (holds a {type(state).__name__})"
                    )
                for name, tensor in state.items():
                    self._loaders[name] = lambda t=tensor: t

    def names(self) -> list[str]:
        return list(self._loaders)

    def __contains__(self, name: str) -> bool:
        return name in self._loaders

    def get(self, name: str) -> torch.Tensor:
        loader = self._loaders.get(name)
        if loader is None:
            raise ConvertError(f"{self.dir}: checkpoint has no tensor {name}")
        return loader()


def _cause(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def unreadable(file: Path, exc: BaseException) -> ConvertError:
    """A weights file that cannot be read: one line naming the file and the cause."""
    return ConvertError(f"{file}: cannot be read as a weights file, torn or corrupt? ({_cause(exc)})")


def _read(file: Path, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    try:
        return get(name)
    except Exception as exc:  # the header parsed, the tensor's bytes did not
        raise ConvertError(f"{file}: tensor {name} cannot be read, torn or corrupt? ({_cause(exc)})") from exc


PREDICTOR_FILE = re.compile(r"model_(\d+)\.pt$")


def read_predictors(
    pred_dir: Path, n_layer: int, n_embd: int, n_ff: int
) -> tuple[list[dict[str, torch.Tensor]], float | None]:
    """PowerInfer predictor folder: model_{i}.pt (state dicts with fc1.weight [R, D], fc2.weight [F, R]) for
    every layer, optional config.json with sparse_threshold. Returns the per-layer tensors and the threshold."""
    if not pred_dir.is_dir():
        raise ConvertError(f"{pred_dir}: predictor folder not found")
    found = {int(m.group(1)) for p in pred_dir.iterdir() if (m := PREDICTOR_FILE.match(p.name))}
    missing = [i for i in range(n_layer) if i not in found]
    if missing:
        raise ConvertError(
            f"{pred_dir}: missing predictor files for layers {missing} (expected model_0.pt .. model_{n_layer - 1}.pt)"
        )
    layers = []
    for i in range(n_layer):
        path = pred_dir / f"model_{i}.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConvertError(f"{path}: cannot be read as a torch state dict ({exc})") from exc
        fc1, fc2 = state.get("fc1.weight"), state.get("fc2.weight")
        if fc1 is None or fc2 is None:
            raise ConvertError(f"{path}: needs fc1.weight and fc2.weight, has {sorted(state)}")
        extra = sorted(set(state) - {"fc1.weight", "fc2.weight"})
        if extra:
            raise ConvertError(f"{path}: unexpected tensors {extra} (PowerInfer predictors have no biases)")
        rank = fc1.shape[0]
        if tuple(fc1.shape) != (rank, n_embd) or tuple(fc2.shape) != (n_ff, rank):
            raise ConvertError(
                f"{path}: fc1.weight {tuple(fc1.shape)} / fc2.weight {tuple(fc2.shape)}, expected ({rank}, {n_embd}) / ({n_ff}, {rank})"
            )
        layers.append({"fc1.weight": fc1, "fc2.weight": fc2})
    threshold = None
    config_path = pred_dir / "config.json"
    if config_path.exists():
        try:
            pred_config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{config_path}: not valid JSON ({exc})") from exc
        if "sparse_threshold" in pred_config:
            threshold = float(pred_config["sparse_threshold"])
    return layers, threshold


def to_numpy_f32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).contiguous().numpy()
