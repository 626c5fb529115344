"""Check a GGUF / PWRI file's header before anything reads it for real.

The `gguf` package's reader walks every metadata array element by element and trusts every count and
offset: an array count of 2**40 makes it loop and allocate without bound, and tensor offsets that are
misaligned, overlap, or lie outside the data section load as garbage. `scan_header` walks the same
layout first, with nothing but a cursor over the mapped bytes, and refuses, with one line naming the file
and the key or tensor:
- a count or length that needs more bytes than are left in the file (checked before the walk, so a huge
  count fails at once), an unknown value type, a nested array, a key or tensor name that is not UTF-8
  or appears twice;
- `general.alignment` that is not a u32 power of two;
- a tensor with more than 4 dimensions, an unknown type, a row that is not a whole number of blocks, or
  an element count past 2**63; a data offset that is not a multiple of the alignment, outside the data
  section, or a tensor whose bytes overlap another's or run past the end of the file.
Only little-endian files are read (as llama.cpp and PowerInfer write them).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


class GGUFError(ValueError):
    """A model file that cannot be read; the message names the file and the problem."""


SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
PWRI_INT_TYPES = {16: GGMLQuantizationType.I8, 17: GGMLQuantizationType.I16, 18: GGMLQuantizationType.I32}

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (fastest-varying first), as in the file
    qtype: GGMLQuantizationType
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    data_offset: int  # where the data section starts
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.fail(
                f"truncated or corrupt header: {what} needs {n} bytes at offset {self.pos}, "
                f"only {self.left} left in the file"
            )

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def raw_string(self, what: str) -> bytes:
        length = self.unpack("Q", f"{what} (length)")
        self.need(length, f"{what} of {length} bytes")
        start = self.pos
        self.pos += length
        return self.buf[start : self.pos]

    def name(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 ({raw[:40]!r})") from None


def _value_type(raw: int, cur: _Cursor, where: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{where}: unknown value type {raw}") from None


def _skip_value(cur: _Cursor, vtype: GGUFValueType, key: str):
    """Walk one value; returns it when it is a scalar or a string (for the keys the scan checks)."""
    where = f"metadata key {key!r}"
    if vtype == GGUFValueType.STRING:
        return cur.raw_string(f"{where}: string")
    if vtype in SCALAR_FORMATS:
        return cur.unpack(SCALAR_FORMATS[vtype], f"{where}: {vtype.name} value")
    # an array: element type, count, elements
    itype = _value_type(cur.unpack("I", f"{where}: array type"), cur, f"{where}: array")
    count = cur.unpack("Q", f"{where}: array length")
    if itype == GGUFValueType.ARRAY:
        raise cur.fail(f"{where}: arrays of arrays are not supported")
    item = struct.calcsize("<" + SCALAR_FORMATS[itype]) if itype in SCALAR_FORMATS else 8  # a string: >= 8
    if count * item > cur.left:  # before walking: a huge count fails here, at once
        raise cur.fail(
            f"{where}: array of {count} {itype.name} values needs at least {count * item} bytes, "
            f"only {cur.left} left in the file"
        )
    if itype == GGUFValueType.STRING:
        for i in range(count):
            length = cur.unpack("Q", f"{where}: string {i} (length)")
            cur.skip(length, f"{where}: string {i} of {length} bytes")
    else:
        cur.pos += count * item
    return None


def scan_header(path: str | Path, *, powerinfer: bool = False) -> Header:
    """Validate the header of the GGUF file at `path` (see the module docstring); GGUFError if it is bad.

    powerinfer: a PWRI file, whose tensor types 16..18 are PowerInfer's I8/I16/I32."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.seek(0, 2) < 24:
            raise GGUFError(f"{path}: file is too small ({f.tell()} bytes) to be a GGUF model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(_Cursor(buf, path), powerinfer)


def _scan(cur: _Cursor, powerinfer: bool) -> Header:
    cur.skip(4, "magic")
    version = cur.unpack("I", "version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            raise cur.fail("a big-endian GGUF file: only little-endian files are supported")
        raise cur.fail(
            f"GGUF version {version} is not supported (only {' and '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    n_tensors = cur.unpack("Q", "tensor count")
    n_kv = cur.unpack("Q", "metadata count")
    if n_kv * MIN_KV_BYTES > cur.left:
        raise cur.fail(
            f"header says {n_kv} metadata keys; the file has room for at most {cur.left // MIN_KV_BYTES}"
        )
    if n_tensors * MIN_TENSOR_INFO_BYTES > cur.left:
        raise cur.fail(
            f"header says {n_tensors} tensors; the file has room for at most {cur.left // MIN_TENSOR_INFO_BYTES}"
        )

    keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.name(f"metadata key {i}")
        if key in keys:
            raise cur.fail(f"metadata key {key!r} appears twice")
        keys.add(key)
        vtype = _value_type(cur.unpack("I", f"metadata key {key!r}: type"), cur, f"metadata key {key!r}")
        value = _skip_value(cur, vtype, key)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise cur.fail(f"metadata key 'general.alignment' must be a UINT32, is {vtype.name}")
            if value == 0 or value & (value - 1):
                raise cur.fail(f"metadata key 'general.alignment' is {value}, not a power of two")
            alignment = value

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.name(f"tensor {i}: name")
        if name in names:
            raise cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        infos.append(_tensor_info(cur, name, powerinfer))

    data_offset = cur.pos + (-cur.pos % alignment)
    if infos and data_offset > cur.size:
        raise cur.fail(
            f"truncated: the data section would start at byte {data_offset}, the file has {cur.size}"
        )
    data_size = cur.size - data_offset
    for t in infos:
        if t.offset % alignment:
            raise cur.fail(
                f"tensor {t.name!r}: data offset {t.offset} is not a multiple of the alignment {alignment}"
            )
        if t.offset > data_size:
            raise cur.fail(
                f"tensor {t.name!r}: data offset {t.offset} lies outside the data section ({data_size} bytes)"
            )
        if t.offset + t.n_bytes > data_size:
            raise cur.fail(
                f"truncated: tensor {t.name} needs bytes up to {data_offset + t.offset + t.n_bytes}, "
                f"file has {cur.size}"
            )
    ordered = sorted((t for t in infos if t.n_bytes), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.n_bytes:
            raise cur.fail(
                f"tensor {b.name!r} (data bytes {b.offset}..{b.offset + b.n_bytes}) overlaps tensor {a.name!r} "
                f"(data bytes {a.offset}..{a.offset + a.n_bytes})"
            )
    return Header(version, alignment, data_offset, tuple(infos))


def _tensor_info(cur: _Cursor, name: str, powerinfer: bool) -> TensorInfo:
    where = f"tensor {name!r}"
    n_dims = cur.unpack("I", f"{where}: dimension count")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"{where}: {n_dims} dimensions, at most {MAX_DIMS} are supported")
    dims = tuple(cur.unpack("Q", f"{where}: dimension {d}") for d in range(n_dims))
    raw_type = cur.unpack("I", f"{where}: type")
    offset = cur.unpack("Q", f"{where}: data offset")
    if powerinfer and raw_type in PWRI_INT_TYPES:
        qtype = PWRI_INT_TYPES[raw_type]
    else:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"{where}: unknown tensor type {raw_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise cur.fail(f"{where}: tensor type {qtype.name} has no known size")
    n_elements = 1
    for d in dims:
        n_elements *= d
    if any(d >= 2**63 for d in dims) or _product_nonzero(dims) >= 2**63:
        raise cur.fail(f"{where}: dimensions {list(dims)} overflow a 64-bit element count")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block:
        raise cur.fail(
            f"{where}: a row of {dims[0]} values is not a multiple of the {qtype.name} block size {block}"
        )
    return TensorInfo(name, dims, qtype, offset, n_elements // block * type_size)


def _product_nonzero(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= max(d, 1)
    return n
