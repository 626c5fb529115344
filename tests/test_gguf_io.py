"""gguf_io: both magics, PowerInfer integer types, zero-copy views, bit-exact round trips, broken files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from hotcold.gguf_io import POWERINFER_I32, GGUFError, ModelFile, TensorSpec, metadata_items, write_model_file


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
