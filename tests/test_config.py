"""config: hyper-parameters from metadata, refused with the key named when they cannot be a model's
(found by tests/gguf/test_fuzz.py: each of these crashed, hung or allocated tens of GB before)."""

from __future__ import annotations

import pytest

from hotcold.config import config_from_file
from hotcold.gguf.io import GGUFError, ModelFile
from tests.fixtures import gguf_layout, set_field, tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("config") / "m.gguf", sparse=False)


def with_fields(tiny, tmp_path, changes):
    data = bytearray(tiny.read_bytes())
    fields, _ = gguf_layout(bytes(data))
    for label, value in changes.items():
        set_field(data, next(f for f in fields if f.label == label), value)
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    return path


def test_the_tiny_model_reads(tiny):
    c = config_from_file(ModelFile(tiny))
    assert (c.n_layer, c.n_embd, c.n_head, c.head_dim, c.rope_dim, c.n_ctx_train) == (2, 32, 4, 8, 8, 64)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("llama.rope.dimension_count", 7, r"rope.dimension_count is 7: RoPE rotates pairs"),
        ("llama.rope.dimension_count", 16, r"rope.dimension_count is 16, expected an integer in 2..8"),
        ("llama.rope.dimension_count", 2**31, r"rope.dimension_count is 2147483648"),
        (
            "llama.context_length",
            2**32 - 1,
            r"context_length is 4294967295, expected an integer in 1..16777216",
        ),
        ("llama.block_count", 2**31, r"block_count is 2147483648, but the file has tensors for 2 layer"),
        ("llama.block_count", 3, r"block_count is 3, but the file has tensors for 2 layer"),
        ("llama.attention.head_count", 0, r"head_count is 0, expected an integer >= 1"),
        ("llama.attention.head_count_kv", 0, r"head_count_kv is 0"),
        ("llama.embedding_length", 0, r"embedding_length is 0"),
    ],
)
def test_impossible_values_named(tiny, tmp_path, key, value, message):
    path = with_fields(tiny, tmp_path, {key: value})
    with pytest.raises(GGUFError, match=message):
        config_from_file(ModelFile(path))
