"""Architecture string (GGUF `general.architecture`) -> model family module."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# architecture -> module under hotcold.models; variants share their family's file
ARCHITECTURES = {
    "llama": "llama",
    "bamboo": "llama",
    "mistral": "llama",
    "falcon": "falcon",
    "opt": "opt",
    "mixtral": "mixtral",
}


def supported() -> list[str]:
    available = []
    for arch, module in ARCHITECTURES.items():
        if importlib.util.find_spec(f"hotcold.models.{module}") is not None:
            available.append(arch)
    return available


def model_module(arch: str, source: str = "model") -> ModuleType:
    module = ARCHITECTURES.get(arch)
    if module is None or importlib.util.find_spec(f"hotcold.models.{module}") is None:
        raise ValueError(f"{source}: unknown architecture {arch!r}; supported: {', '.join(supported())}")
    return importlib.import_module(f"hotcold.models.{module}")
