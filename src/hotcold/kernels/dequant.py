"""Float copies of CPU weights: `dequantize_rows` (C when built, bit-exact as ggml's dequantization,
else `QuantTensor.dequantize`) and `dense_rows`, the torch fallbacks' float32 rows; `torch_gather` and
`torch_axpy`, the row kernels in torch (cpu's fallback without the C library)."""

from __future__ import annotations

import torch

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import build
from hotcold.kernels.build import WT as _WT
from hotcold.kernels.build import f32_contiguous, nthreads, ptr, weight_view

Weight = torch.Tensor | QuantTensor


def dense_rows(weight: Weight, idx: torch.Tensor | None) -> torch.Tensor:
    """float32 rows of a weight (all rows when idx is None): the torch fallback's copy."""
    if isinstance(weight, QuantTensor):
        return weight.dequantize(idx)
    w = weight if idx is None else weight.index_select(0, idx)
    return w.to(torch.float32)


def dequantize_rows(
    weight: Weight,
    start: int = 0,
    stop: int | None = None,
    *,
    index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """float32 copy [n, D] of rows [start, stop) of a CPU weight (all rows by default), or of the rows in
    `index` (1-D integer tensor, or bool mask [F]), bit-exact as ggml's dequantization: the fast path for
    a whole QuantTensor is `dequantize_rows(qt)`. C when loaded, else `QuantTensor.dequantize`."""
    qtype, data, stride, f, d = weight_view(weight)
    idx = None
    if index is not None:
        if start != 0 or stop is not None:
            raise ValueError("give either a row range or an index, not both")
        idx = index.cpu().reshape(-1)
        if idx.dtype == torch.bool and idx.numel() != f:
            raise ValueError(f"a bool row mask has {idx.numel()} entries for a weight of {f} rows")
        idx = idx.nonzero().squeeze(1) if idx.dtype == torch.bool else idx.long()
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < f):
            raise ValueError(f"row index out of range for a weight of {f} rows")
        n = idx.numel()
    else:
        stop = f if stop is None else stop
        if not 0 <= start <= stop <= f:
            raise ValueError(f"rows [{start}, {stop}) are not within the weight's {f} rows")
        n = stop - start
    if out is None:
        out = torch.empty(n, d, dtype=torch.float32)
    elif out.shape != (n, d) or not f32_contiguous(out):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape [{n}, {d}]")
    lib = build.get_lib()
    if lib is None:
        if idx is None and (start, stop) != (0, f):
            idx = torch.arange(start, stop)
        return out.copy_(dense_rows(weight, idx))
    base = data.data_ptr() + start * stride if idx is None and n else data.data_ptr()
    rows = None if idx is None else idx.to(torch.int32).contiguous()
    lib.hc_dequantize(_WT[qtype], base, stride, ptr(rows), n, d, out.data_ptr(), nthreads(threads))
    return out


def torch_gather(weight: Weight, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """gather_matvec in torch: x [T, D] @ the rows of mask (all with None), 0 elsewhere -> [T, F]."""
    if mask is None:
        return x @ dense_rows(weight, None).T
    idx = mask.any(0).nonzero().squeeze(1)
    out = torch.zeros(x.shape[0], mask.shape[1], dtype=torch.float32)
    if idx.numel():
        part = x @ dense_rows(weight, idx).T  # [T, n]
        out[:, idx] = torch.where(mask[:, idx], part, torch.zeros(()))
    return out


def torch_axpy(weight_t: Weight, a: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sparse_axpy in torch: out[t] = sum of a[t, i] * row i over the rows i active for token t (a[t, i] != 0
    and in mask)."""
    active = a != 0
    if mask is not None:
        active &= mask
    idx = active.any(0).nonzero().squeeze(1)
    out = torch.zeros(a.shape[0], weight_t.shape[1], dtype=torch.float32)
    if idx.numel():
        coef = torch.where(active[:, idx], a[:, idx], torch.zeros(()))  # [T, n]
        out += coef @ dense_rows(weight_t, idx)
    return out
