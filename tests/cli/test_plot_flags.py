"""`--plot OUT.png` on profile, place and bench: a PNG of the promised size with the promised axes, the
plotted numbers equal what the command measured or solved, clear errors (a missing extra, a bad name, an
input as the output) before any long work; `hotcold info` points to the plots."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from hotcold import plots
from hotcold.cli import main
from hotcold.placement.profile import write_activation_files
from tests.fixtures import training_text

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'hotcold[plot]')")
from PIL import Image  # noqa: E402

WIDE = (int(plots.WIDE[0] * plots.DPI), int(plots.WIDE[1] * plots.DPI))


@pytest.fixture
def model_dir(tmp_path, tiny_sparse_gguf):
    model = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny_sparse_gguf, model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    return model, corpus


def figures(monkeypatch) -> list:
    """The figures the command saves (kept as it writes them)."""
    seen = []
    save = plots.save

    def keep(fig, out, inputs=()):
        seen.append(fig)
        save(fig, out, inputs)

    monkeypatch.setattr(plots, "save", keep)
    return seen


def test_profile_plot_of_a_new_profile_and_of_stored_statistics(model_dir, tmp_path, capsys, monkeypatch):
    model, corpus = model_dir
    seen = figures(monkeypatch)
    out = tmp_path / "locality.png"
    argv = ["profile", "-m", str(model), "-f", str(corpus), "-c", "64", "--max-tokens", "200"]
    assert main([*argv, "--plot", str(out)]) == 0
    assert Image.open(out).size == WIDE
    curve, bars = seen[0].axes[:2]
    assert curve.get_ylabel() == "activations per token" and len(curve.get_lines()) == 2
    stored = [torch.load(tmp_path / "activation" / f"activation_{i}.pt") for i in range(2)]
    assert [p.get_height() for p in bars.patches] == pytest.approx(
        [100 * plots.neurons_carrying(c) for c in stored]
    )
    err = capsys.readouterr().err
    assert "% of neurons carrying 80% of activations, by layer" in err and str(out) in err

    again = tmp_path / "again.png"  # no corpus: the statistics already beside the model
    assert main(["profile", "-m", str(model), "--plot", str(again)]) == 0
    assert Image.open(again).size == WIDE and seen[1].axes[0].get_ylabel() == "activation count"
    assert [p.get_height() for p in seen[1].axes[1].patches] == [p.get_height() for p in bars.patches]


def test_profile_plot_errors(model_dir, tmp_path, capsys, monkeypatch):
    model, corpus = model_dir
    assert main(["profile", "-m", str(model)]) == 1
    assert "give a corpus (-f/--file), or --plot" in capsys.readouterr().err
    assert main(["profile", "-m", str(model), "--plot", str(tmp_path / "x.png")]) == 1
    assert "no activation statistics in" in capsys.readouterr().err
    assert main(["profile", "-m", str(model), "-f", str(corpus), "--plot", str(tmp_path / "x.svg")]) == 1
    assert "ending in .png" in capsys.readouterr().err
    link = tmp_path / "corpus.png"
    link.symlink_to(corpus)
    assert main(["profile", "-m", str(model), "-f", str(corpus), "--plot", str(link)]) == 1
    err = capsys.readouterr().err
    assert "it would be overwritten" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["profile", "-m", str(model), "-f", str(corpus), "--plot", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "pip install 'hotcold[plot]'" in err and "Traceback" not in err
    assert not (tmp_path / "activation").exists()  # refused before profiling


def test_place_plot_shows_the_solved_placement(model_dir, tmp_path, capsys, monkeypatch):
    model, _ = model_dir
    g = torch.Generator().manual_seed(0)
    write_activation_files(
        [torch.randint(0, 1000, (1280,), generator=g) for _ in range(2)], tmp_path / "activation"
    )
    seen = figures(monkeypatch)
    out = tmp_path / "placement.png"
    assert main(["place", "-m", str(model), "--vram-budget", "0.05", "--json", "--plot", str(out)]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert Image.open(out).size == WIDE
    layers, budget = seen[0].axes[:2]
    assert layers.get_xlabel() == "layer" and layers.get_ylabel() == "FFN neurons"
    hot = [p.get_height() for p in layers.patches][2:]  # after the two layers' full-width bars
    assert hot == solved["hot_neurons_per_layer"]
    assert budget.get_xlabel() == "MiB of the VRAM budget"
    assert sum(p.get_width() for p in budget.patches) == pytest.approx(solved["budget_bytes"] / 2**20)

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["place", "-m", str(model), "--vram-budget", "0.05", "--plot", str(out)]) == 1
    assert "pip install 'hotcold[plot]'" in capsys.readouterr().err


def test_bench_plot_by_batch_and_by_threads(tiny_sparse_gguf, tmp_path, capsys, monkeypatch):
    seen = figures(monkeypatch)
    base = ["bench", "-m", str(tiny_sparse_gguf), "-p", "8", "-n", "4", "-r", "1", "--json"]
    out = tmp_path / "batch.png"
    assert main([*base, "-b", "1,2", "--plot", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    (ax,) = seen[0].axes
    assert ax.get_xlabel().startswith("batch size") and Image.open(out).size == (550, 420)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"sparse", "dense"}
    tg = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "sparse" and r["test"].startswith("tg")}
    assert list(lines["sparse"].get_xdata()) == [1, 2] and list(lines["sparse"].get_ydata()) == [tg[1], tg[2]]

    out = tmp_path / "threads.png"
    assert main([*base, "-t", "1,2", "--mode", "sparse", "--plot", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted({r["threads"] for r in rows}) == [1, 2]
    pp, tg = seen[1].axes
    assert pp.get_xlabel() == tg.get_xlabel() == "threads" and Image.open(out).size == (1100, 420)

    assert main([*base, "-t", "1,x"]) == 1
    assert "-t/--threads must be an integer >= 1 or comma-separated" in capsys.readouterr().err
    assert main([*base, "-t", "0"]) == 1
    assert "-t/--threads must be >= 1" in capsys.readouterr().err


def test_info_points_to_the_plots(capsys):
    assert main(["info"]) == 0
    assert "--plot locality.png" in capsys.readouterr().out
