"""`hotcold sparsify`'s input rules: input channels of a product skipped per token (TEAL's rule, WINA's weights).

Two of them, each optional: `--attention` (the inputs of q/k/v and of o; sparse/attention_inputs.py) and
`--gate-probe inputs` (the FFN input of the gate, whose product then scores and activates the neurons;
sparse/thresholded.GateInputs). Here: the calibration of their input scores (|h_i|, times the product's
column norm over channel i for wina) into log-spaced histograms, and what the output file gets for them:
the transposed matrices the axpy kernels read (row i = channel i's output direction) and the quantile tables
any sparsity's threshold is derived from at load. Also the type of every copy the decode reads (transpose_type:
`--transpose-type`, Q8_0 for float sources by default; an exact transpose where it is the source's own float
type, else re-quantized along the new rows, F16 where the block does not divide a row) and the row copies of up
and the gate (row_copy_specs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from hotcold.config import ModelConfig
from hotcold.convert import encode
from hotcold.gguf import names, quants
from hotcold.gguf.io import ModelFile, TensorSpec, as_torch
from hotcold.kernels import cpu
from hotcold.sparse.attention_inputs import attention_scales, column_norms
from hotcold.sparse.thresholded import input_scores

TRANSPOSE_TYPES = ("auto", "same", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k")
FLOAT_SOURCES = (Q.F32, Q.F16, Q.BF16)
# the transposes of float sources by default: decode-kernel perplexity within 0.04% of exact copies on the
# trained SwiGLU model, about half their bytes (benchmarks/RESULTS_LOG.md 2026-12-03)
AUTO_FLOAT_TRANSPOSE = Q.Q8_0
GRID = tuple(round(i / 100, 2) for i in range(101))  # quantile levels 0, 0.01, .., 1
LOG_LO, LOG_HI, BINS = -12.0, 4.0, 16384  # layer histograms over log10(score)
NEURON_BINS = 256  # per-neuron histograms: 1/16 decade each


class ScoreHistograms:
    """Per-layer fine and per-neuron coarse histograms of log10(score); scores <= 1e-12 in the first bin."""

    def __init__(self, n_layer: int, n_ff: int):
        """n_ff 0: the layer histograms only."""
        self.n_ff = n_ff
        self.layer = torch.zeros(n_layer, BINS, dtype=torch.int64)
        self.neuron = torch.zeros(n_layer, n_ff * NEURON_BINS, dtype=torch.int32)
        self.tokens = [0] * n_layer
        self._offsets = torch.arange(n_ff) * NEURON_BINS

    def add(self, layer: int, score: torch.Tensor) -> None:
        """score [T, F] >= 0."""
        pos = (score.float().clamp_min(10.0**LOG_LO).log10() - LOG_LO) * (BINS / (LOG_HI - LOG_LO))
        b = pos.long().clamp_(0, BINS - 1)
        self.layer[layer] += torch.bincount(b.flatten(), minlength=BINS)
        self.tokens[layer] += score.shape[0]
        if not self.n_ff:
            return
        coarse = b // (BINS // NEURON_BINS) + self._offsets  # [T, F]
        self.neuron[layer] += torch.bincount(coarse.flatten(), minlength=self.n_ff * NEURON_BINS).int()

    def quantile(self, layer: int, q: float) -> float:
        """The score below which a share q of the layer's scores lie (log-linear inside a bin)."""
        hist = self.layer[layer].double()
        cdf = hist.cumsum(0)
        target = q * float(cdf[-1])
        j = int(torch.searchsorted(cdf, torch.tensor(target, dtype=torch.float64)))
        j = min(j, BINS - 1)
        below = float(cdf[j - 1]) if j else 0.0
        frac = 0.0 if hist[j] == 0 else min(max((target - below) / float(hist[j]), 0.0), 1.0)
        return 10.0 ** (LOG_LO + (j + frac) * (LOG_HI - LOG_LO) / BINS)

    def table(self, layer: int) -> list[float]:
        """The layer's quantiles at the GRID levels."""
        return [self.quantile(layer, q) for q in GRID]

    def kept_frequency(self, layer: int, threshold: float) -> torch.Tensor:
        """[F]: share of the layer's tokens whose score exceeds threshold, per neuron (coarse bins)."""
        width = (LOG_HI - LOG_LO) / NEURON_BINS
        pos = (np.log10(max(threshold, 10.0**LOG_LO)) - LOG_LO) / width
        k = min(int(pos), NEURON_BINS - 1)
        h = self.neuron[layer].view(self.n_ff, NEURON_BINS).double()
        kept = h[:, k + 1 :].sum(1) + (1.0 - (pos - k)) * h[:, k]
        return (kept / max(1, self.tokens[layer])).float()


@dataclass
class InputTables:
    """The calibrated input rules: quantiles at GRID of the q/k/v and o input scores [L, 2, G] and of the gate's
    [L, G] (None where that rule was not asked for), and for wina their channel weights."""

    attn_quantiles: torch.Tensor | None
    attn_scales: tuple[torch.Tensor, torch.Tensor] | None  # [L, D], [L, H*Dh]
    gate_quantiles: torch.Tensor | None
    gate_scale: torch.Tensor | None  # [L, D]


class InputCalibration:
    """Observers of a calibration run's attention inputs (models/llama.py calls `attention`) and FFN inputs
    (`ffn_input`, from the FFN observer), then `tables()`."""

    def __init__(self, mf: ModelFile, config: ModelConfig, *, attention: bool, gate: bool, wina: bool):
        c, L = config, config.n_layer
        self.path = mf.path
        self.attn = [ScoreHistograms(L, 0) for _ in range(2)] if attention else None
        self.gate = ScoreHistograms(L, 0) if gate else None
        self.attn_scales = self.gate_scale = None
        if attention and wina:
            pairs = [attention_scales(mf, i, c) for i in range(L)]
            self.attn_scales = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
        if gate and wina:
            shape = (c.n_ff, c.n_embd)
            self.gate_scale = torch.stack(
                [column_norms([_floats(mf, names.tensor(names.FFN_GATE, i), shape)]) for i in range(L)]
            )

    def attention(self, layer: int, which: int, h: torch.Tensor) -> None:
        scales = self.attn_scales
        self.attn[which].add(layer, input_scores(h.float(), None if scales is None else scales[which][layer]))

    def ffn_input(self, layer: int, h: torch.Tensor) -> None:
        if self.gate is not None:
            scale = None if self.gate_scale is None else self.gate_scale[layer]
            self.gate.add(layer, input_scores(h.float(), scale))

    def tables(self) -> InputTables:
        attn = gate = None
        if self.attn is not None:
            if not self.attn[0].tokens[0]:
                raise ValueError(
                    f"{self.path}: --attention needs a llama-family file (no attention inputs seen)"
                )
            n = len(self.attn[0].tokens)
            attn = torch.tensor([[h.table(i) for h in self.attn] for i in range(n)], dtype=torch.float32)
        if self.gate is not None:
            gate = torch.tensor(
                [self.gate.table(i) for i in range(len(self.gate.tokens))], dtype=torch.float32
            )
        return InputTables(attn, self.attn_scales, gate, self.gate_scale)


def _floats(mf: ModelFile, name: str, shape: tuple[int, int]) -> torch.Tensor:
    w = mf.weight(name, shape)
    return cpu.dequantize_rows(w) if isinstance(w, quants.QuantTensor) else w.float()


def transposed(mf: ModelFile, parts: list[tuple[str, tuple[int, int]]], qtype: Q) -> np.ndarray:
    """The named matrices [F_j, D] stacked, transposed to [D, sum F_j], in qtype: float types exactly, block
    types re-quantized along the new rows."""
    values = [as_torch(mf.entry(name, shape), mf.path) for name, shape in parts]
    if all(isinstance(v, torch.Tensor) for v in values) and {mf.entry(n).qtype for n, _ in parts} == {qtype}:
        stacked = torch.cat(values).t().contiguous()  # float: an exact transpose
        return stacked.numpy() if qtype != Q.BF16 else encode(stacked.float(), qtype)
    floats = [cpu.dequantize_rows(v) if isinstance(v, quants.QuantTensor) else v.float() for v in values]
    return encode(torch.cat(floats).t().contiguous(), qtype)


def transpose_type(source: Q, choice: str, row_len: int) -> Q:
    """The type of a transposed copy (ffn_down_t, ffn_gate_t, attn_qkv_t, attn_output_t) whose rows hold
    row_len values: "same" the source's type (block types re-quantized along the new rows); "auto" Q8_0
    for 16/32-bit sources (AUTO_FLOAT_TRANSPOSE), else the source's type; else the named type. A block the
    row length does not divide falls back to F16."""
    if choice not in TRANSPOSE_TYPES:
        raise ValueError(f"--transpose-type must be one of {', '.join(TRANSPOSE_TYPES)}, got {choice!r}")
    if choice == "same" or (choice == "auto" and source not in FLOAT_SOURCES):
        qtype = source
    elif choice == "auto":
        qtype = AUTO_FLOAT_TRANSPOSE
    else:
        qtype = Q[choice.upper()]
    return qtype if row_len % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _transposed_spec(mf: ModelFile, name: str, parts, shape: tuple[int, int], choice: str) -> TensorSpec:
    qtype = transpose_type(mf.entry(parts[0][0]).qtype, choice, shape[1])
    return TensorSpec(name, shape, qtype, lambda: transposed(mf, parts, qtype))


def _bytes_per_weight(qtype: Q) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return size / block


def row_copy_specs(mf: ModelFile, config: ModelConfig, choice: str, *, gate: bool) -> list[TensorSpec]:
    """ffn_up_rows (and with gate, ffn_gate_rows: a gate probe's files gather the exact gate's kept rows) for
    every layer whose matrix takes more bytes a weight than transpose_type(choice): the same rows re-encoded,
    for the decode's gathers to read as few bytes as the transposes; none where that saves nothing."""
    c = config
    shape = (c.n_ff, c.n_embd)
    specs = []
    for i in range(c.n_layer):
        for source, copy, wanted in (
            (names.FFN_UP, names.FFN_UP_ROWS, True),
            (names.FFN_GATE, names.FFN_GATE_ROWS, gate),
        ):
            name = names.tensor(source, i)
            src_type = mf.entry(name).qtype
            qtype = transpose_type(src_type, choice, c.n_embd)
            if wanted and _bytes_per_weight(qtype) < _bytes_per_weight(src_type):
                specs.append(
                    TensorSpec(
                        names.tensor(copy, i),
                        shape,
                        qtype,
                        lambda n=name, q=qtype: encode(_floats(mf, n, shape), q),
                    )
                )
    return specs


def input_specs(
    mf: ModelFile, config: ModelConfig, tables: InputTables, choice: str = "auto"
) -> list[TensorSpec]:
    """The transposed matrices (typed by transpose_type(choice)) and the tables of the calibrated rules."""
    c = config
    d, dq, dkv, f = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_ff
    specs, stored = [], []
    for i in range(c.n_layer):
        if tables.attn_quantiles is not None:
            qkv = [
                (names.tensor(t, i), (n, d))
                for t, n in ((names.ATTN_Q, dq), (names.ATTN_K, dkv), (names.ATTN_V, dkv))
            ]
            o = [(names.tensor(names.ATTN_OUT, i), (d, dq))]
            specs.append(
                _transposed_spec(mf, names.tensor(names.ATTN_QKV_T, i), qkv, (d, dq + 2 * dkv), choice)
            )
            specs.append(_transposed_spec(mf, names.tensor(names.ATTN_OUT_T, i), o, (dq, d), choice))
        if tables.gate_quantiles is not None:
            gate = [(names.tensor(names.FFN_GATE, i), (f, d))]
            specs.append(_transposed_spec(mf, names.tensor(names.FFN_GATE_T, i), gate, (d, f), choice))
    if tables.attn_quantiles is not None:
        stored.append((names.SPARSIFY_ATTN_QUANTILES, tables.attn_quantiles))
        if tables.attn_scales is not None:
            stored.append((names.SPARSIFY_ATTN_SCALE_QKV, tables.attn_scales[0]))
            stored.append((names.SPARSIFY_ATTN_SCALE_O, tables.attn_scales[1]))
    if tables.gate_quantiles is not None:
        stored.append((names.SPARSIFY_GATE_IN_QUANTILES, tables.gate_quantiles))
        if tables.gate_scale is not None:
            stored.append((names.SPARSIFY_GATE_IN_SCALE, tables.gate_scale))
    for name, t in stored:
        t = t.float().contiguous()
        specs.append(TensorSpec(name, tuple(t.shape), Q.F32, lambda t=t: t.numpy()))
    return specs
