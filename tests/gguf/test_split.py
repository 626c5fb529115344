"""Split models (NAME-00001-of-0000N.gguf), as upstream's gguf-py writer splits them (the writer behind
convert_hf_to_gguf.py --split-max-tensors and llama-gguf-split), load as the one file they were made from."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

import hotcold
from hotcold.gguf.io import GGUFError, ModelFile


def split_with_upstream_writer(source: Path, out_dir: Path, max_tensors: int) -> list[Path]:
    """`source` rewritten by gguf.GGUFWriter with split_max_tensors: the parts, first part first."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out_dir / "model.gguf", arch, split_max_tensors=max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out_dir.glob("model-*-of-*.gguf"))


@pytest.fixture(scope="module")
def split_parts(tmp_path_factory, tiny_dense_gguf):
    out = tmp_path_factory.mktemp("split")
    parts = split_with_upstream_writer(Path(tiny_dense_gguf), out, max_tensors=6)
    assert len(parts) >= 3 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    return parts


def test_split_model_reads_as_the_whole_file(split_parts, tiny_dense_gguf):
    whole = ModelFile(tiny_dense_gguf)
    split = ModelFile(split_parts[0])
    assert split.parts == split_parts
    assert set(split.tensors) == set(whole.tensors)
    for name in whole.tensors:
        assert torch.equal(torch.as_tensor(split.tensor(name)), torch.as_tensor(whole.tensor(name))), name


def test_split_model_generates_as_the_whole_file(split_parts, tiny_dense_gguf):
    ids = [1, 5, 9, 13]
    expected = hotcold.load(tiny_dense_gguf).logits(ids)
    assert torch.equal(hotcold.load(split_parts[0]).logits(ids), expected)


def test_a_later_part_is_refused_naming_the_first(split_parts):
    with pytest.raises(GGUFError, match="part 2 of a .*open its first part"):
        ModelFile(split_parts[1])


def test_a_missing_part_is_named(split_parts, tmp_path):
    for p in split_parts[:-1]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(GGUFError, match=f"part {len(split_parts)} of {len(split_parts)} is missing"):
        ModelFile(tmp_path / split_parts[0].name)


def test_a_rewrite_of_a_split_model_is_one_loadable_file(split_parts, tiny_dense_gguf, tmp_path):
    """quantize (and reorder, sparsify: every rewrite goes through metadata_items) of a split model writes one
    file holding every tensor, without the split.* keys that would make it look like a first part."""
    from hotcold.cli import main

    out = tmp_path / "q8.gguf"
    assert main(["quantize", str(split_parts[0]), str(out), "q8_0"]) == 0
    assert not any(k.startswith("split.") for k in ModelFile(out).metadata)
    ids = [1, 5, 9, 13]
    expected = hotcold.load(tiny_dense_gguf).logits(ids)
    got = hotcold.load(out).logits(ids)
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()  # Q8_0 of the same weights
