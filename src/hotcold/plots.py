"""Plots of what sparsity does, for `hotcold profile --plot`, `place --plot` and `bench --plot`: pure
functions of the data, one figure each.

- activation locality: per layer, the activation frequency of every neuron, most active first (the
  PowerInfer paper's power law), and the share of neurons that carry 80% of the activations;
- placement: hot neurons per layer (on the GPU) against the layer's width, and how the VRAM budget is
  spent (scratch, attention + KV cache, predictors, output, hot rows);
- bench: tokens/s by thread count or batch size, sparse vs dense.

`*_figure(...)` builds the matplotlib Figure (object-oriented API, Agg canvas: no display, no pyplot
state, safe in threads); `plot_*(..., out)` writes it as a PNG through hotcold.atomic (never over an
input, never a half file). matplotlib is an optional extra (`pip install 'hotcold[plot]'`), imported
only here and only when a plot is made; `require()` says how to install it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from hotcold.atomic import atomic_output, check_output

DPI = 100
WIDE = (11.0, 4.2)  # inches: 1100 x 420 pixels at DPI
LOCALITY_SHARE = 0.8  # "the neurons that carry 80% of the activations"
MISSING = "--plot needs matplotlib, which is not installed: pip install 'hotcold[plot]'"

PathLike = str | os.PathLike[str]


def require() -> None:
    """ValueError naming the extra when matplotlib is missing (call before long work)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(MISSING) from None


def check_png(out: PathLike, inputs: Sequence[PathLike] = ()) -> Path:
    """A PNG output name that is not one of `inputs` (ValueError / OutputError naming the problem)."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"--plot {out}: plots are PNG files; give a name ending in .png")
    return check_output(out, inputs, what="plot")


def _figure(size=WIDE):
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig, out: PathLike, inputs: Sequence[PathLike] = ()) -> None:
    """The figure as a PNG at `out`, written atomically; refused when `out` is one of `inputs`."""
    out = check_png(out, inputs)
    with atomic_output(out, inputs, what="plot") as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)


# ------------------------------------------------------------------------------------------------
# Activation locality
# ------------------------------------------------------------------------------------------------


def _as_array(x) -> np.ndarray:
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float64).reshape(-1)


def neurons_carrying(counts, share: float = LOCALITY_SHARE) -> float:
    """The smallest share of a layer's neurons whose activations add up to `share` of the layer's
    activations (0 when nothing fired)."""
    c = np.sort(_as_array(counts))[::-1]
    total = c.sum()
    if total <= 0:
        return 0.0
    k = int(np.searchsorted(np.cumsum(c), share * total - 1e-9 * total)) + 1
    return min(k, len(c)) / len(c)


def activation_figure(counts: Sequence, *, n_tokens: int | None = None, title: str | None = None):
    """counts: per layer, each neuron's activation count (or frequency) [F]; n_tokens: the tokens they
    were counted over, when known (the curve is then in activations per token)."""
    layers = [_as_array(c) for c in counts]
    if not layers or any(len(c) == 0 for c in layers):
        raise ValueError("no activation statistics to plot (need one non-empty tensor per layer)")
    fig = _figure()
    curve, bars = fig.subplots(1, 2, width_ratios=(1.6, 1))
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    L = len(layers)
    for i, c in enumerate(layers):
        y = np.sort(c)[::-1] / (n_tokens if n_tokens else 1)
        x = 100 * (np.arange(len(y)) + 0.5) / len(y)
        curve.plot(x, np.where(y > 0, y, np.nan), color=cmap(i / max(L - 1, 1)), lw=1.2, label=f"layer {i}")
    curve.set_yscale("log")
    curve.set_xlim(0, 100)
    curve.set_xlabel("neurons of the layer, most active first (%)")
    curve.set_ylabel("activations per token" if n_tokens else "activation count")
    curve.set_title("sorted activation frequency, per layer")
    curve.grid(True, which="major", alpha=0.3)
    if L <= 8:
        curve.legend(fontsize=8, ncols=2)
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        fig.colorbar(ScalarMappable(Normalize(0, L - 1), cmap), ax=curve, label="layer")
    shares = [100 * neurons_carrying(c) for c in layers]
    bars.bar(range(L), shares, color=[cmap(i / max(L - 1, 1)) for i in range(L)])
    bars.axhline(100 * LOCALITY_SHARE, color="0.5", ls=":", lw=1)  # what no locality would need
    bars.set_ylim(0, 100)
    bars.set_xlabel("layer")
    bars.set_ylabel(f"% of neurons carrying {100 * LOCALITY_SHARE:.0f}% of activations")
    bars.set_title(f"mean {np.mean(shares):.1f}% (dotted: 80%, no locality)")
    if title:
        fig.suptitle(title)
    return fig


def plot_activations(
    counts: Sequence,
    out: PathLike,
    *,
    n_tokens: int | None = None,
    title: str | None = None,
    inputs: Sequence[PathLike] = (),
) -> None:
    save(activation_figure(counts, n_tokens=n_tokens, title=title), out, inputs)


# ------------------------------------------------------------------------------------------------
# Placement
# ------------------------------------------------------------------------------------------------

BUDGET_PARTS = (
    ("scratch", "scratch"),
    ("attention", "attention + KV"),
    ("predictors", "predictors"),
    ("output", "output"),
    ("hot", "hot FFN rows"),
    ("unused", "unused"),
)


def placement_figure(
    hot_per_layer: Sequence[int],
    n_ff: int,
    *,
    budget_bytes: int,
    spent: Mapping[str, int],
    title: str | None = None,
):
    """hot_per_layer: hot neurons per layer; spent: bytes of the budget by part (scratch, attention,
    predictors, output, hot: the keys of BUDGET_PARTS; unused is what the others leave)."""
    hot = np.asarray(hot_per_layer, dtype=np.int64)
    if len(hot) == 0 or n_ff < 1:
        raise ValueError("no placement to plot (need hot neuron counts for at least one layer)")
    fig = _figure()
    layers, budget = fig.subplots(1, 2, width_ratios=(1.6, 1))
    L = len(hot)
    layers.bar(range(L), n_ff, color="#d9d9d4", label="cold (on the CPU)")
    layers.bar(range(L), hot, color="#b5462f", label="hot (on the GPU)")
    layers.set_ylim(0, n_ff * 1.22)  # room for the legend above the bars
    layers.set_xlabel("layer")
    layers.set_ylabel("FFN neurons")
    layers.set_title(
        f"hot neurons per layer: {hot.sum():,} of {L * n_ff:,} ({100 * hot.sum() / (L * n_ff):.1f}%)"
    )
    layers.legend(fontsize=8, loc="upper center", ncols=2)
    mib = 2**20
    parts = {k: max(int(spent.get(k, 0)), 0) for k, _ in BUDGET_PARTS[:-1]}
    parts["unused"] = max(budget_bytes - sum(parts.values()), 0)
    left = 0.0
    colors = ("#8c8c86", "#4c72b0", "#55a868", "#8172b2", "#b5462f", "#ecece6")
    for (key, label), color in zip(BUDGET_PARTS, colors):
        width = parts[key] / mib
        budget.barh([0], [width], left=left, color=color, label=f"{label} {width:,.1f}")
        left += width
    budget.axvline(budget_bytes / mib, color="k", lw=1.2, ls="--")
    budget.set_yticks([])
    budget.set_xlabel("MiB of the VRAM budget")
    budget.set_title(f"VRAM budget {budget_bytes / mib:,.1f} MiB (dashed)")
    budget.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=2)
    if title:
        fig.suptitle(title)
    return fig


def plot_placement(
    hot_per_layer: Sequence[int],
    n_ff: int,
    out: PathLike,
    *,
    budget_bytes: int,
    spent: Mapping[str, int],
    title: str | None = None,
    inputs: Sequence[PathLike] = (),
) -> None:
    fig = placement_figure(hot_per_layer, n_ff, budget_bytes=budget_bytes, spent=spent, title=title)
    save(fig, out, inputs)


# ------------------------------------------------------------------------------------------------
# Bench
# ------------------------------------------------------------------------------------------------


def bench_figure(rows: Sequence[Mapping], *, title: str | None = None):
    """rows: `hotcold bench --json` rows (mode, test, batch, threads, tokens_per_s). The x axis is the
    thread count when the rows have several, else the batch size; one line per mode (and per batch size
    when both vary); prompt processing gets its own panel when threads vary (it has no batch size)."""
    if not rows:
        raise ValueError("no bench results to plot")
    by_threads = len({r["threads"] for r in rows}) > 1
    kinds = ["pp", "tg"] if by_threads else ["tg"]
    panels = [(k, [r for r in rows if r["test"].startswith(k)]) for k in kinds]
    panels = [(k, rs) for k, rs in panels if rs]
    if not panels:
        raise ValueError(
            "nothing to plot: bench --plot draws tokens/s by batch size (-n > 0 with -b 1,4,8) or by thread "
            "count (-t 1,2)"
        )
    fig = _figure((5.5 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    several_batches = by_threads and len({r["batch"] for r in rows}) > 1
    styles = {"sparse": ("#b5462f", "-", "o"), "dense": ("#4c72b0", "--", "s")}
    for ax, (kind, rs) in zip(axes, panels):
        series: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for r in rs:
            key = (r["mode"], r["batch"] if several_batches else 0)
            series.setdefault(key, []).append((r["threads"] if by_threads else r["batch"], r["tokens_per_s"]))
        for (mode, batch), points in sorted(series.items()):
            points.sort()
            color, ls, marker = styles.get(mode, ("0.3", "-", "^"))
            label = mode if not batch else f"{mode}, batch {batch}"
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], color=color, ls=ls, marker=marker, label=label
            )
        xs = sorted({r["threads"] if by_threads else r["batch"] for r in rs})
        ax.set_xticks(xs)
        ax.set_xlabel("threads" if by_threads else "batch size (sequences decoding together)")
        ax.set_ylabel("tokens/s" if kind == "pp" or by_threads else "tokens/s (all sequences)")
        n = rs[0]["test"].removeprefix(kind).split("x")[0]
        ax.set_title(("prompt processing" if kind == "pp" else "generation") + f" ({kind}{n})")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def plot_bench(
    rows: Sequence[Mapping], out: PathLike, *, title: str | None = None, inputs: Sequence[PathLike] = ()
) -> None:
    save(bench_figure(rows, title=title), out, inputs)
