"""GGML tensor formats: the one interface that the loader, the kernels and the converters share.

A weight matrix stays in its file bytes (`QuantTensor`, a zero-copy view of the memory-mapped file)
and is only expanded to float32 where something needs floats. `dequantize` is exact: it gives the
same float32 bits as ggml's `dequantize_row_*` (tests compare against `gguf.quants`). `quantize`
gives the same bytes as ggml's reference quantizers (`quantize_row_*_ref`), which is what
PowerInfer's `quantize` tool and `convert.py` write.

This module imports nothing from `hotcold.kernels`: its dequantization is the pure reference (gguf's
numpy code on the CPU, torch ops elsewhere); `hotcold.kernels.cpu.dequantize_rows` is the fast one.

Block layouts (little endian, d is fp16):
  Q8_0  34 bytes / 32 values: d, int8 q[32]                   value = d * q
  Q4_0  18 bytes / 32 values: d, u8 qs[16]                     value = d * (nibble - 8); low nibbles
                                                               are values 0..15, high nibbles 16..31
  Q5_0  22 bytes / 32 values: d, u32 qh, u8 qs[16]             as Q4_0 with bit j of qh as bit 4, - 16
  Q4_1  20 bytes / 32 values: d, m, u8 qs[16]                  value = d * nibble + m
  Q5_1  24 bytes / 32 values: d, m, u32 qh, u8 qs[16]          value = d * q5 + m
  IQ4_NL 18 bytes / 32 values: d, u8 qs[16]                    value = d * kvalues[nibble]
  K-quants, 256 values per super-block in sub-blocks of 16 or 32, each with its own scale:
  Q2_K  84 bytes: u8 scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), d, dmin
  Q3_K 110 bytes: hmask[32] (bit 2), qs[64] (bits 0-1), scales[12] (16 x 6 bits), d
  Q4_K 144 bytes: d, dmin, scales[12] (8 x 6-bit scale and min), qs[128]
  Q5_K 176 bytes: d, dmin, scales[12], qh[32] (bit 4), qs[128]
  Q6_K 210 bytes: ql[128], qh[64], int8 scales[16], d
  IQ4_XS 136 bytes: d, u16 scales_h, u8 scales_l[4], qs[128] (kvalues as IQ4_NL, 8 x 6-bit scales)
  MXFP4 17 bytes / 32 values: u8 e (E8M0), u8 qs[16]           value = 2^(e-128) * MXFP4_VALUES[nibble]
                                                               (E2M1 doubled); low nibbles 0..15, high 16..31
                                                               (gpt-oss's experts)
The C kernels decode each of them 32 values at a time (kernels/_cpu_kernels.c, `load32`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "QuantTensor",
    "SUPPORTED",
    "QUANTIZE_TYPES",
    "dequantize",
    "dequantize_torch",
    "quantize",
    "row_bytes",
    "is_quantized",
]

Q = GGMLQuantizationType
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# readable: everything llama-quantize writes without an importance matrix, plus the IQ4 pair
SUPPORTED = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    | {Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4}
)
# writable: gguf's legacy quantizers (and MXFP4's, ggml's quantize_row_mxfp4_ref), hotcold.gguf.kquants for K-quants
QUANTIZE_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    | {Q.MXFP4}
)
_TORCH_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _qtype(qtype: GGMLQuantizationType | int, readable=SUPPORTED) -> GGMLQuantizationType:
    qtype = GGMLQuantizationType(qtype)
    if qtype not in readable:
        names = ", ".join(sorted(t.name for t in readable))
        raise ValueError(f"tensor type {qtype.name} is not supported (supported: {names})")
    return qtype


def is_quantized(qtype: GGMLQuantizationType | int) -> bool:
    """True for GGML block formats (Q8_0, Q4_0, ...), False for F32, F16 and BF16."""
    return GGMLQuantizationType(qtype) not in FLOAT_TYPES


def block_size(qtype: GGMLQuantizationType | int) -> int:
    """Values per block (1 for float types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def row_bytes(qtype: GGMLQuantizationType | int, cols: int) -> int:
    """Bytes taken by `cols` values of `qtype`; cols must be a multiple of the block size."""
    qtype = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows whose length is a multiple of {block}, got {cols}")
    return cols // block * size


def _as_bytes(raw: np.ndarray | torch.Tensor, nbytes: int) -> torch.Tensor:
    """Any array holding tensor data -> flat uint8 torch tensor (no copy when possible)."""
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # read-only memory maps: we never write through the view
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
    else:
        t = raw.contiguous().reshape(-1).view(torch.uint8)
    if t.numel() != nbytes:
        raise ValueError(f"tensor data holds {t.numel()} bytes, expected {nbytes}")
    return t


def dequantize(
    raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Tensor bytes in ggml layout -> float32 tensor of `shape` (numpy order, last dim contiguous),
    bit-exact with ggml's dequantization (the C kernels' `cpu.dequantize_rows` gives the same bits, faster)."""
    qtype = _qtype(qtype, SUPPORTED)
    shape = tuple(int(s) for s in shape)
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    nb = row_bytes(qtype, cols)
    b = _as_bytes(raw, rows * nb).reshape(rows, nb)  # [R, nb]
    if qtype in FLOAT_TYPES:
        out = b.view(_TORCH_FLOAT[qtype]).to(torch.float32)
        if qtype == Q.F32:
            out = out.clone()  # never hand out a view of the (read-only) file
    elif b.device.type == "cpu":  # gguf's numpy reference (faster than torch element-wise here)
        out = torch.from_numpy(gguf.quants.dequantize(b.numpy(), qtype))
    else:
        out = dequantize_torch(b, qtype)
    return out.reshape(shape)


def dequantize_torch(b: torch.Tensor, qtype: GGMLQuantizationType | int) -> torch.Tensor:
    """uint8 [R, row_bytes] on any device -> float32 [R, cols] with torch ops (exact as ggml)."""
    qtype = _qtype(qtype, SUPPORTED)
    rows = b.shape[0]
    if qtype in FLOAT_TYPES:
        return b.contiguous().view(_TORCH_FLOAT[qtype]).to(torch.float32)
    if qtype not in _DEQUANT:  # the rarer types: gguf's numpy reference on the CPU, then back
        if b.device.type == "meta":
            raise ValueError(f"cannot dequantize {qtype.name} on the meta device")
        flat = gguf.quants.dequantize(b.contiguous().cpu().numpy(), qtype)
        return torch.from_numpy(flat).reshape(rows, -1).to(b.device)
    return _DEQUANT[qtype](b.reshape(-1, GGML_QUANT_SIZES[qtype][1])).reshape(rows, -1)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 -> [N, 1] float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:  # [N, 34] -> [N, 32]
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _fp16(b[:, :2])


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:  # [N, 18] -> [N, 32]
    qs = b[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int8) - 8
    return q.to(torch.float32) * _fp16(b[:, :2])


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """[N, 4] uint8 (a little-endian u32) -> [N, 32] uint8 bits, bit j at column j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:  # [N, 22] -> [N, 32]
    qs = b[:, 6:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1) | (_qh_bits(b[:, 2:6]) << 4)
    return (q.to(torch.int8) - 16).to(torch.float32) * _fp16(b[:, :2])


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:  # [N, 210] -> [N, 256]
    n = b.shape[0]
    # 4 quarters of 32 values per half: low nibbles of ql[0:32], ql[32:64], then their high nibbles
    nibble = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    ql = ((b[:, :128].reshape(n, 2, 1, 64) >> nibble) & 0x0F).reshape(n, 2, 4, 32)  # [N, half, quarter, l]
    # the quarter's 2 high bits: bits 2q..2q+1 of qh[l]
    pair = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> pair) & 0x03).reshape(n, 2, 4, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [N, 16]: one per 16 values
    d = _fp16(b[:, 208:210]) * scales  # exact: fp16 * int8 fits in fp32; then * q as ggml
    return (d.unsqueeze(-1) * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)


# ggml's kvalues_mxfp4: the E2M1 values times two (the scale is halved to match: ggml_e8m0_to_fp32_half)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 2^(e - 128), as ggml_e8m0_to_fp32_half builds its bits (e < 2: the
    denormals 2^-128 and 2^-127; 255 is not NaN there either)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _deq_mxfp4(b: torch.Tensor) -> torch.Tensor:  # [N, 17] -> [N, 32]
    qs = b[:, 1:]
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    q = table[torch.cat([qs & 0x0F, qs >> 4], dim=1).long()]
    return q * e8m0_half(b[:, :1])


_DEQUANT = {Q.Q8_0: _deq_q8_0, Q.Q4_0: _deq_q4_0, Q.Q5_0: _deq_q5_0, Q.Q6_K: _deq_q6_k, Q.MXFP4: _deq_mxfp4}


def quantize(values: torch.Tensor | np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """float values [..., cols] -> uint8 [..., row_bytes] in ggml layout: the same bytes as ggml's
    reference quantizers (`quantize_row_*_ref`: gguf's numpy port for the 32-value blocks, hotcold.gguf.kquants
    for the K-quants); for F32/F16/BF16 the plain encoding. NaN or inf in a block format is a ValueError."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in QUANTIZE_TYPES:
        names = ", ".join(sorted(t.name for t in QUANTIZE_TYPES))
        raise ValueError(f"cannot quantize to {qtype.name} (supported: {names})")
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(values, dtype=np.float32)
    lead, cols = x.shape[:-1], (x.shape[-1] if x.ndim else 1)
    nb = row_bytes(qtype, cols)
    if qtype not in FLOAT_TYPES:
        from hotcold.gguf import kquants  # numpy only: the one hotcold module this layer may import

        if qtype in kquants.TYPES:
            return kquants.quantize(x, qtype)
        if not np.isfinite(x).all():
            bad = int(np.count_nonzero(~np.isfinite(x)))
            raise ValueError(f"cannot quantize to {qtype.name}: the values hold {bad} NaN or inf number(s)")
    with np.errstate(over="ignore", invalid="ignore"):  # huge values saturate to inf in fp16, as in ggml
        out = gguf.quants.quantize(x, qtype)
    return np.ascontiguousarray(out).view(np.uint8).reshape(*lead, nb)


@dataclass(frozen=True)
class QuantTensor:
    """A 2-D matrix kept in its ggml bytes.

    data: uint8 [rows, row_bytes] (typically a zero-copy view of the memory-mapped file; rows may
    have a larger stride than row_bytes), qtype: a GGMLQuantizationType (any of SUPPORTED, float
    types included), shape: (rows, cols) in values, packed: see below.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    # A copy of the rows in the C kernels' repacked layout for whole-matrix products (kernels/cpu.pack),
    # made at load for matrices that are never gathered row by row; select_rows and to() drop it.
    packed: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", _qtype(self.qtype))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if len(self.shape) != 2:
            raise ValueError(f"QuantTensor is 2-D, got shape {self.shape}")
        rows, cols = self.shape
        expected = (rows, row_bytes(self.qtype, cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"{self.qtype.name} tensor of shape {self.shape} needs uint8 data of shape {expected}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if rows and self.data.stride(1) != 1:
            raise ValueError("QuantTensor rows must be contiguous in memory")

    @classmethod
    def from_float(cls, values: torch.Tensor | np.ndarray, qtype: GGMLQuantizationType | int) -> QuantTensor:
        """Quantize a float [rows, cols] matrix."""
        raw = quantize(values, qtype)
        return cls(torch.from_numpy(raw), GGMLQuantizationType(qtype), (raw.shape[0], int(values.shape[1])))

    @property
    def nbytes(self) -> int:
        return self.shape[0] * row_bytes(self.qtype, self.shape[1])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, cols], or [len(rows), cols] for a 1-D index (or bool mask) tensor `rows` (the pure
        path; `hotcold.kernels.cpu.dequantize_rows(qt)` is the fast one on the CPU)."""
        data = self.data if rows is None else self.data[rows.to(self.data.device)]
        if data.is_cpu:
            return dequantize(data, self.qtype, (data.shape[0], self.shape[1]))
        return dequantize_torch(data, self.qtype)  # on the tensor's own device

    def select_rows(self, rows: torch.Tensor) -> QuantTensor:
        """A new QuantTensor holding a copy of the given rows (e.g. the hot rows for the GPU)."""
        data = self.data[rows.to(self.data.device)]
        return QuantTensor(data, self.qtype, (data.shape[0], self.shape[1]))

    def to(self, device: torch.device | str) -> QuantTensor:
        return QuantTensor(self.data.to(device), self.qtype, self.shape)
