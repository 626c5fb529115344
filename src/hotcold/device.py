"""The one device policy: where each tensor of a model lives and in which dtype.

`DevicePlan` says, per layer, where attention (with its KV cache), the predictor and the full FFN matrices
live, where the output head lives, and which FFN neurons have a hot copy on the fast device. The loader
makes the plan (from the VRAM budget, or -ngl for dense files) before anything is built; the tensor source
hands every tensor out through `place`, the KV cache asks `kv_dtype`, and the budget walk asks
`placed_nbytes`, so the three can never disagree.

The rules:
- on a GPU, dense matmuls run on fp16 copies of block-quantized matrices (no GPU block kernels for dense
  matmuls yet); float matrices keep their dtype; vectors (norms, biases) are float32 everywhere;
- the KV cache is fp16 on a GPU and float32 on the CPU (the CPU's C attention reads float32), per layer:
  a layer whose attention stays on the CPU keeps a float32 cache whatever the other layers do;
- hot FFN rows keep their file format on the fast device where the Triton kernels read the blocks (Q8_0,
  Q4_0, float types); other block types go over as fp16 rows (sparse/hybrid.py), and a CUDA device also
  holds each hot neuron's int64 id.

Byte counts are Python ints (never int32 arithmetic: PowerInfer overflowed above 2 GiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels.triton_args import QTYPES as HOT_BLOCK_TYPES

CPU = torch.device("cpu")
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """a and b are one device, a missing index meaning the current one: a plan says "cuda", a tensor on it
    says "cuda:0", and torch.device("cuda") != torch.device("cuda", 0)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else 0
        return (current if a.index is None else a.index) == (current if b.index is None else b.index)
    return a.index == b.index


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
    """Bytes a file tensor takes once placed on a device of `device_type`: vectors (norms, biases) as
    float32 (`place_vector`), block-quantized matrices as fp16 on a GPU (`place`), the rest as stored."""
    n = math.prod(int(d) for d in shape)  # Python ints: no fixed-width overflow whatever `shape` holds
    if len(shape) < 2:
        return 4 * n
    blocks = qtype_name not in FLOAT_TYPE_NAMES
    return 2 * n if device_type == "cuda" and blocks else int(file_bytes)


def hot_row_nbytes(qtype_name: str, row_values: int, file_row_bytes: int, device_type: str) -> int:
    """Bytes one hot row of an FFN matrix takes on the fast device (sparse/hybrid.py's `_rows_to`): its file
    format, except block types the Triton kernels cannot read, which go to a GPU as fp16."""
    readable = qtype_name in FLOAT_TYPE_NAMES or qtype_name.lower() in HOT_BLOCK_TYPES
    return int(file_row_bytes) if device_type != "cuda" or readable else 2 * int(row_values)


HOT_INDEX_BYTES = 8  # a CUDA fast device keeps each hot neuron's int64 id (HybridFFN.hot_idx_fast)


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
