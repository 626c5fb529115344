"""Read and write dense (`GGUF`) and PowerInfer (`PWRI`) model files over the `gguf` package.

The released `gguf` reader rejects the `PWRI` magic and numbers integer tensors differently from
PowerInfer's fork (the fork's I8/I16/I32 are 16/17/18, upstream's IQ2_XXS/IQ2_XS/IQ3_XXS), so we wrap
its reader instead of forking it: the magic is accepted, and in `PWRI` files types 16..18 mean integers.
Tensors are handed out as zero-copy views of the memory-mapped file.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

from hotcold.atomic import atomic_output
from hotcold.gguf.check import GGUFError, scan_header

if TYPE_CHECKING:
    from hotcold.gguf.quants import QuantTensor

PWRI_MAGIC = int.from_bytes(b"PWRI", "little")

# PowerInfer's fork of gguf-py numbers its integer types 16/17/18; inside PWRI files that is what they mean.
POWERINFER_INT_TYPES = {
    16: GGMLQuantizationType.I8,
    17: GGMLQuantizationType.I16,
    18: GGMLQuantizationType.I32,
}
UPSTREAM_TO_POWERINFER_INT = {v: GGMLQuantizationType(k) for k, v in POWERINFER_INT_TYPES.items()}
POWERINFER_I32 = GGMLQuantizationType(18)  # written as raw type 18 so the original can read gpuidx files

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

# Block formats we execute (directly or by dequantizing): the file bytes are kept as they are.
BLOCK_TYPES = {  # quants.SUPPORTED less the float types (quants is imported lazily here)
    GGMLQuantizationType[name]
    for name in (
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
        "MXFP4",
    )
}


def tensor_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    if qtype.value in POWERINFER_INT_TYPES:
        return _storage_dtype(qtype).itemsize * int(np.prod(shape))
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if shape and shape[-1] % block:
        raise ValueError(
            f"a row of {shape[-1]} values is not a multiple of the {qtype.name} block size {block}"
        )
    return n // block * size


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[
        int, ...
    ]  # numpy order (slowest-varying first): a ggml ne=[n_embd, n_ff] matrix is (n_ff, n_embd)
    qtype: GGMLQuantizationType
    data: (
        np.ndarray
    )  # memory-mapped view: typed for float/int tensors, uint8 [rows, row_bytes] for quantized ones
    n_bytes: int


# the keys of a split model (upstream llama-arch.cpp LLM_KV_SPLIT_*), and its parts' names (common/download.cpp)
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(.+)-00001-of-([0-9]{5})\.gguf$", re.IGNORECASE)


class _Reader(GGUFReader):
    """`gguf.GGUFReader` that also accepts PowerInfer's magic and integer type numbers."""

    def __init__(self, path: Path):
        raw_magic = np.memmap(path, dtype=np.uint32, mode="r", shape=(1,))[0]
        self.is_powerinfer = int(raw_magic) == PWRI_MAGIC
        # copy-on-write mapping: writable views for torch.from_numpy, pages shared with the page cache
        super().__init__(path, "c")

    def _get(self, offset, dtype, count=1, override_order=None):
        values = super()._get(offset, dtype, count, override_order)
        if offset == 0 and self.is_powerinfer and values.dtype == np.uint32 and count == 1:
            return np.array([GGUF_MAGIC], dtype=np.uint32)
        return values

    def _build_tensors(self, start_offs, fields):
        if self.is_powerinfer:
            for field in fields:
                raw_type = int(field.parts[4][0])
                if raw_type in POWERINFER_INT_TYPES:
                    field.parts[4] = np.array([POWERINFER_INT_TYPES[raw_type].value], dtype=np.uint32)
        super()._build_tensors(start_offs, fields)


class ModelFile:
    """An opened GGUF / PWRI file: metadata as plain Python values, tensors as zero-copy views."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise GGUFError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise GGUFError(f"{self.path}: is a folder, expected a .gguf model file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: file is too small ({size} bytes) to be a GGUF model")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic not in (b"GGUF", b"PWRI"):
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
        self.magic = magic.decode()
        # counts, lengths, types and offsets checked before the gguf reader walks (and trusts) them
        self.header = scan_header(self.path, powerinfer=magic == b"PWRI")
        try:
            reader = _Reader(self.path)
        except GGUFError:
            raise
        except Exception as exc:  # the gguf reader fails deep inside on truncated or corrupt headers
            raise GGUFError(
                f"{self.path}: corrupt or truncated GGUF header ({type(exc).__name__}: {exc})"
            ) from exc
        self.metadata: dict[str, Any] = {}
        # (value type, array element type) per key, so a rewrite (quantize) keeps every key's exact type
        self.metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _plain_value(field)
            main = field.types[0]
            self.metadata_types[key] = (main, field.types[-1] if main == GGUFValueType.ARRAY else None)
        _check_block_count(self.path, self.metadata)
        self.tensors: dict[str, TensorEntry] = {}
        self._add_tensors(self.path, reader, size)
        self.parts = [self.path]
        if int(self.metadata.get(SPLIT_COUNT, 1) or 1) > 1:
            self._add_split_parts()

    def _add_tensors(self, path: Path, reader: GGUFReader, size: int) -> None:
        for t in reader.tensors:
            end = t.data_offset + int(t.n_bytes)
            if end > size:
                raise GGUFError(
                    f"{path}: truncated: tensor {t.name} needs bytes up to {end}, file has {size}"
                )
            if t.name in self.tensors:
                raise GGUFError(f"{path}: tensor {t.name} appears twice in the model's files")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorEntry(t.name, shape, t.tensor_type, t.data, int(t.n_bytes))

    def _add_split_parts(self) -> None:
        """A model split by llama-gguf-split / convert_hf_to_gguf --split-max-*: NAME-00001-of-0000N.gguf holds
        the metadata, every part tensors; the parts are found beside the first by name and read as one file."""
        count = int(self.metadata[SPLIT_COUNT])
        number = int(self.metadata.get(SPLIT_NO, 0))
        m = _SPLIT_NAME.match(self.path.name)
        if number != 0:
            raise GGUFError(
                f"{self.path}: part {number + 1} of a {count}-part model; open its first part (-00001-of-)"
            )
        if m is None:
            raise GGUFError(
                f"{self.path}: a {count}-part model whose name is not NAME-00001-of-{count:05d}.gguf"
            )
        for i in range(2, count + 1):
            part = self.path.with_name(f"{m[1]}-{i:05d}-of-{count:05d}.gguf")
            if not part.is_file():
                raise GGUFError(f"{self.path}: part {i} of {count} is missing: {part}")
            size = part.stat().st_size
            scan_header(part)
            try:
                reader = _Reader(part)
            except Exception as exc:
                raise GGUFError(
                    f"{part}: corrupt or truncated GGUF header ({type(exc).__name__}: {exc})"
                ) from exc
            field = reader.fields.get(SPLIT_NO)
            if field is None or int(_plain_value(field)) != i - 1:
                raise GGUFError(f"{part}: not part {i} of {self.path.name} (its {SPLIT_NO} says otherwise)")
            self._add_tensors(part, reader, size)
            self.parts.append(part)
        expected = self.metadata.get(SPLIT_TENSORS)
        if expected is not None and int(expected) != len(self.tensors):
            raise GGUFError(
                f"{self.path}: the {count} parts hold {len(self.tensors)} tensors, {SPLIT_TENSORS} says {expected}"
            )

    @property
    def is_sparse(self) -> bool:
        """A PWRI file: PowerInfer layout with predictors."""
        return self.magic == "PWRI"

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: missing metadata key general.architecture")
        return arch

    def entry(self, name: str, shape: tuple[int, ...] | None = None) -> TensorEntry:
        entry = self.tensors.get(name)
        if entry is None:
            raise GGUFError(f"{self.path}: missing tensor {name}")
        if shape is not None and entry.shape != tuple(shape):
            raise GGUFError(f"{self.path}: tensor {name} has shape {entry.shape}, expected {tuple(shape)}")
        return entry

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | QuantTensor:
        """Zero-copy view of a tensor: a torch tensor for float/int types, a QuantTensor for block formats."""
        entry = self.entry(name, shape)
        return as_torch(entry, self.path)

    def weight(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | QuantTensor:
        """tensor() for a model weight: a float type, or a block format for a matrix (vectors such as norms
        and biases are never quantized); anything else is refused naming the tensor."""
        entry = self.entry(name, shape)
        if entry.qtype in BLOCK_TYPES and len(entry.shape) < 2:
            raise GGUFError(
                f"{self.path}: tensor {name} is a vector in {entry.qtype.name}; vectors are F32/F16/BF16"
            )
        if entry.qtype not in FLOAT_TYPES and entry.qtype not in BLOCK_TYPES:
            raise GGUFError(
                f"{self.path}: tensor {name} has type {entry.qtype.name}, which is not a weight type"
            )
        return as_torch(entry, self.path)


def _check_block_count(path: Path, metadata: dict[str, Any]) -> None:
    """A model has at least one layer: `<arch>.block_count` 0 would load and generate nonsense."""
    arch = metadata.get("general.architecture")
    key = f"{arch}.block_count"
    if isinstance(arch, str) and key in metadata:
        count = metadata[key]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise GGUFError(f"{path}: metadata key {key} is {count!r}; a model has at least one layer")


def as_torch(entry: TensorEntry, path: Path | str = "model") -> torch.Tensor | QuantTensor:
    if entry.qtype in FLOAT_TYPES:
        if entry.qtype == GGMLQuantizationType.BF16:
            # numpy has no bfloat16: the reader hands out uint8 bytes; reinterpret them
            raw = torch.from_numpy(entry.data).view(torch.bfloat16)
            return raw.reshape(entry.shape)
        return torch.from_numpy(entry.data).reshape(entry.shape)
    if entry.qtype in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32):
        return torch.from_numpy(entry.data).reshape(entry.shape)
    if entry.qtype in BLOCK_TYPES:
        from hotcold.gguf import quants

        rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
        data = torch.from_numpy(entry.data).reshape(rows, -1)
        return quants.QuantTensor(data, entry.qtype, (rows, entry.shape[-1]))
    raise GGUFError(f"{path}: tensor {entry.name} has unsupported type {entry.qtype.name}")


def _plain_value(field) -> Any:
    main = field.types[0] if field.types else None
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        values = [field.parts[i][0] for i in field.data]
        return [v.item() for v in values]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    return value.item() if hasattr(value, "item") else value


# ---------------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write. `produce` returns its bytes as a numpy array when the writer gets to it, so a
    converter never holds the whole model in memory. shape is in numpy order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    produce: Callable[[], np.ndarray]

    @property
    def n_bytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def write_model_file(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Iterable[tuple],
    tensors: Iterable[TensorSpec],
    *,
    sparse: bool = False,
    progress: Callable[[Iterable[TensorSpec]], Iterable[TensorSpec]] | None = None,
    extra: Callable[[GGUFWriter], None] | None = None,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Write a GGUF file atomically (hotcold.atomic: a temp file in the same folder, renamed over `path`
    when complete, removed on any error); an output that is one of `inputs` (the files the caller reads)
    is refused before anything is written.

    sparse=True patches the magic to `PWRI` as PowerInfer's converters do. metadata are (key, value, type);
    arrays are (key, list, ARRAY) and their element type is inferred by gguf. `extra` may add more keys
    (e.g. the vocabulary) to the writer before it is written.
    """
    tensors = list(tensors)
    with atomic_output(path, inputs, what="output file") as tmp:
        writer = GGUFWriter(tmp, arch)
        for key, value, vtype, *sub_type in metadata:
            if key == "general.architecture":
                continue
            if key == "general.alignment":  # the writer must pad as the copied key says
                writer.data_alignment = int(value)
            writer.add_key_value(key, value, vtype, sub_type[0] if sub_type else None)
        if extra is not None:
            extra(writer)
        for spec in tensors:
            dtype = _storage_dtype(spec.qtype)
            raw_type = spec.qtype
            if sparse and raw_type in UPSTREAM_TO_POWERINFER_INT:
                raw_type = UPSTREAM_TO_POWERINFER_INT[raw_type]  # PWRI files use the fork's numbering
            writer.add_tensor_info(spec.name, _info_shape(spec), dtype, spec.n_bytes, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        items = progress(tensors) if progress is not None else tensors
        try:
            for spec in items:
                array = np.ascontiguousarray(spec.produce())
                if array.nbytes != spec.n_bytes:
                    raise ValueError(
                        f"tensor {spec.name}: produced {array.nbytes} bytes, expected {spec.n_bytes}"
                    )
                writer.write_tensor_data(array)
        finally:  # a progress bar ends its line before an error is printed (a full disk, a bad tensor)
            if callable(close := getattr(items, "close", None)):
                close()
        writer.close()
        if sparse:
            with open(tmp, "r+b") as f:
                f.write(struct.pack("<I", PWRI_MAGIC))
    return Path(path)


def _storage_dtype(qtype: GGMLQuantizationType) -> np.dtype:
    if qtype == GGMLQuantizationType.F32:
        return np.dtype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.dtype(np.float16)
    if qtype in (GGMLQuantizationType.I32, POWERINFER_I32):
        return np.dtype(np.int32)
    if qtype in (GGMLQuantizationType.I16, GGMLQuantizationType(17)):
        return np.dtype(np.int16)
    if qtype in (GGMLQuantizationType.I8, GGMLQuantizationType(16)):
        return np.dtype(np.int8)
    # BF16 and block formats travel as raw bytes
    return np.dtype(np.uint8)


def _info_shape(spec: TensorSpec) -> tuple[int, ...]:
    if _storage_dtype(spec.qtype) == np.uint8:
        # GGUFWriter converts a byte shape back to an element shape for raw types
        return quant_shape_to_byte_shape(spec.shape, spec.qtype)
    return spec.shape


def metadata_items(model_file: ModelFile) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """A file's metadata with its exact value types, ready for write_model_file (for rewriting a file). A split
    model's split.* keys stay behind: a rewrite is one file holding every tensor."""
    split = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
    return [(k, v, *model_file.metadata_types[k]) for k, v in model_file.metadata.items() if k not in split]
