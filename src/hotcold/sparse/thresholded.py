"""Training-free activation sparsity for SwiGLU and GeGLU FFNs (files written by `hotcold sparsify`).

CATS rule: neuron i of a token is computed iff its score |act(gate_i . h)| is above the layer's
threshold (the "wina" method weights the score by |down_t[i]|, the neuron's output norm). The gate is
computed densely (the dense matvec kernels, packed where the type has a packed form); up only for the
kept rows (row-gather GEMV with the per-token mask) and down as the axpy over `ffn_down_t` for the kept
neurons: a decode token reads all of gate and (1 - sparsity) of up and down. With a gate probe (a Q4_0
copy of the gate, `blk.N.ffn_gate_probe`, written by `hotcold sparsify --gate-probe`) the score comes
from the probe, read whole, and the exact gate is gathered for the kept rows only, as up is: a 16-bit
file then reads 0.28 of the gate + (1 - sparsity) of gate, up and down per token.

Masks are per token and, below `cpu.GEMM_MIN_TOKENS` rows, every kernel computes each row on its own
(the C kernels' contract), so a row's bits do not depend on the batch (batching.py). From that many rows
on (prefill), the same masked function is computed with the dense GEMM path and the file's own
`ffn_down`: every row is wanted by some token there, and GEMM is compute-bound, not bandwidth-bound.

The file keeps, per layer, the quantiles of the score over the calibration tokens on a grid of levels,
so a threshold can be derived for any sparsity at load (`--sparsity`): `threshold_at` interpolates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from hotcold.device import place
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.kernels import cpu, ffn_calls
from hotcold.ops import Norm, Weight, linear, uses_c_kernels
from hotcold.runtime.state import Batch
from hotcold.sparse import tails
from hotcold.sparse.ffn import FFN
from hotcold.sparse.ffn_weights import ACTIVATIONS, FFNWeights

METHODS = ("cats", "wina")
CPU = torch.device("cpu")


def threshold_at(grid: torch.Tensor, quantiles: torch.Tensor, sparsity: float) -> float:
    """The score below which a share `sparsity` of the calibration scores fall: `quantiles` [G] at the
    increasing levels `grid` [G] (0 .. 1), linearly interpolated between levels."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    g = grid.double()
    j = int(torch.searchsorted(g, torch.tensor(sparsity, dtype=torch.float64), right=True))
    j = min(max(j, 1), len(g) - 1)
    lo, hi = float(g[j - 1]), float(g[j])
    w = 0.0 if hi == lo else (sparsity - lo) / (hi - lo)
    w = min(max(w, 0.0), 1.0)
    return float(quantiles[j - 1]) * (1.0 - w) + float(quantiles[j]) * w


@dataclass(frozen=True)
class SparsifyAssets:
    """What `hotcold sparsify` stored: the method, the target sparsity, each layer's threshold at it, the
    quantile table (quantiles [L, G] at levels grid [G]) for any other sparsity, the share of calibration
    tokens keeping each neuron at the target (frequency [L, F], the activation statistics hot/cold
    placement ranks neurons by) and, for wina, the per-neuron score weights (scale [L, F])."""

    method: str
    sparsity: float
    thresholds: tuple[float, ...]
    grid: torch.Tensor
    quantiles: torch.Tensor
    frequency: torch.Tensor | None
    scale: torch.Tensor | None
    tokens: int
    gate_in: tuple[torch.Tensor, torch.Tensor | None] | None = None  # --gate-probe inputs: [L, G], [L, D]

    def threshold(self, layer: int, sparsity: float) -> float:
        """Layer's threshold for `sparsity`: the stored one at the file's target, else from the table."""
        if math.isclose(sparsity, self.sparsity, rel_tol=0.0, abs_tol=1e-9):
            return self.thresholds[layer]
        return threshold_at(self.grid, self.quantiles[layer], sparsity)

    @classmethod
    def from_file(cls, mf: ModelFile, n_layer: int, n_ff: int) -> SparsifyAssets:
        """Read and check the keys and tensors; GGUFError naming the file and the part that is wrong."""
        meta, path = mf.metadata, mf.path

        def need(key):
            if key not in meta:
                raise GGUFError(
                    f"{path}: has {names.SPARSIFY_SPARSITY} but no {key} (a damaged sparsify output)"
                )
            return meta[key]

        def table(name, shape):
            entry = mf.entry(name, shape)
            return mf.tensor(entry.name).float().clone()

        method = need(names.SPARSIFY_METHOD)
        if method not in METHODS:
            raise GGUFError(f"{path}: {names.SPARSIFY_METHOD} {method!r} is not one of {METHODS}")
        sparsity = float(need(names.SPARSIFY_SPARSITY))
        thresholds = tuple(float(t) for t in need(names.SPARSIFY_THRESHOLDS))
        grid = torch.tensor(need(names.SPARSIFY_GRID), dtype=torch.float64)
        if not 0.0 < sparsity < 1.0 or len(thresholds) != n_layer:
            raise GGUFError(
                f"{path}: sparsify target {sparsity} / {len(thresholds)} thresholds for {n_layer} layers"
            )
        if len(grid) < 2 or bool((grid[1:] <= grid[:-1]).any()) or grid[0] != 0.0 or grid[-1] != 1.0:
            raise GGUFError(f"{path}: {names.SPARSIFY_GRID} must rise from 0 to 1")
        quantiles = table(names.SPARSIFY_QUANTILES, (n_layer, len(grid)))
        freq = (
            table(names.SPARSIFY_FREQUENCY, (n_layer, n_ff))
            if names.SPARSIFY_FREQUENCY in mf.tensors
            else None
        )
        scale = table(names.SPARSIFY_SCALE, (n_layer, n_ff)) if method == "wina" else None
        tokens = int(meta.get(names.SPARSIFY_TOKENS, 0))
        gate_in = None
        if names.SPARSIFY_GATE_IN_QUANTILES in mf.tensors:
            table_in = table(names.SPARSIFY_GATE_IN_QUANTILES, (n_layer, len(grid)))
            scale_in = None
            if method == "wina":
                d = mf.entry(names.SPARSIFY_GATE_IN_SCALE).shape[-1]
                scale_in = table(names.SPARSIFY_GATE_IN_SCALE, (n_layer, d))
            gate_in = (table_in, scale_in)
        return cls(method, sparsity, thresholds, grid, quantiles, freq, scale, tokens, gate_in)


# a prompt chunk of this many rows or more takes the masked dense path (benchmarks/RESULTS_LOG.md)
PROMPT_DENSE_ROWS = 4


def prompt_rows(ctx, t: int) -> torch.Tensor | None:
    """bool [t]: the rows of a forward of fewer than GEMM_MIN_TOKENS rows that belong to prompt chunks of at
    least PROMPT_DENSE_ROWS rows (segments that long), or None where there are none. Such a chunk's products
    run through the dense kernels (the masked input or activations; every row's bits its own below
    GEMM_MIN_TOKENS) instead of the row kernels: from 4 rows that is faster on a sparsified file, where about
    half of each token's rows are kept and so nearly every row by some token. The rule depends on the chunk
    alone (the batch scheduler never splits one), so a row's bits still do not depend on its batch."""
    bounds = getattr(ctx, "bounds", None)
    if bounds is None or not 0 < t < cpu.GEMM_MIN_TOKENS:
        return None
    chunks = [(a, b) for a, b in bounds if b - a >= PROMPT_DENSE_ROWS]
    if not chunks:
        return None
    sel = torch.zeros(t, dtype=torch.bool)
    for a, b in chunks:
        sel[a:b] = True
    return sel


def input_scores(h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """An input rule's channel scores: |h_i|, times the channel weight scale_i (wina) where given."""
    score = h.abs()
    return score if scale is None else score * scale.to(h.device)


def kept_channels(h: torch.Tensor, scale: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """bool, h's shape: the input channels an input rule keeps (compared in float32, as the C kernels)."""
    return input_scores(h, scale) > threshold


@dataclass(frozen=True)
class GateInputs:
    """The gate from each token's FFN input channels over a threshold only (sparsify --gate-probe inputs,
    TEAL's rule on the gate's input, WINA-weighted by scale [D]): gate_t [D, F] is the gate transposed, its
    product both the neurons' score and their activation (no exact gate is read)."""

    gate_t: Weight
    scale: torch.Tensor | None
    threshold: float

    def gate(self, h: torch.Tensor, gate: Weight, *, rows: bool, threads: int | None) -> torch.Tensor:
        """[T, F]: the axpy over gate_t of the kept channels (rows: the C kernels, few tokens), else the masked
        input through the gate (GEMM)."""
        mask = kept_channels(h, self.scale, self.threshold)
        if rows:
            return cpu.sparse_axpy(self.gate_t, h.to(CPU).contiguous(), mask.to(CPU), threads=threads).to(
                h.device
            )
        return linear(torch.where(mask, h, 0.0), gate)


class ThresholdedFFN(FFN):
    """A SwiGLU or GeGLU FFN computing, per token, only the neurons whose score is over the layer's threshold.

    weights: gate [F, D] (multiplied whole), up [F, D] and down_t [F, D] (gathered row by row), kind
    "gated", SiLU or GELU (the C step: SiLU only), and down: the file's ffn_down [D, F] for many-row forwards (None: the axpy there too);
    scale: [F] per-neuron score weights (None: CATS); probe: [F, D] a cheaper copy of the gate the score
    is computed from (None: the gate itself, then multiplied whole); up_rows / gate_rows: copies of up and
    the gate (names.FFN_UP_ROWS) the row kernels gather from instead (None: the matrices themselves), so
    weights.up and weights.gate serve only the dense products and may be packed.

    For a few tokens on the CPU the step is one C call (`ffn_calls.ThresholdedPlan`, the norm folded in),
    and a decode layer's o projection, residuals and this step another (tails.ThresholdedTail, also for the
    one-call decode token), each with the bits of the ops one by one; a dense forward takes the dense
    tail."""

    tail_type = tails.ThresholdedTail

    def __init__(
        self,
        weights: FFNWeights,
        threshold: float,
        *,
        layer: int,
        norm: Norm | None = None,
        down: Weight | None = None,
        scale: torch.Tensor | None = None,
        probe: Weight | None = None,
        gate_in: GateInputs | None = None,
        up_rows: Weight | None = None,
        gate_rows: Weight | None = None,
        threads: int | None = None,
    ):
        if weights.gate is None or weights.down_t is None or weights.kind != "gated":
            raise ValueError("a thresholded FFN needs gate, up and ffn_down_t of a gated (SwiGLU) FFN")
        self.weights, self.threshold, self.norm = weights, float(threshold), norm
        self.layer, self.expert, self.down, self.scale, self.threads = layer, None, down, scale, threads
        self.probe, self.gate_in = probe, gate_in
        self.act = ACTIVATIONS[weights.activation]  # the C kernels' SiLU / GELU on CPU float32
        self.up_rows = weights.up if up_rows is None else up_rows
        self.gate_rows = weights.gate if gate_rows is None else gate_rows
        devices = {_device(m).type for m in (self.gate_rows, self.up_rows, weights.down_t)}
        self.gathers = devices == {"cpu"} and cpu.backend() == "c"  # the row kernels, else dense-masked
        self.plan = self._c_plan()

    def _c_plan(self) -> ffn_calls.ThresholdedPlan | None:
        """The C step's plan where its weights can run in C (the row kernels on the CPU), else None."""
        w = self.weights
        score = self.probe if self.probe is not None else w.gate
        if self.gate_in is not None:
            score = self.gate_in.gate_t
        if (
            not self.gathers
            or w.activation not in ffn_calls.C_ACTIVATIONS  # SiLU, Gemma's GELU (tanh), ...: the C step's act
            or not uses_c_kernels(score)
            or (self.scale is not None and self.scale.device.type != "cpu")
        ):
            return None
        try:
            g = self.gate_in
            return ffn_calls.ThresholdedPlan(
                score, self.up_rows, self.gate_rows if self.probe is not None else None, w.down_t,
                threshold=self.threshold, scale=self.scale, score_in=None if g is None else (g.scale, g.threshold),
                activation=w.activation,
            )  # fmt: skip
        except ValueError:
            return None

    def plan_for(self, x: torch.Tensor, ctx: Batch) -> ffn_calls.ThresholdedPlan | None:
        """The one-call step where it has the op-by-op bits: a few CPU rows (below GEMM_MIN_TOKENS `matmul`
        multiplies every weight of the C kernels' types in C, the score matrix included)."""
        t = x.shape[0] if x.dim() == 2 else 0
        if ctx.dense or x.device.type != "cpu" or not 0 < t < cpu.GEMM_MIN_TOKENS:
            return None
        return self.plan

    def __call__(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor:
        plan = self.plan_for(x, ctx)
        if (
            plan is None
            or self.norm is None
            or not self.norm.folds_into_c(x)
            or self.prompt_rows_of(x, ctx) is not None
        ):
            return super().__call__(x, ctx)
        out, mask, kept = plan(x, norm=self.norm.c_args, threads=self.threads)
        self.record(ctx, x, mask, kept)
        return out

    def prompt_rows_of(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
        """The rows of prompt chunks that take the masked dense path (prompt_rows), where the row kernels run.
        Not with a gate probe that gathers from the gate itself: that gate stays in the row layout, and the dense
        products of row-layout matrices lost to the row kernels (a 52-token prompt 94 against 103 t/s, 1B F16)."""
        row_gate = self.probe is not None and self.gate_rows is self.weights.gate
        if not self.gathers or row_gate or x.device.type != "cpu" or x.dim() != 2:
            return None
        return prompt_rows(ctx, x.shape[0])

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        w = self.weights
        if ctx.dense:  # the reference: every neuron
            a = self.act(linear(h, w.gate)) * linear(h, w.up)
            if ctx.observe is not None:
                ctx.observe(self.layer, h, p, a)
            ctx.count_all(self.layer, a)
            return self._down_dense(a, h.device)
        chunk = self.prompt_rows_of(h, ctx)
        if chunk is None:
            out, mask, kept = self._step(h, rows=self.gathers and h.shape[0] < cpu.GEMM_MIN_TOKENS, ctx=ctx)
        else:  # prompt chunks' rows through the dense products, the others (decode rows) through the row kernels
            out = h.new_empty(h.shape[0], h.shape[1])
            mask = torch.zeros(h.shape[0], self.n_ff, dtype=torch.bool)
            kept = None
            for sel, rows in ((chunk, False), (~chunk, True)):
                if bool(sel.any()):
                    out[sel], mask[sel], _ = self._step(h[sel].contiguous(), rows=rows, ctx=ctx)
        self.record(ctx, p, mask, kept)
        return out

    def _step(
        self, h: torch.Tensor, *, rows: bool, ctx: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(out, mask, kept count or None) of h's rows: the row kernels (rows; the C step where it applies),
        else the masked input and activations through the dense products."""
        w = self.weights
        if rows and (plan := self.plan_for(h, ctx)) is not None:
            return plan(h, threads=self.threads)
        probe = self.probe is not None
        if self.gate_in is not None:  # the gate of the kept input channels: score and activation
            act = self.act(self.gate_in.gate(h, w.gate, rows=rows, threads=self.threads))
        else:
            act = self.act(linear(h, self.probe if probe else w.gate))  # [T, F]: every row
        score = act.abs() if self.scale is None else act.abs() * self.scale.to(act.device)
        mask = score > self.threshold  # [T, F] bool, per token (compared in float32, as the C step)
        if rows:
            hc, mc = h.to(CPU), mask.to(CPU)
            if probe:  # the exact gate of the kept rows
                act = self.act(cpu.gather_matvec(self.gate_rows, hc, mc, threads=self.threads))
            up = cpu.gather_matvec(self.up_rows, hc, mc, threads=self.threads)
            a = torch.where(mc, act.to(CPU) * up, 0.0)
            out = cpu.sparse_axpy(w.down_t, a, mc, threads=self.threads).to(h.device)
        else:
            if probe:
                act = self.act(linear(h, w.gate))
            a = torch.where(mask, act * linear(h, w.up), 0.0)
            out = self._down_dense(a, h.device)
        return out, mask, None

    def dense_down(self) -> tuple[Weight, bool]:
        return (self.down, False) if self.down is not None else (self.weights.down_t, True)

    def _down_dense(self, a: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.down is not None:
            return linear(a, self.down)
        return cpu.sparse_axpy(self.weights.down_t, a.to(CPU), None, threads=self.threads).to(device)


def _device(weight: Weight) -> torch.device:
    return weight.device if isinstance(weight, torch.Tensor) else weight.data.device


def thresholded_maker(src, assets: SparsifyAssets, sparsity: float, *, threads: int | None = None):
    """make_ffn for the families (loader.py): each layer's ThresholdedFFN at `sparsity`; the matrices only
    ever multiplied whole packed: ffn_down, the gate (unless a probe's gathers read it) and, where the file has
    row copies for the gathers (names.FFN_UP_ROWS), up."""

    def make(layer: int, weights: FFNWeights, predictor, norm, *, expert: int | None = None):
        if expert is not None:
            raise ValueError(f"{src.path}: thresholded sparsity does not run mixture-of-experts layers")
        device, c = src.plan.ffn[layer], src.config
        down = None
        if src.has(names.FFN_DOWN, layer):
            # only many-row forwards and prompt chunks multiply it, always whole: packed, its file rows paged
            # out (pp52 of a 1B-shaped file 110 -> 126 t/s, benchmarks/RESULTS_LOG.md 2026-12-03)
            down = src.pack(place(src.raw(names.FFN_DOWN, layer, (c.n_embd, c.n_ff)), device))
        scale = None if assets.scale is None else assets.scale[layer]
        probe = gate_in = None
        if src.has(names.FFN_GATE_PROBE, layer):
            probe = src.pack(place(src.raw(names.FFN_GATE_PROBE, layer, (c.n_ff, c.n_embd)), device))
        if assets.gate_in is not None and src.has(names.FFN_GATE_T, layer):
            table, in_scale = assets.gate_in
            gate_in = GateInputs(
                place(src.raw(names.FFN_GATE_T, layer, (c.n_embd, c.n_ff)), device),
                None if in_scale is None else in_scale[layer],
                threshold_at(assets.grid, table[layer], sparsity),
            )
        up_rows = gate_rows = None  # the row kernels' copies: on the CPU only (a GPU runs the dense products)
        if device.type == "cpu" and src.has(names.FFN_UP_ROWS, layer):
            up_rows = place(src.raw(names.FFN_UP_ROWS, layer, (c.n_ff, c.n_embd)), device)
            weights = replace(weights, up=src.pack(weights.up))  # the dense products' only
        if device.type == "cpu" and probe is not None and src.has(names.FFN_GATE_ROWS, layer):
            gate_rows = place(src.raw(names.FFN_GATE_ROWS, layer, (c.n_ff, c.n_embd)), device)
        return ThresholdedFFN(
            weights
            if probe is not None and gate_rows is None
            else replace(weights, gate=src.pack(weights.gate)),
            assets.threshold(layer, sparsity),
            layer=layer,
            norm=None if norm is None else norm.to(device),
            down=down,
            scale=scale,
            probe=probe,
            gate_in=gate_in,
            up_rows=up_rows,
            gate_rows=gate_rows,
            threads=threads,
        )

    return make
