"""The one device policy: where each tensor of a model lives and in which dtype.

`DevicePlan` says, per layer, where attention (with its KV cache), the predictor and the full FFN matrices
live, where the output head lives, and which FFN neurons have a hot copy on the fast device. The loader
makes the plan (from the VRAM budget, or -ngl for dense files) before anything is built; the tensor source
hands every tensor out through `place`, the KV cache asks `kv_dtype`, and the budget walk asks
`placed_nbytes`, so the three can never disagree.

The rules:
- on a GPU, dense matmuls run on fp16 copies of block-quantized matrices (no GPU block kernels for dense
  matmuls yet); float matrices keep their dtype; vectors (norms, biases) are float32 everywhere;
- the KV cache is fp16 on a GPU and float32 on the CPU (the CPU's C attention reads float32), per layer;
- hot FFN rows keep their file format on the fast device (the Triton kernels read the blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.quants import QuantTensor

CPU = torch.device("cpu")
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")


def place(weight, device: torch.device):
    """`weight` (a tensor or QuantTensor, or None) as it lives on `device`."""
    if weight is None:
        return None
    if isinstance(weight, QuantTensor):
        if device.type == "cuda":
            from hotcold.kernels import cpu

            return cpu.dequantize_rows(weight).half().to(device)
        return weight.to(device)
    return weight.to(device)


def place_vector(vector: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Norm weights, biases: float32 on any device."""
    return None if vector is None else vector.float().to(device)


def kv_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def placed_nbytes(qtype_name: str, shape: tuple[int, ...], file_bytes: int, device_type: str) -> int:
    """Bytes a file tensor takes once `place`d on a device of `device_type`."""
    blocks = qtype_name not in FLOAT_TYPE_NAMES and len(shape) >= 2
    return 2 * math.prod(shape) if device_type == "cuda" and blocks else file_bytes


@dataclass(frozen=True)
class DevicePlan:
    attention: tuple[torch.device, ...]  # per layer: attention matrices, norms, KV cache
    predictor: tuple[torch.device, ...]  # per layer: the predictor MLP
    ffn: tuple[torch.device, ...]  # per layer: the full FFN matrices (the CPU unless -ngl offloads them)
    output: torch.device = CPU  # output norm and head
    fast: torch.device | None = None  # where hot FFN rows are copied
    hot: tuple[np.ndarray, ...] | None = None  # per layer: sorted hot neuron ids (None: no hybrid split)

    @classmethod
    def cpu_only(cls, n_layer: int) -> DevicePlan:
        return cls((CPU,) * n_layer, (CPU,) * n_layer, (CPU,) * n_layer)

    @property
    def n_layer(self) -> int:
        return len(self.attention)

    def hot_rows(self, layer: int) -> np.ndarray | None:
        """Layer's hot neurons when it has any on the fast device, else None (the CPU computes them all)."""
        if self.hot is None or self.fast is None or len(self.hot[layer]) == 0:
            return None
        return self.hot[layer]

    def kv_dtypes(self) -> list[torch.dtype]:
        return [kv_dtype(d) for d in self.attention]
