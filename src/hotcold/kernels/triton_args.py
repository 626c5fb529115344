"""Argument checks for the Triton kernels (kernels/triton.py): qtype names, activation and output tensors.
Plain torch, so they import without Triton."""

from __future__ import annotations

import torch

# ggml block formats: (bytes per block, values per block); the kernels hard-code these layouts.
QTYPES = {"q8_0": (34, 32), "q4_0": (18, 32)}
_FLOAT_NAMES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}  # qtype= for float tensors


def _qtype_name(qtype, who: str) -> str | None:
    """None, a name ("q4_0", "F16", ...), a gguf.GGMLQuantizationType or its number -> lower-case name."""
    if qtype is None:
        return None
    if isinstance(qtype, str):
        name = qtype.lower()
    else:
        import gguf

        try:
            name = gguf.GGMLQuantizationType(qtype).name.lower()
        except ValueError:
            name = repr(qtype)
    if name not in QTYPES and name not in _FLOAT_NAMES:
        raise ValueError(
            f"{who}: unsupported qtype {qtype!r}; supported: None, {', '.join([*_FLOAT_NAMES, *QTYPES])}"
        )
    return name


def _activations(v, mask, w, width: int, k: int, who: str, vname: str):
    """(v as fp32, mask as bool), both with unit column stride, after checking shapes and devices."""
    if v.ndim != 2 or v.shape[1] != width:
        raise ValueError(f"{who}: {vname} must be [T, {width}], got shape {tuple(v.shape)}")
    if mask.shape != (v.shape[0], k):
        raise ValueError(
            f"{who}: mask_hot must be [T, K] = [{v.shape[0]}, {k}], got shape {tuple(mask.shape)}"
        )
    if v.device != w.device or mask.device != w.device:
        raise ValueError(f"{who}: weights on {w.device}, {vname} on {v.device}, mask_hot on {mask.device}")
    v = v.to(torch.float32)
    if v.shape[1] > 1 and v.stride(1) != 1:
        v = v.contiguous()
    mask = mask if mask.dtype == torch.bool else mask != 0
    if mask.shape[1] > 1 and mask.stride(1) != 1:
        mask = mask.contiguous()
    return v, mask


def _out(out, shape, device, who):
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if (
        tuple(out.shape) != shape
        or out.dtype != torch.float32
        or out.device != device
        or not out.is_contiguous()
    ):
        raise ValueError(f"{who}: out must be a contiguous float32 {list(shape)} tensor on {device}")
    return out
