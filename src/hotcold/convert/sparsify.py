"""`hotcold sparsify`: a dense SwiGLU GGUF -> the same file plus what thresholded sparsity runs on.

Calibration (training-free): the dense model runs over a corpus; every layer's FFN input h gives each
neuron's score: CATS |silu(gate_i . h)|, or (the default, "wina", WINA's idea applied to CATS' gate) that
times |down[:, i]|, the norm of the neuron's output direction, so a neuron that moves the residual little
is skipped first (benchmarks/RESULTS.md: lower held-out perplexity than CATS at every sparsity measured). Scores go
into per-layer log-spaced histograms (fine: 16384 bins over 1e-12 .. 1e4, 0.1% of a decade each), so
memory does not grow with the corpus; a layer's threshold for sparsity s is the s-quantile of its scores.
A coarser per-neuron histogram gives how often each neuron is kept at the target (the activation
statistics hot/cold placement ranks neurons by).

The output (sparse/thresholded.py reads it) is the input's tensors and keys unchanged, plus
- `blk.N.ffn_down_t.weight` [F, D]: ffn_down transposed, row i = neuron i, for the axpy kernel, in the
  type of ffn_down by default: float types are an exact transpose; block types are dequantized and
  re-quantized along the neuron's row (benchmarks/RESULTS.md: on the trained SwiGLU model a Q4_0 down
  re-quantized to Q4_0 gave the same decode-kernel perplexity as one re-quantized to Q8_0, 97.305 vs
  97.313 at sparsity 0.5, so the default keeps the bytes; `--down-type q8_0` is there for other models);
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
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm import tqdm

from hotcold import names, quants
from hotcold.atomic import check_output
from hotcold.config import ModelConfig, config_from_file
from hotcold.convert import encode
from hotcold.gguf_io import ModelFile, TensorSpec, as_torch, metadata_items, write_model_file
from hotcold.kernels import cpu
from hotcold.ops import linear
from hotcold.sparse.attention_inputs import attention_scales
from hotcold.sparse.thresholded import METHODS

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 16384  # calibration tokens (evenly spread pieces of the corpus)
GRID = tuple(round(i / 100, 2) for i in range(101))  # quantile levels 0, 0.01, .., 1
LOG_LO, LOG_HI, BINS = -12.0, 4.0, 16384  # layer histograms over log10(score)
NEURON_BINS = 256  # per-neuron histograms: 1/16 decade each
DOWN_TYPES = ("auto", "same", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k")
PROBES = ("auto", "none", "q4_0")  # the gate probe: a Q4_0 copy of the gate the score is computed from
# "auto": a probe where it saves bytes at sparsity 0.5: 0.56 bytes a weight for the probe + (1 - s) of the
# gate's own bytes against all of them; a Q8_0 gate (1.06 bytes) breaks even only from s = 0.53
PROBED_GATES = (Q.F32, Q.F16, Q.BF16)


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

    def kept_frequency(self, layer: int, threshold: float) -> torch.Tensor:
        """[F]: share of the layer's tokens whose score exceeds threshold, per neuron (coarse bins)."""
        width = (LOG_HI - LOG_LO) / NEURON_BINS
        pos = (np.log10(max(threshold, 10.0**LOG_LO)) - LOG_LO) / width
        k = min(int(pos), NEURON_BINS - 1)
        h = self.neuron[layer].view(self.n_ff, NEURON_BINS).double()
        kept = h[:, k + 1 :].sum(1) + (1.0 - (pos - k)) * h[:, k]
        return (kept / max(1, self.tokens[layer])).float()


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
    attn_quantiles: torch.Tensor | None = None  # [L, 2, G]: q/k/v input, o input (--attention)
    attn_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # wina: [L, D], [L, H*Dh]


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
    if config.ffn_kind != "gated" or config.ffn_activation != "silu":
        raise ValueError(
            f"{path}: sparsify needs a SwiGLU model (silu(gate) * up); this {config.arch} file's FFN is "
            f"{config.ffn_kind} with {config.ffn_activation}"
        )


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
    progress: bool = False,
) -> Calibration:
    """Thresholds for `sparsity` from the dense model's scores on `ids` (corpus tokens without BOS), run in
    windows of ctx tokens (BOS first). `llm` is a hotcold Model loaded dense; probes: per layer the gate
    copy the score is computed from at run time (None: the gate); attention: also the quantiles of the
    attention products' input scores (attention_inputs.py)."""
    from hotcold.placement.profile import run_windows, token_windows, window_ctx

    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    sparsity = check_target(sparsity)
    c, mf = llm.config, llm.loaded.file
    layers = llm.loaded.model.layers
    gates = list(probes) if probes is not None else [layer.ffn.weights.gate for layer in layers]
    scale = torch.stack([neuron_scale(mf, i, c) for i in range(c.n_layer)]) if method == "wina" else None
    hist = ScoreHistograms(c.n_layer, c.n_ff)

    def observe(layer: int, h: torch.Tensor, _p: torch.Tensor, _a: torch.Tensor) -> None:
        score = F.silu(linear(h, gates[layer])).abs()  # [T, F]
        hist.add(layer, score if scale is None else score * scale[layer])

    inputs = [ScoreHistograms(c.n_layer, 0) for _ in range(2)] if attention else None
    in_scales = None
    if attention and method == "wina":
        pairs = [attention_scales(mf, i, c) for i in range(c.n_layer)]
        in_scales = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))

    def observe_attention(layer: int, which: int, h: torch.Tensor) -> None:
        score = h.float().abs()
        inputs[which].add(layer, score if in_scales is None else score * in_scales[which][layer])

    if attention:
        observe.attention = observe_attention  # the llama family's forward calls it (models/llama.py)

    ctx = window_ctx(ctx, c.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"window of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    windows = token_windows(ids, ctx, llm.tokenizer.bos_id)
    run_windows(llm, windows, observe, desc="calibrating", progress=progress)
    quantiles = torch.tensor(
        [[hist.quantile(i, q) for q in GRID] for i in range(c.n_layer)], dtype=torch.float32
    )
    thresholds = [hist.quantile(i, sparsity) for i in range(c.n_layer)]
    frequency = torch.stack([hist.kept_frequency(i, t) for i, t in enumerate(thresholds)])
    measured = []
    for i, t in enumerate(thresholds):
        log.info("layer %d: threshold %.4g for sparsity %.2f", i, t, sparsity)
        measured.append(1.0 - float(frequency[i].mean()))
    attn_quantiles = None
    if attention:
        if not inputs[0].tokens[0]:
            raise ValueError(
                f"{mf.path}: --attention needs a llama-family file (no attention inputs were seen)"
            )
        attn_quantiles = torch.tensor(
            [[[h.quantile(i, q) for q in GRID] for h in inputs] for i in range(c.n_layer)],
            dtype=torch.float32,
        )
    return Calibration(
        method, sparsity, thresholds, quantiles, frequency, scale, hist.tokens[0], measured, attn_quantiles,
        in_scales,
    )  # fmt: skip


def down_type(source: Q, choice: str, n_embd: int) -> Q:
    """ffn_down_t's type: "auto" / "same" the source's type (block types re-quantized along the neuron's
    row); else the named type. A block the row length does not divide falls back to F16."""
    if choice not in DOWN_TYPES:
        raise ValueError(f"--down-type must be one of {', '.join(DOWN_TYPES)}, got {choice!r}")
    if choice in ("auto", "same"):
        qtype = source
    else:
        qtype = Q[choice.upper()]
    return qtype if n_embd % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _down_t(mf: ModelFile, layer: int, config: ModelConfig, qtype: Q) -> np.ndarray:
    return _transposed(mf, [(names.tensor(names.FFN_DOWN, layer), (config.n_embd, config.n_ff))], qtype)


def _transposed(mf: ModelFile, parts: list[tuple[str, tuple[int, int]]], qtype: Q) -> np.ndarray:
    """The named matrices [F_j, D] stacked, transposed to [D, sum F_j], in qtype: float types exactly, block
    types re-quantized along the new rows."""
    values = [as_torch(mf.entry(name, shape), mf.path) for name, shape in parts]
    if all(isinstance(v, torch.Tensor) for v in values) and {mf.entry(n).qtype for n, _ in parts} == {qtype}:
        stacked = torch.cat(values).t().contiguous()  # float: an exact transpose
        return stacked.numpy() if qtype != Q.BF16 else encode(stacked.float(), qtype)
    floats = [cpu.dequantize_rows(v) if isinstance(v, quants.QuantTensor) else v.float() for v in values]
    return encode(torch.cat(floats).t().contiguous(), qtype)


def attention_specs(mf: ModelFile, config: ModelConfig, cal: Calibration) -> list[TensorSpec]:
    """attn_qkv_t, attn_output_t per layer (in wq's / wo's type, F16 where a block does not divide the row)
    and the input-score tables, for a calibration with attention inputs."""
    c = config
    d, dq, dkv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    specs = []
    for i in range(c.n_layer):
        qkv = [
            (names.tensor(t, i), (n, d))
            for t, n in ((names.ATTN_Q, dq), (names.ATTN_K, dkv), (names.ATTN_V, dkv))
        ]
        o = [(names.tensor(names.ATTN_OUT, i), (d, dq))]
        for template, parts, shape in (
            (names.ATTN_QKV_T, qkv, (d, dq + 2 * dkv)),
            (names.ATTN_OUT_T, o, (dq, d)),
        ):
            qtype = down_type(mf.entry(parts[0][0]).qtype, "same", shape[1])
            specs.append(
                TensorSpec(
                    names.tensor(template, i), shape, qtype, lambda p=parts, q=qtype: _transposed(mf, p, q)
                )
            )
    tables = [(names.SPARSIFY_ATTN_QUANTILES, cal.attn_quantiles)]
    if cal.attn_scales is not None:
        tables += [
            (names.SPARSIFY_ATTN_SCALE_QKV, cal.attn_scales[0]),
            (names.SPARSIFY_ATTN_SCALE_O, cal.attn_scales[1]),
        ]
    for name, t in tables:
        t = t.float().contiguous()
        specs.append(TensorSpec(name, tuple(t.shape), Q.F32, lambda t=t: t.numpy()))
    return specs


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
    down: str = "auto",
    inputs: Sequence[str | os.PathLike[str]] = (),
    progress: bool = False,
) -> Path:
    c = config_from_file(mf)
    specs = [
        TensorSpec(e.name, e.shape, e.qtype, lambda e=e: np.asarray(e.data)) for e in mf.tensors.values()
    ]
    for i in range(c.n_layer):
        src_type = mf.entry(names.tensor(names.FFN_DOWN, i)).qtype
        qtype = down_type(src_type, down, c.n_embd)
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

    if cal.attn_quantiles is not None:
        specs += attention_specs(mf, c, cal)
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
    down: str = "auto",
    probe: str = "auto",
    attention: bool = False,
    progress: bool = False,
) -> dict:
    """Calibrate `src` on `corpus` for `sparsity` and write `dst`; what was done, as a dict.
    probe "q4_0": also write a Q4_0 copy of every gate, the score's source at run time; "auto": so for
    16/32-bit gates (PROBED_GATES; benchmarks/RESULTS.md: +0.01-0.03 points of perplexity, 12% less FFN
    time on a 1B-shaped F16 layer). attention: also the input sparsity of q/k/v and o (attention_inputs.py)."""
    import hotcold
    from hotcold.placement.profile import corpus_tokens, read_corpus
    from hotcold.registry import require

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    check_target(sparsity)
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if down not in DOWN_TYPES:
        raise ValueError(f"--down-type must be one of {', '.join(DOWN_TYPES)}, got {down!r}")
    if probe not in PROBES:
        raise ValueError(f"--gate-probe must be one of {', '.join(PROBES)}, got {probe!r}")
    check_output(dst, [src, corpus], what="sparsify: output")
    mf = ModelFile(src)
    require(mf.architecture, str(src))
    check_swiglu(mf, config_from_file(mf))
    text = read_corpus(corpus)
    llm = hotcold.load(src, dense=True, threads=threads, ctx_size=ctx, device="cpu")
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=max_tokens, spread=True, source=str(corpus))
    c = config_from_file(mf)
    if probe == "auto":
        gate_type = mf.entry(names.tensor(names.FFN_GATE, 0)).qtype
        probe = "q4_0" if gate_type in PROBED_GATES and c.n_embd % 32 == 0 else "none"
    if probe != "none" and c.n_embd % 32:
        raise ValueError(f"{src}: a Q4_0 gate probe needs n_embd divisible by 32, got {c.n_embd}")
    probes = [gate_probe(mf, i, c) for i in range(c.n_layer)] if probe != "none" else None
    cal = calibrate(
        llm,
        ids,
        sparsity=sparsity,
        method=method,
        ctx=ctx,
        probes=probes,
        attention=attention,
        progress=progress,
    )
    del llm
    write_sparsified(mf, dst, cal, probes=probes, down=down, inputs=[corpus], progress=progress)
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
        "ffn_down_t_type": down_type(mf.entry(names.tensor(names.FFN_DOWN, 0)).qtype, down, c.n_embd).name,
        "seconds": time.perf_counter() - start,
    }
