"""gguf.io: both magics, PowerInfer integer types, zero-copy views, bit-exact round trips, broken files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from hotcold.gguf.io import POWERINFER_I32, GGUFError, ModelFile, TensorSpec, metadata_items, write_model_file


def spec(name, array, qtype):
    return TensorSpec(
        name,
        tuple(array.shape) if qtype != Q.BF16 else (array.shape[0], array.shape[1] // 2),
        qtype,
        lambda: array,
    )


def sample_file(path, *, sparse=False):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    f16 = rng.standard_normal((5, 32)).astype(np.float16)
    bf16 = torch.randn(4, 32).to(torch.bfloat16).view(torch.uint8).numpy()
    ints = rng.integers(0, 2, 1280).astype(np.int32)
    meta = [
        ("general.name", "tiny", V.STRING),
        ("llama.block_count", 2, V.UINT32),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("split.vram_capacity", 2**40 + 3, V.UINT64),
        ("tokenizer.ggml.tokens", ["<unk>", "a", "b"], V.ARRAY),
        ("tokenizer.ggml.scores", [0.0, -1.5, -2.5], V.ARRAY),
    ]
    tensors = [
        spec("a.weight", f32, Q.F32),
        spec("b.weight", f16, Q.F16),
        TensorSpec("c.weight", (4, 32), Q.BF16, lambda: bf16),
        TensorSpec("blk.0.gpu_idx", (1280,), POWERINFER_I32 if sparse else Q.I32, lambda: ints),
    ]
    write_model_file(path, "llama", meta, tensors, sparse=sparse)
    return f32, f16, bf16, ints


@pytest.mark.parametrize("sparse", [False, True])
def test_read_back_exact(tmp_path, sparse):
    path = tmp_path / "m.gguf"
    f32, f16, bf16, ints = sample_file(path, sparse=sparse)
    raw = path.read_bytes()
    assert raw[:4] == (b"PWRI" if sparse else b"GGUF")
    if sparse:  # PowerInfer numbers I32 as 18 (upstream: 26)
        assert struct.pack("<I", 18) in raw
    mf = ModelFile(path)
    assert mf.is_sparse == sparse
    assert mf.metadata["general.name"] == "tiny"
    assert mf.metadata["split.vram_capacity"] == 2**40 + 3
    assert mf.metadata["tokenizer.ggml.tokens"] == ["<unk>", "a", "b"]
    assert mf.metadata["tokenizer.ggml.scores"] == [0.0, -1.5, -2.5]
    assert np.array_equal(mf.tensor("a.weight").numpy(), f32)
    assert np.array_equal(mf.tensor("b.weight").numpy(), f16)
    assert torch.equal(mf.tensor("c.weight").view(torch.uint8), torch.from_numpy(bf16))
    gpu_idx = mf.tensor("blk.0.gpu_idx")
    assert gpu_idx.dtype == torch.int32 and np.array_equal(gpu_idx.numpy(), ints)


def test_rewrite_is_bit_exact(tmp_path):
    """write(read(x)) == x: same metadata types and tensor bytes give the same file."""
    src = tmp_path / "a.gguf"
    sample_file(src, sparse=True)
    mf = ModelFile(src)
    specs = [TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data) for e in mf.tensors.values()]
    write_model_file(tmp_path / "b.gguf", "llama", metadata_items(mf), specs, sparse=True)
    assert (tmp_path / "b.gguf").read_bytes() == src.read_bytes()


def test_views_are_zero_copy(tmp_path):
    path = tmp_path / "m.gguf"
    sample_file(path)
    mf = ModelFile(path)
    t1, t2 = mf.tensor("a.weight"), mf.tensor("a.weight")
    assert t1.data_ptr() == t2.data_ptr()  # both views of the same mapped pages


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        ModelFile(tmp_path / "nope.gguf")


def test_wrong_magic(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        ModelFile(path)


@pytest.mark.parametrize("keep", [30, 200, -10])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "m.gguf"
    sample_file(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep])
    with pytest.raises(GGUFError, match=str(path.name)):
        ModelFile(path)


def test_missing_and_misshapen_tensor_named(tmp_path):
    path = tmp_path / "m.gguf"
    sample_file(path)
    mf = ModelFile(path)
    with pytest.raises(GGUFError, match="missing tensor blk.9.fc1.weight"):
        mf.tensor("blk.9.fc1.weight")
    with pytest.raises(GGUFError, match=r"a.weight has shape \(3, 64\), expected \(64, 3\)"):
        mf.tensor("a.weight", (64, 3))


def test_interrupted_write_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("disk on fire")

    out = tmp_path / "out.gguf"
    with pytest.raises(RuntimeError):
        write_model_file(out, "llama", [], [TensorSpec("x", (4,), Q.F32, boom)])
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# Hostile headers: checked before the gguf reader walks them (issue 15, items 2 and 3)


def broken(tmp_path, changes: dict[str, int], *, sparse=False):
    """sample_file with header fields (by their gguf_layout label) set to other values."""
    from tests.fixtures import gguf_layout, set_field

    path = tmp_path / "m.gguf"
    sample_file(path, sparse=sparse)
    data = bytearray(path.read_bytes())
    fields, _ = gguf_layout(bytes(data))
    for label, value in changes.items():
        set_field(data, next(f for f in fields if f.label == label), value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("count", [2**40, 2**64 - 1, 2**32])
@pytest.mark.parametrize("key", ["tokenizer.ggml.scores", "tokenizer.ggml.tokens"])
def test_huge_array_count_fails_fast_naming_the_key(tmp_path, key, count):
    import time

    path = broken(tmp_path, {f"{key} count": count})
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=rf"m.gguf: metadata key '{key}': array of {count} \w+ values needs"):
        ModelFile(path)
    assert time.perf_counter() - start < 1.0


def test_huge_string_length_and_counts(tmp_path):
    with pytest.raises(GGUFError, match="general.name.*needs 18446744073709551615 bytes"):
        ModelFile(broken(tmp_path, {"general.name string": 2**64 - 1}))
    with pytest.raises(GGUFError, match="header says 1099511627776 metadata keys"):
        ModelFile(broken(tmp_path, {"kv count": 2**40}))
    with pytest.raises(GGUFError, match="header says 18446744073709551615 tensors"):
        ModelFile(broken(tmp_path, {"tensor count": 2**64 - 1}))


def test_bad_types_and_dims_named(tmp_path):
    with pytest.raises(GGUFError, match="'llama.block_count': unknown value type 99"):
        ModelFile(broken(tmp_path, {"llama.block_count type": 99}))
    with pytest.raises(GGUFError, match="'tokenizer.ggml.scores': arrays of arrays"):
        ModelFile(broken(tmp_path, {"tokenizer.ggml.scores item type": 9}))
    with pytest.raises(GGUFError, match="tensor 'b.weight': unknown tensor type 99"):
        ModelFile(broken(tmp_path, {"b.weight type": 99}))
    with pytest.raises(GGUFError, match="tensor 'a.weight': 5 dimensions"):
        ModelFile(broken(tmp_path, {"a.weight n_dims": 5}))
    with pytest.raises(GGUFError, match="tensor 'a.weight': dimensions .* overflow"):
        ModelFile(broken(tmp_path, {"a.weight dim 0": 2**32, "a.weight dim 1": 2**32}))


def test_misaligned_offset_named(tmp_path):
    path = tmp_path / "m.gguf"
    sample_file(path)
    offset = ModelFile(path).header.tensors[1].offset
    with pytest.raises(
        GGUFError, match=r"tensor 'b.weight': data offset \d+ is not a multiple of the alignment 32"
    ):
        ModelFile(broken(tmp_path, {"b.weight offset": offset + 4}))


def test_overlapping_tensors_named(tmp_path):
    with pytest.raises(GGUFError, match="tensor 'b.weight' .* overlaps tensor 'a.weight'"):
        ModelFile(broken(tmp_path, {"b.weight offset": 0}))


@pytest.mark.parametrize("offset", [2**64 - 32, 2**63, 2**40])
def test_offset_outside_the_data_section(tmp_path, offset):
    """2**64 - 32 wraps around to just below the data section in 64-bit arithmetic (C readers)."""
    with pytest.raises(
        GGUFError, match=f"tensor 'b.weight': data offset {offset} lies outside the data section"
    ):
        ModelFile(broken(tmp_path, {"b.weight offset": offset}))


def test_zero_layers_refused(tmp_path):
    with pytest.raises(GGUFError, match="llama.block_count is 0; a model has at least one layer"):
        ModelFile(broken(tmp_path, {"llama.block_count": 0}))


def test_quantized_vector_refused(tmp_path):
    path = tmp_path / "m.gguf"
    rng = np.random.default_rng(0)
    from hotcold.gguf import quants

    q = quants.quantize(torch.from_numpy(rng.standard_normal(32).astype(np.float32)), Q.Q8_0)
    write_model_file(path, "llama", [], [TensorSpec("n.weight", (32,), Q.Q8_0, lambda: q)])
    with pytest.raises(GGUFError, match="tensor n.weight is a vector in Q8_0"):
        ModelFile(path).weight("n.weight")
    assert ModelFile(path).tensor("n.weight").shape == (1, 32)  # as stored: one row of blocks


def test_integer_weight_refused_named(tmp_path):
    path = tmp_path / "m.gguf"
    sample_file(path)
    with pytest.raises(GGUFError, match="tensor blk.0.gpu_idx has type I32, which is not a weight type"):
        ModelFile(path).weight("blk.0.gpu_idx")
    assert ModelFile(path).weight("a.weight").dtype == torch.float32


def test_valid_files_pass_the_header_scan(tmp_path):
    path = tmp_path / "m.gguf"
    sample_file(path, sparse=True)
    header = ModelFile(path).header
    assert header.alignment == 32 and header.data_offset % 32 == 0
    assert [t.name for t in header.tensors] == ["a.weight", "b.weight", "c.weight", "blk.0.gpu_idx"]
