"""`hotcold sparsify`: a dense SwiGLU or GeGLU GGUF -> the same file plus what thresholded sparsity runs on.

Calibration (training-free): the dense model runs over a corpus; every layer's FFN input h gives each
neuron's score: CATS |act(gate_i . h)| (act: the file's SiLU, or Gemma's GELU), or (the default, "wina", WINA's idea applied to CATS' gate) that
times |down[:, i]|, the norm of the neuron's output direction, so a neuron that moves the residual little
is skipped first (benchmarks/RESULTS_LOG.md: lower held-out perplexity than CATS at every sparsity measured). Scores go
into per-layer log-spaced histograms (fine: 16384 bins over 1e-12 .. 1e4, 0.1% of a decade each), so
memory does not grow with the corpus; a layer's threshold for sparsity s is the s-quantile of its scores.
A coarser per-neuron histogram gives how often each neuron is kept at the target (the activation
statistics hot/cold placement ranks neurons by).

The output (sparse/thresholded.py reads it) is the input's tensors and keys unchanged, plus
- `blk.N.ffn_down_t.weight` [F, D]: ffn_down transposed, row i = neuron i, for the axpy kernel. Its type and
  that of the other transposes (sparsify_inputs.transpose_type, `--transpose-type`): by default Q8_0 for
  F32/F16/BF16 sources (re-quantized along the new rows; benchmarks/RESULTS_LOG.md 2026-12-03: decode-kernel
  perplexity of the trained SwiGLU model within 0.04% of exact transposes at 0.4 and 0.5, and a 1B-shaped
  decode reads about half the bytes of those copies), the source's type for block types (a Q4_0 down
  re-quantized to Q4_0 gave the same perplexity as to Q8_0, 97.305 vs 97.313 at 0.5); `same` keeps float
  sources exact;
- `blk.N.ffn_up_rows` (and with the gate probe `blk.N.ffn_gate_rows`) [F, D]: copies of up (and the gate) in
  that type where it takes fewer bytes a weight than theirs: the rows a decode token gathers; the file's own
  up and gate then serve only prompt chunks and many-row forwards, packed at load;
- the keys and tensors named in names.py under `hotcold.sparsify.*`: method, target sparsity, per-layer
  thresholds, the quantile table on a grid of levels (any sparsity can be derived at load) and the
  per-neuron keep frequency.
Written atomically (hotcold.atomic), never over the input or the corpus.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm import tqdm

from hotcold.atomic import check_output
from hotcold.config import ModelConfig, config_from_file
from hotcold.convert.sparsify_inputs import (
    GRID,
    InputCalibration,
    InputTables,
    ScoreHistograms,
    input_specs,
    row_copy_specs,
    transpose_type,
    transposed,
)
from hotcold.gguf import names, quants
from hotcold.gguf.io import ModelFile, TensorEntry, TensorSpec, metadata_items, write_model_file
from hotcold.kernels import cpu
from hotcold.ops import linear
from hotcold.sparse.thresholded import METHODS

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 16384  # calibration tokens (evenly spread pieces of the corpus)
# the gate probe: a Q4_0 copy of the gate the score is computed from; "inputs": the gate itself from each
# token's input channels over a threshold (convert/sparsify_inputs.py), its product the score and activation
PROBES = ("auto", "none", "q4_0", "inputs")
# "auto": a probe where it saves bytes at sparsity 0.5: 0.56 bytes a weight for the probe + (1 - s) of the
# gate's own bytes against all of them; a Q8_0 gate (1.06 bytes) breaks even only from s = 0.53
PROBED_GATES = (Q.F32, Q.F16, Q.BF16)


@dataclass
class Calibration:
    method: str
    sparsity: float
    thresholds: list[float]  # [L]
    quantiles: torch.Tensor  # [L, G]
    frequency: torch.Tensor  # [L, F]
    scale: torch.Tensor | None  # [L, F] (wina)
    tokens: int
    measured: list[float]  # [L]: share of calibration scores <= the threshold (the sparsity reached)
    inputs: InputTables | None = None  # --attention, --gate-probe inputs (sparsify_inputs.py)


def check_swiglu(mf: ModelFile, config: ModelConfig) -> None:
    """A dense, gated SiLU FFN without experts, not already sparsified; ValueError saying what it is."""
    path = mf.path
    if mf.is_sparse:
        raise ValueError(
            f"{path}: a PowerInfer (PWRI) file is already sparse (ReLU with predictors); sparsify is for dense "
            "SwiGLU files"
        )
    if config.sparsified:
        raise ValueError(
            f"{path}: already written by `hotcold sparsify` (target {config_key(mf, names.SPARSIFY_SPARSITY)}): "
            "pick another level at load with --sparsity, or sparsify the original dense file"
        )
    if config.n_expert:
        raise ValueError(f"{path}: mixture-of-experts files are not supported by sparsify")
    if names.tensor(names.FFN_GATE, 0) not in mf.tensors:
        raise ValueError(f"{path}: sparsify reads ffn_gate, and this {config.arch} file has none")
    if config.ffn_kind != "gated" or config.ffn_activation not in SCORE_ACTIVATIONS:
        raise ValueError(
            f"{path}: sparsify needs a SwiGLU or GeGLU model (act(gate) * up, act one of "
            f"{', '.join(SCORE_ACTIVATIONS)}); this {config.arch} file's FFN is {config.ffn_kind} with "
            f"{config.ffn_activation}"
        )


def unfuse(mf: ModelFile, config: ModelConfig) -> None:
    """Phi-3's fused tensors as the separate ones sparsify reads and writes: `ffn_up` [gate; up] (2F x D) as
    `ffn_gate` and `ffn_up` [F, D], `attn_qkv` as `attn_q`, `attn_k`, `attn_v`. Zero-copy row views of the file
    (rows are whole in every type), put in the fused tensor's place in `mf.tensors`: the output holds the
    separate tensors, which hotcold loads as any llama-layout layer (upstream's phi3 reads the fused ones only;
    it does not read sparsify's output anyway)."""
    D, F = config.n_embd, config.n_ff
    qd, kvd = config.n_head * config.head_dim, config.n_head_kv * config.head_dim
    splits = {names.FFN_UP: [(names.FFN_GATE, F), (names.FFN_UP, F)]}
    splits[names.ATTN_QKV] = [(names.ATTN_Q, qd), (names.ATTN_K, kvd), (names.ATTN_V, kvd)]
    out: dict[str, TensorEntry] = {}
    for name, entry in mf.tensors.items():
        parts = next((p for t, p in splits.items() if _is_layer_tensor(name, t)), None)
        if parts is None or (
            parts[0][0] == names.FFN_GATE and names.tensor(names.FFN_GATE, names.block_of(name)) in mf.tensors
        ):
            out[name] = entry
            continue
        rows = sum(n for _, n in parts)
        if entry.shape != (rows, D):
            raise ValueError(
                f"{mf.path}: tensor {name} has shape {entry.shape}, expected {(rows, D)} (fused)"
            )
        data, start = entry.data.reshape(rows, -1), 0
        for template, n in parts:
            part = names.tensor(template, names.block_of(name))
            out[part] = TensorEntry(
                part, (n, D), entry.qtype, data[start : start + n], entry.n_bytes * n // rows
            )
            start += n
    mf.tensors = out


def _is_layer_tensor(name: str, template: str) -> bool:
    block = names.block_of(name)
    return block is not None and name == names.tensor(template, block)


def config_key(mf: ModelFile, key: str):
    return mf.metadata.get(key)


def check_target(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 < sparsity < 1.0:
        raise ValueError(
            f"--sparsity must be a number in (0, 1) (the share of FFN neurons skipped), got {sparsity!r}"
        )
    return float(sparsity)


def neuron_scale(mf: ModelFile, layer: int, config: ModelConfig) -> torch.Tensor:
    """|down[:, i]|_2 per neuron [F] (the wina score weight)."""
    down = mf.weight(names.tensor(names.FFN_DOWN, layer), (config.n_embd, config.n_ff))
    floats = cpu.dequantize_rows(down) if isinstance(down, quants.QuantTensor) else down.float()
    return floats.double().pow(2).sum(0).sqrt().float()


def calibrate(
    llm,
    ids: Sequence[int],
    *,
    sparsity: float,
    method: str = "wina",
    ctx: int | None = None,
    probes: Sequence | None = None,
    attention: bool = False,
    gate_inputs: bool = False,
    progress: bool = False,
) -> Calibration:
    """Thresholds for `sparsity` from the dense model's scores on `ids` (corpus tokens without BOS), run in
    windows of ctx tokens (BOS first). `llm` is a hotcold Model loaded dense; probes: per layer the gate
    copy the score is computed from at run time (None: the gate); attention, gate_inputs: also the
    quantiles of those products' input scores (sparsify_inputs.py)."""
    from hotcold.placement.profile import run_windows, token_windows, window_ctx

    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    sparsity = check_target(sparsity)
    c, mf = llm.config, llm.loaded.file
    layers = llm.loaded.model.layers
    gates = list(probes) if probes is not None else [layer.ffn.weights.gate for layer in layers]
    scale = torch.stack([neuron_scale(mf, i, c) for i in range(c.n_layer)]) if method == "wina" else None
    hist = ScoreHistograms(c.n_layer, c.n_ff)

    inputs = None
    if attention or gate_inputs:
        inputs = InputCalibration(mf, c, attention=attention, gate=gate_inputs, wina=method == "wina")

    add_scores = _neuron_scores(hist, scale, c.ffn_activation)

    def observe(layer: int, h: torch.Tensor, _p: torch.Tensor, _a: torch.Tensor) -> None:
        if not gate_inputs:  # (a gate-inputs file's neurons are scored in the second pass below)
            add_scores(layer, linear(h, gates[layer]))
        if inputs is not None:
            inputs.ffn_input(layer, h)

    if attention:
        observe.attention = inputs.attention  # the llama family's forward calls it (models/llama.py)

    ctx = window_ctx(ctx, c.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"window of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    windows = token_windows(ids, ctx, llm.tokenizer.bos_id)
    run_windows(llm, windows, observe, desc="calibrating", progress=progress)
    tables = None if inputs is None else inputs.tables()
    if gate_inputs:
        hist = _gate_input_scores(llm, windows, tables, sparsity, scale, progress)
    quantiles = torch.tensor(
        [[hist.quantile(i, q) for q in GRID] for i in range(c.n_layer)], dtype=torch.float32
    )
    thresholds = [hist.quantile(i, sparsity) for i in range(c.n_layer)]
    frequency = torch.stack([hist.kept_frequency(i, t) for i, t in enumerate(thresholds)])
    measured = []
    for i, t in enumerate(thresholds):
        log.info("layer %d: threshold %.4g for sparsity %.2f", i, t, sparsity)
        measured.append(1.0 - float(frequency[i].mean()))
    return Calibration(
        method, sparsity, thresholds, quantiles, frequency, scale, hist.tokens[0], measured, tables
    )


# the gated FFNs sparsify calibrates: the score of a neuron is |act(gate)|
SCORE_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma's GeGLU
}


def _neuron_scores(hist: ScoreHistograms, scale: torch.Tensor | None, activation: str):
    """add(layer, gate [T, F]): the neuron scores |act(gate)| (times the wina weights) into hist."""
    act = SCORE_ACTIVATIONS[activation]

    def add(layer: int, gate: torch.Tensor) -> None:
        score = act(gate).abs()
        hist.add(layer, score if scale is None else score * scale[layer])

    return add


def _gate_input_scores(llm, windows, tables, sparsity: float, scale, progress: bool) -> ScoreHistograms:
    """A second pass for --gate-probe inputs: the neuron scores of the gate such a file runs, computed from each
    token's input channels over the gate rule's threshold at `sparsity` (from the first pass's table), so the
    neuron thresholds keep the target share of neurons (calibrated on the exact gate: 48% computed at 0.5)."""
    from hotcold.placement.profile import run_windows
    from hotcold.sparse.thresholded import kept_channels, threshold_at

    c, layers = llm.config, llm.loaded.model.layers
    grid = torch.tensor(GRID, dtype=torch.float32)
    cut = [threshold_at(grid, tables.gate_quantiles[i], sparsity) for i in range(c.n_layer)]
    hist = ScoreHistograms(c.n_layer, c.n_ff)
    add_scores = _neuron_scores(hist, scale, c.ffn_activation)

    def observe(layer: int, h: torch.Tensor, _p: torch.Tensor, _a: torch.Tensor) -> None:
        in_scale = None if tables.gate_scale is None else tables.gate_scale[layer]
        kept = kept_channels(h, in_scale, cut[layer])  # the rule GateInputs runs
        add_scores(layer, linear(torch.where(kept, h, 0.0), layers[layer].ffn.weights.gate))

    run_windows(llm, windows, observe, desc="calibrating the gate from inputs", progress=progress)
    return hist


def _down_t(mf: ModelFile, layer: int, config: ModelConfig, qtype: Q) -> np.ndarray:
    return transposed(mf, [(names.tensor(names.FFN_DOWN, layer), (config.n_embd, config.n_ff))], qtype)


def gate_probe(mf: ModelFile, layer: int, config: ModelConfig) -> quants.QuantTensor:
    """The Q4_0 copy of layer's ffn_gate [F, D]."""
    gate = mf.weight(names.tensor(names.FFN_GATE, layer), (config.n_ff, config.n_embd))
    floats = cpu.dequantize_rows(gate) if isinstance(gate, quants.QuantTensor) else gate.float()
    data = quants.quantize(floats.contiguous(), Q.Q4_0)
    return quants.QuantTensor(torch.from_numpy(data).reshape(config.n_ff, -1), Q.Q4_0, tuple(floats.shape))


def write_sparsified(
    mf: ModelFile,
    dst: str | os.PathLike[str],
    cal: Calibration,
    *,
    probes: Sequence[quants.QuantTensor] | None = None,
    transposes: str = "auto",
    inputs: Sequence[str | os.PathLike[str]] = (),
    progress: bool = False,
) -> Path:
    c = config_from_file(mf)
    specs = [
        TensorSpec(e.name, e.shape, e.qtype, lambda e=e: np.asarray(e.data)) for e in mf.tensors.values()
    ]
    for i in range(c.n_layer):
        src_type = mf.entry(names.tensor(names.FFN_DOWN, i)).qtype
        qtype = transpose_type(src_type, transposes, c.n_embd)
        specs.append(
            TensorSpec(
                names.tensor(names.FFN_DOWN_T, i),
                (c.n_ff, c.n_embd),
                qtype,
                lambda i=i, q=qtype: _down_t(mf, i, c, q),
            )
        )

    for i, probe in enumerate(probes or []):
        specs.append(
            TensorSpec(
                names.tensor(names.FFN_GATE_PROBE, i),
                (c.n_ff, c.n_embd),
                Q.Q4_0,
                lambda p=probe: p.data.numpy().reshape(-1),
            )
        )

    def table(name, t):
        t = t.float().contiguous()
        return TensorSpec(name, tuple(t.shape), Q.F32, lambda t=t: t.numpy())

    specs += row_copy_specs(mf, c, transposes, gate=bool(probes))
    if cal.inputs is not None:
        specs += input_specs(mf, c, cal.inputs, transposes)
    specs.append(table(names.SPARSIFY_QUANTILES, cal.quantiles))
    specs.append(table(names.SPARSIFY_FREQUENCY, cal.frequency))
    if cal.scale is not None:
        specs.append(table(names.SPARSIFY_SCALE, cal.scale))
    meta = metadata_items(mf) + [
        (names.SPARSIFY_METHOD, cal.method, V.STRING),
        (names.SPARSIFY_SPARSITY, cal.sparsity, V.FLOAT32),
        (names.SPARSIFY_THRESHOLDS, [float(t) for t in cal.thresholds], V.ARRAY, V.FLOAT32),
        (names.SPARSIFY_GRID, list(GRID), V.ARRAY, V.FLOAT32),
        (names.SPARSIFY_TOKENS, int(cal.tokens), V.UINT32),
    ]

    def bar(items):
        return tqdm(items, desc=f"writing {Path(dst).name}", unit="tensor") if progress else items

    return write_model_file(
        dst, mf.architecture, meta, specs, sparse=False, progress=bar, inputs=[mf.path, *inputs]
    )


def sparsify_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    corpus: str | os.PathLike[str],
    *,
    sparsity: float,
    method: str = "wina",
    max_tokens: int = DEFAULT_TOKENS,
    ctx: int | None = None,
    threads: int | None = None,
    transposes: str = "auto",
    probe: str = "auto",
    attention: bool = False,
    progress: bool = False,
) -> dict:
    """Calibrate `src` on `corpus` for `sparsity` and write `dst`; what was done, as a dict.
    probe "q4_0": also write a Q4_0 copy of every gate, the score's source at run time; "auto": so for
    16/32-bit gates (PROBED_GATES; benchmarks/RESULTS_LOG.md: +0.01-0.03 points of perplexity, 12% less FFN
    time on a 1B-shaped F16 layer); "inputs": the gate from each token's input channels over a threshold,
    no probe and no exact gate (sparsify_inputs.py). attention: also the input sparsity of q/k/v and o."""
    import hotcold
    from hotcold.placement.profile import corpus_tokens, read_corpus
    from hotcold.registry import require

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    check_target(sparsity)
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    transpose_type(Q.F16, transposes, 32)  # an unknown --transpose-type fails before the calibration
    if probe not in PROBES:
        raise ValueError(f"--gate-probe must be one of {', '.join(PROBES)}, got {probe!r}")
    check_output(dst, [src, corpus], what="sparsify: output")
    mf = ModelFile(src)
    require(mf.architecture, str(src))
    unfuse(mf, config_from_file(mf))
    check_swiglu(mf, config_from_file(mf))
    text = read_corpus(corpus)
    llm = hotcold.load(src, dense=True, threads=threads, ctx_size=ctx, device="cpu")
    unfuse(
        llm.loaded.file, llm.config
    )  # the calibration reads the file's matrices too (built model unchanged)
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=max_tokens, spread=True, source=str(corpus))
    c = config_from_file(mf)
    if probe == "auto":
        gate_type = mf.entry(names.tensor(names.FFN_GATE, 0)).qtype
        probe = "q4_0" if gate_type in PROBED_GATES and c.n_embd % 32 == 0 else "none"
    if probe == "q4_0" and c.n_embd % 32:
        raise ValueError(f"{src}: a Q4_0 gate probe needs n_embd divisible by 32, got {c.n_embd}")
    probes = [gate_probe(mf, i, c) for i in range(c.n_layer)] if probe == "q4_0" else None
    cal = calibrate(
        llm,
        ids,
        sparsity=sparsity,
        method=method,
        ctx=ctx,
        probes=probes,
        attention=attention,
        gate_inputs=probe == "inputs",
        progress=progress,
    )
    del llm
    write_sparsified(mf, dst, cal, probes=probes, transposes=transposes, inputs=[corpus], progress=progress)
    return {
        "file": str(dst),
        "source": str(src),
        "method": method,
        "sparsity": sparsity,
        "calibration_tokens": cal.tokens,
        "calibration_sparsity": sum(cal.measured) / len(cal.measured),
        "thresholds": cal.thresholds,
        "gate_probe": probe,
        "attention_inputs": attention,
        "ffn_down_t_type": transpose_type(
            mf.entry(names.tensor(names.FFN_DOWN, 0)).qtype, transposes, c.n_embd
        ).name,
        "transposes": transposes,
        "seconds": time.perf_counter() - start,
    }
