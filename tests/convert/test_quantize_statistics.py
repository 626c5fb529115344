"""hotcold quantize carries the input's activation statistics beside its output and says what it did with
them and with the placement cache (#47 newcomer item: they were dropped without a word)."""

from __future__ import annotations

import errno

import gguf
import pytest
import torch

from hotcold.cli import main
from tests.fixtures import with_activation_stats


@pytest.fixture
def model_with_stats(tmp_path, tiny_sparse_gguf):
    (tmp_path / "in").mkdir()
    return with_activation_stats(tiny_sparse_gguf, tmp_path / "in")


def stats(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((folder / "activation").iterdir())}


def test_statistics_are_carried_and_the_placement_is_not(model_with_stats, tmp_path, capsys):
    src, _ = model_with_stats
    (src.parent / (src.name + ".generated.gpuidx")).write_bytes(b"a placement for F32 rows")
    out = tmp_path / "out" / "m.q8_0.gguf"
    out.parent.mkdir()
    assert main(["quantize", str(src), str(out), "q8_0"]) == 0
    err = capsys.readouterr().err
    assert stats(out.parent) == stats(src.parent)
    assert sorted(p.name for p in out.parent.iterdir()) == ["activation", "m.q8_0.gguf"]  # no .gpuidx
    assert f"carried the activation statistics of {src.parent / 'activation'}" in err
    assert "placement cache (.generated.gpuidx) is not carried" in err
    assert main(["quantize", str(src), str(out), "q4_0"]) == 0  # again: they are already there
    assert "already the input's" in capsys.readouterr().err


def test_beside_the_input_they_are_shared(model_with_stats, capsys):
    src, _ = model_with_stats
    before = stats(src.parent)
    assert main(["quantize", str(src), str(src.parent / "m.q8_0.gguf"), "q8_0"]) == 0
    assert "serve the output too" in capsys.readouterr().err and stats(src.parent) == before


def test_other_statistics_in_the_way_are_kept_and_named(model_with_stats, tmp_path, capsys):
    src, _ = model_with_stats
    (tmp_path / "other" / "activation").mkdir(parents=True)
    torch.save(torch.ones(1280), tmp_path / "other" / "activation" / "activation_0.pt")
    before = stats(tmp_path / "other")
    assert main(["quantize", str(src), str(tmp_path / "other" / "m.gguf"), "q8_0"]) == 0
    err = capsys.readouterr().err
    assert "not carried" in err and "already holds others" in err and stats(tmp_path / "other") == before


def test_a_failed_write_leaves_neither(model_with_stats, tmp_path, monkeypatch, capsys):
    src, _ = model_with_stats

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    out = tmp_path / "out" / "m.q8_0.gguf"
    out.parent.mkdir()
    assert main(["quantize", str(src), str(out), "q8_0"]) == 1
    assert "no space left on device writing" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []
