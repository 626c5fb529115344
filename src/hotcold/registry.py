"""Architecture string (GGUF `general.architecture`) -> model family module.

One table: each architecture and its variants name the family file that runs them (as mlx-lm's
`MODEL_REMAPPING`); a file of arch `llama` with experts is Mixtral, as upstream llama.cpp writes it."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# architecture -> module under hotcold.models; variants share their family's file
ARCHITECTURES = {
    "llama": "llama",
    "bamboo": "llama",
    "mistral": "llama",
    "qwen2": "llama",  # Qwen2 / Qwen2.5: q/k/v biases, NeoX RoPE (the layer description says so)
    "qwen3": "llama",  # Qwen3: per-head q/k RMS norms, NeoX RoPE, a head size of its own
    "gemma2": "llama",  # Gemma 2: sandwich norms, GELU-tanh, alternating local / global layers, soft-capping
    "gemma3": "llama",  # Gemma 3 (text): sandwich norms, GELU-tanh, q/k norms, local and global layers
    "phi3": "llama",  # Phi-3 / Phi-4-mini: fused attn_qkv and ffn_up (split at load), NeoX RoPE, partial rotary
    "falcon": "falcon",
    "opt": "opt",
    "mixtral": "mixtral",
    "qwen3moe": "mixtral",  # Qwen3-MoE: Qwen3's attention, softmax top-k experts renormalised (Mixtral's router)
    "gpt-oss": "gpt_oss",  # gpt-oss: sinks, sliding/global layers, YaRN, biases, clamped-SwiGLU experts (MXFP4)
    "smallthinker": "smallthinker",  # SmallThinker: router before attention, sigmoid top-k, ReLU experts, NoPE layers
}


def supported() -> list[str]:
    available = []
    for arch, module in ARCHITECTURES.items():
        if importlib.util.find_spec(f"hotcold.models.{module}") is not None:
            available.append(arch)
    return available


def family(arch: str, n_expert: int = 0) -> str | None:
    """The family module name for an architecture (None: unsupported)."""
    module = ARCHITECTURES.get(arch)
    if module == "llama" and n_expert:  # upstream llama.cpp writes Mixtral as arch llama with experts
        return "mixtral"
    return module


def require(arch: str, source: str = "model") -> None:
    """A clear error, listing what is supported, for an architecture no family runs."""
    module = ARCHITECTURES.get(arch)
    if module is None or importlib.util.find_spec(f"hotcold.models.{module}") is None:
        raise ValueError(f"{source}: unknown architecture {arch!r}; supported: {', '.join(supported())}")


def model_module(config, source: str = "model") -> ModuleType:
    """The family module that builds `config`'s model (`build(src, make_ffn)`)."""
    require(config.arch, source)
    return importlib.import_module(f"hotcold.models.{family(config.arch, config.n_expert)}")
