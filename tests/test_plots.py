"""hotcold.plots: each figure has the axes it promises, the locality figure's numbers equal a direct count,
and the PNG writer follows hotcold.atomic's rules (no half files, never over an input)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from hotcold import plots

pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install 'hotcold[plot]')")
from PIL import Image  # noqa: E402  (matplotlib depends on Pillow)

PIXELS = (int(plots.WIDE[0] * plots.DPI), int(plots.WIDE[1] * plots.DPI))


def power_law(n: int, alpha: float, seed: int) -> torch.Tensor:
    ranks = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1
    return (1e5 * ranks.double() ** -alpha).round().long()


def test_neurons_carrying_equals_a_direct_count():
    assert plots.neurons_carrying(torch.ones(100)) == pytest.approx(0.80)
    assert plots.neurons_carrying(torch.tensor([80, 5, 5, 5, 5])) == pytest.approx(0.2)
    assert plots.neurons_carrying(torch.tensor([79, 6, 5, 5, 5])) == pytest.approx(0.4)
    assert plots.neurons_carrying(torch.zeros(10)) == 0.0
    c = power_law(1024, 1.2, seed=0).numpy()
    s = np.sort(c)[::-1]
    k = next(i + 1 for i in range(len(s)) if s[: i + 1].sum() >= 0.8 * s.sum())
    assert plots.neurons_carrying(c) == k / len(c)


def test_activation_figure_axes_and_png(tmp_path):
    counts = [power_law(1280, a, seed=i) for i, a in enumerate((0.6, 1.0, 1.4))]
    fig = plots.activation_figure(counts, n_tokens=500, title="t")
    curve, bars = fig.axes[:2]
    assert curve.get_xlabel().startswith("neurons of the layer") and curve.get_yscale() == "log"
    assert curve.get_ylabel() == "activations per token" and len(curve.get_lines()) == 3
    top = curve.get_lines()[0].get_ydata()
    assert top[0] == pytest.approx(counts[0].max().item() / 500) and np.all(np.diff(top) <= 0)
    assert bars.get_xlabel() == "layer" and "80% of activations" in bars.get_ylabel()
    heights = [p.get_height() for p in bars.patches]
    assert heights == pytest.approx([100 * plots.neurons_carrying(c) for c in counts])
    assert heights[0] > heights[1] > heights[2]  # the steeper the power law, the fewer carry 80%
    assert plots.activation_figure(counts).axes[0].get_ylabel() == "activation count"  # tokens unknown
    many = plots.activation_figure([power_law(256, 1.0, seed=i) for i in range(12)])
    assert any(ax.get_ylabel() == "layer" for ax in many.axes)  # a colour bar instead of 12 legend lines
    out = tmp_path / "locality.png"
    plots.plot_activations(counts, out)
    assert Image.open(out).size == PIXELS
    assert [p.name for p in tmp_path.iterdir()] == ["locality.png"]  # no temporary file left


def test_placement_figure_axes():
    spent = {
        "scratch": 10 << 20,
        "attention": 5 << 20,
        "predictors": 1 << 20,
        "output": 4 << 20,
        "hot": 9 << 20,
    }
    fig = plots.placement_figure([1024, 512, 0], 1024, budget_bytes=30 << 20, spent=spent)
    layers, budget = fig.axes[:2]
    assert layers.get_xlabel() == "layer" and layers.get_ylabel() == "FFN neurons"
    assert [p.get_height() for p in layers.patches] == [1024] * 3 + [1024, 512, 0]  # cold behind, hot
    assert "1,536 of 3,072 (50.0%)" in layers.get_title()
    assert budget.get_xlabel() == "MiB of the VRAM budget"
    widths = [p.get_width() for p in budget.patches]
    assert widths == pytest.approx([10, 5, 1, 4, 9, 1])  # the parts, then what is unused
    with pytest.raises(ValueError, match="no placement"):
        plots.placement_figure([], 1024, budget_bytes=1, spent={})


def rows(mode_tps: dict, *, key: str, values) -> list[dict]:
    out = []
    for mode, tps in mode_tps.items():
        for v, t in zip(values, tps):
            batch = v if key == "batch" else 1
            test = "tg16" if batch == 1 else f"tg16x{batch}"
            threads = v if key == "threads" else 2
            out.append(dict(mode=mode, test=test, batch=batch, threads=threads, tokens_per_s=t))
            if key == "threads":
                out.append(dict(mode=mode, test="pp32", batch=1, threads=threads, tokens_per_s=10 * t))
    return out


def test_bench_figure_by_batch_or_threads():
    fig = plots.bench_figure(
        rows({"sparse": [5, 12, 20], "dense": [3, 8, 15]}, key="batch", values=[1, 4, 8])
    )
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("batch size") and ax.get_ylabel() == "tokens/s (all sequences)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"sparse", "dense"}
    assert list(lines["sparse"].get_xdata()) == [1, 4, 8] and list(lines["sparse"].get_ydata()) == [5, 12, 20]
    fig = plots.bench_figure(rows({"sparse": [5, 9], "dense": [3, 5]}, key="threads", values=[1, 2]))
    pp, tg = fig.axes
    assert pp.get_xlabel() == tg.get_xlabel() == "threads"
    assert "pp32" in pp.get_title() and "tg16" in tg.get_title()
    assert list(pp.get_lines()[0].get_ydata()) in ([30, 50], [50, 90])
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.bench_figure([dict(mode="sparse", test="pp32", batch=1, threads=2, tokens_per_s=1.0)])


def test_writer_refuses_inputs_and_other_formats(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    link = tmp_path / "link.png"
    link.symlink_to(model)
    counts = [power_law(64, 1.0, seed=0)]
    with pytest.raises(ValueError, match="ending in .png"):
        plots.plot_activations(counts, tmp_path / "out.jpg")
    with pytest.raises(OSError, match="it would be overwritten"):
        plots.plot_activations(counts, link, inputs=[model])
    assert model.read_bytes() == b"GGUF"


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'hotcold\[plot\]'"):
        plots.require()
    with pytest.raises(ValueError, match="hotcold"):
        plots.activation_figure([torch.ones(8)])
