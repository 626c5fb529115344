"""hotcold reorder: a PowerInfer file rewritten hottest first computes the same function, carries its statistics
permuted, loads without a copy, and refuses what it cannot do, naming the file."""

from __future__ import annotations

import pytest
import torch

import hotcold
from hotcold.cli import main
from hotcold.convert.reorder import reorder_file
from hotcold.gguf.io import ModelFile
from hotcold.loader import load_model
from tests.fixtures import with_activation_stats


@pytest.fixture()
def model_with_stats(tmp_path, tiny_sparse_gguf):
    (tmp_path / "in").mkdir()
    return with_activation_stats(tiny_sparse_gguf, tmp_path / "in", high=50)


def test_reordered_file_is_the_same_model_hottest_first(model_with_stats, tmp_path, capsys):
    src, counts = model_with_stats
    dst = tmp_path / "out" / "m.hot.gguf"
    dst.parent.mkdir()
    assert main(["reorder", str(src), str(dst)]) == 0
    assert "hottest first" in capsys.readouterr().err
    orders = [torch.argsort(c, descending=True, stable=True) for c in counts]
    a, b = ModelFile(src), ModelFile(dst)
    assert b.is_sparse and set(a.tensors) == set(b.tensors)
    for name, entry in a.tensors.items():
        got, want = torch.from_numpy(b.tensors[name].data.copy()), torch.from_numpy(entry.data.copy())
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if any(
            name.endswith(s) for s in ("ffn_up.weight", "ffn_gate.weight", "ffn_down_t.weight", "fc2.weight")
        ):
            want = want[orders[layer]]
        assert torch.equal(got, want), name
    for i, c in enumerate(counts):  # the statistics, permuted the same way, beside the output
        assert torch.equal(torch.load(dst.parent / "activation" / f"activation_{i}.pt"), c[orders[i]])
    ids = list(range(3, 40))
    want = hotcold.load(src, device="cpu").logits(ids)
    assert torch.allclose(
        hotcold.load(dst, device="cpu").logits(ids), want, rtol=0, atol=1e-5 * float(want.abs().max())
    )
    loaded = load_model(dst, device="cpu", kv_sequences=2)  # stored hottest first: nothing to copy at load
    assert all(layer.ffn.weights.order is None for layer in loaded.model.layers)
    assert any("0 of 2 layers reordered" in n for n in loaded.notes)


def test_refusals_name_the_problem(model_with_stats, tmp_path, tiny_dense_gguf, capsys):
    src, _ = model_with_stats
    cases = [
        (
            [str(src), str(tmp_path / "in" / "beside.gguf")],
            "over the input's",
        ),  # same folder: same statistics
        ([str(src), str(src)], str(src)),
        ([str(tiny_dense_gguf), str(tmp_path / "d.gguf")], "not a PowerInfer file"),
        (
            [str(src), str(tmp_path / "n.gguf"), "--activation", str(tmp_path / "none")],
            "no activation statistics",
        ),
    ]
    for args, message in cases:
        assert main(["reorder", *args]) == 1
        assert message in capsys.readouterr().err
    (tmp_path / "other" / "activation").mkdir(parents=True)  # another model's statistics: kept
    torch.save(torch.ones(1280), tmp_path / "other" / "activation" / "activation_0.pt")
    assert main(["reorder", str(src), str(tmp_path / "other" / "o.gguf")]) == 1
    assert "already holds activation statistics" in capsys.readouterr().err
    assert torch.equal(torch.load(tmp_path / "other" / "activation" / "activation_0.pt"), torch.ones(1280))
    torch.save(torch.zeros(3), src.parent / "activation" / "activation_1.pt")
    assert main(["reorder", str(src), str(tmp_path / "s.gguf")]) == 1
    assert "activation_1.pt: expected a 1-D tensor of 1280" in capsys.readouterr().err
    assert not (tmp_path / "s.gguf").exists() and not (tmp_path / "beside.gguf").exists()


def test_reorder_file_returns_the_output(model_with_stats, tmp_path):
    src, _ = model_with_stats
    assert reorder_file(src, tmp_path / "r.gguf") == tmp_path / "r.gguf"


def test_a_failure_partway_leaves_neither_model_nor_statistics(
    model_with_stats, tmp_path, monkeypatch, capsys
):
    """The statistics are staged, the model written, then both put in place: a failure on the second
    statistics file used to leave the finished model beside 1 of its 2 statistics."""
    src, _ = model_with_stats
    dst = tmp_path / "out" / "m.hot.gguf"
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert main(["reorder", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert not dst.exists() and not (dst.parent / "activation").exists()
    assert sorted(p.name for p in dst.parent.iterdir()) == []
    assert "Traceback" not in err and f"no space left on device writing {dst.parent / 'activation'}" in err
    monkeypatch.undo()
    assert main(["reorder", str(src), str(dst)]) == 0  # nothing left in the way of a second run
    assert sorted(p.name for p in (dst.parent / "activation").iterdir()) == [
        "activation_0.pt",
        "activation_1.pt",
    ]
