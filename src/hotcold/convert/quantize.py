"""Requantize a GGUF / PowerInfer file: `hotcold quantize IN OUT TYPE`.

Every matrix (2-D `*.weight`, predictors included) takes the target type; 1-D tensors stay F32; the
magic, keys and tensor order are kept, `general.file_type` and `general.quantization_version` updated,
as PowerInfer's `quantize` does. Rows that a block format cannot divide stay F16.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm import tqdm

from hotcold import quants
from hotcold.atomic import check_output
from hotcold.convert import FILE_TYPES, OUTTYPES, encode, tensor_type
from hotcold.gguf_io import ModelFile, TensorEntry, TensorSpec, as_torch, metadata_items, write_model_file
from hotcold.kernels import cpu


def _source_floats(entry: TensorEntry) -> torch.Tensor:
    value = as_torch(entry)
    if isinstance(value, quants.QuantTensor):  # the C kernels when built (same bits as value.dequantize())
        return cpu.dequantize_rows(value).reshape(entry.shape)
    return value.float()


def quantize_file(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], outtype: str, *, progress: bool = False
) -> Path:
    outtype = outtype.lower()
    if outtype not in OUTTYPES:
        raise ValueError(f"quantize: type {outtype!r} is not one of {', '.join(OUTTYPES)}")
    src, dst = Path(src), Path(dst)
    check_output(dst, [src], what="quantize: output")
    mf = ModelFile(src)
    specs = []
    for entry in mf.tensors.values():
        is_matrix = len(entry.shape) >= 2 and entry.name.endswith(".weight")
        if not is_matrix or entry.qtype in (Q.I8, Q.I16, Q.I32):
            specs.append(TensorSpec(entry.name, entry.shape, entry.qtype, lambda e=entry: e.data))
            continue
        qtype = tensor_type(entry.name, entry.shape, outtype)
        if qtype == entry.qtype:  # already in the target type: copy the bytes
            specs.append(TensorSpec(entry.name, entry.shape, qtype, lambda e=entry: np.asarray(e.data)))
        else:
            specs.append(
                TensorSpec(
                    entry.name, entry.shape, qtype, lambda e=entry, q=qtype: encode(_source_floats(e), q)
                )
            )
    meta = [
        m for m in metadata_items(mf) if m[0] not in ("general.file_type", "general.quantization_version")
    ]
    meta.append(("general.file_type", FILE_TYPES[outtype], V.UINT32))
    if outtype in ("q8_0", "q4_0"):
        meta.append(("general.quantization_version", 2, V.UINT32))

    def bar(items):
        return tqdm(items, desc=f"quantizing -> {dst.name}", unit="tensor") if progress else items

    return write_model_file(
        dst, mf.architecture, meta, specs, sparse=mf.is_sparse, progress=bar, inputs=[src]
    )
