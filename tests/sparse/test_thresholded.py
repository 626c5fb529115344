"""sparse/thresholded.py: the thresholded SwiGLU FFN against float64 references, and files written by
`hotcold sparsify` run thresholded: sparsity 0 is dense bit for bit, kept neurons are exactly those over
the threshold (an oracle computed from the file with the gguf package), batches equal single runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize

import hotcold
from hotcold.gguf import names
from hotcold.ops import linear
from hotcold.runtime.state import Batch, FFNCounts, SequenceState
from hotcold.sparse.tails import ThresholdedTail
from hotcold.sparse.thresholded import ThresholdedFFN, threshold_at
from tests.fixtures import ffn_state, ffn_weights

PROMPT = "Line 3: the quick brown fox 21 jumps over 3 lazy dogs."


def reference(w, h, threshold, scale=None):
    """float64: (output [T, D], mask [T, F], score [T, F])."""
    h = h.double()
    act = F.silu(h @ w.gate.double().T)
    score = act.abs() if scale is None else act.abs() * scale.double()
    mask = score > threshold
    a = torch.where(mask, act * (h @ w.up.double().T), 0.0)
    return a @ w.down_t.double(), mask, score


def test_threshold_at_interpolates_the_table():
    grid, q = torch.tensor([0.0, 0.5, 1.0]), torch.tensor([0.0, 1.0, 3.0])
    assert [threshold_at(grid, q, s) for s in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0.0, 0.5, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        threshold_at(grid, q, 1.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 64, 100])  # 100 >= GEMM_MIN_TOKENS: the dense-kernel path
@pytest.mark.parametrize("wina", [False, True])
def test_ffn_keeps_exactly_the_neurons_over_the_threshold(dtype, T, wina):
    F_, D = 512, 64
    w = ffn_weights(F_, D, dtype=dtype, seed=T, scale=4.0)
    w.activation = "silu"
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    scale = torch.rand(F_, generator=torch.Generator().manual_seed(3)) + 0.5 if wina else None
    _, _, score = reference(w, h, 0.0, scale)
    t = float(score.flatten().quantile(0.6))
    down = w.down_t.T.contiguous() if T == 100 else None  # the many-row path multiplies ffn_down [D, F]
    ffn = ThresholdedFFN(w, t, layer=0, down=down, scale=scale)
    seq = SequenceState(None, [FFNCounts()], keep_masks=True)
    out = ffn.apply(h, h, Batch.single(seq, 0, T))
    mask = seq.masks[0][1]
    ref, ref_mask, _ = reference(w, h, t, scale)
    clear = (score - t).abs() > 1e-4 * t  # rounding of the gate may flip a neuron sitting on the threshold
    assert torch.equal(mask[clear], ref_mask[clear])
    assert (~clear).float().mean() < 0.02
    # the output is the masked FFN (with the kernel's own mask)
    h64 = h.double()
    act = F.silu(h64 @ w.gate.double().T)
    a = torch.where(mask, act * (h64 @ w.up.double().T), 0.0)
    expect = a @ w.down_t.double()
    assert torch.allclose(out.double(), expect, rtol=1e-3, atol=1e-3 * float(expect.abs().max()))
    assert seq.counts[0].computed == int(mask.sum()) and seq.counts[0].total == mask.numel()


def test_dense_reference_computes_every_neuron():
    w = ffn_weights(512, 64, dtype=torch.float16, seed=1)
    w.activation = "silu"
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ctx = ffn_state(1, dense=True)
    out = ThresholdedFFN(w, 1e9, layer=0).apply(h, h, ctx)
    ref, _, _ = reference(w, h, -1.0)
    assert torch.allclose(out.double(), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert ctx.counts[0].computed == ctx.counts[0].total == 3 * 512


# ------------------------------------------------------------------------------------------------
# Files written by hotcold sparsify
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_sparsity_zero_is_dense_bit_for_bit(tiny_swiglu, outtype):
    dense = hotcold.load(tiny_swiglu.dense[outtype], threads=1)
    ids = dense.tokenize(PROMPT)
    want = dense.logits(ids)
    for llm in (
        hotcold.load(tiny_swiglu.sparse[outtype], threads=1, sparsity=0),
        hotcold.load(tiny_swiglu.sparse[outtype], threads=1, dense=True),
    ):
        assert llm.loaded.dense
        assert torch.equal(llm.logits(ids), want)
        assert llm.generate(PROMPT, max_tokens=12) == dense.generate(PROMPT, max_tokens=12)


def _file_reference(path):
    """From the file, with the gguf package: per layer (ffn_norm, gate [F, D] float64), eps, and the
    thresholds' inputs (key, grid, quantile table)."""
    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}

    def floats(name):
        x = t[name]
        shape = tuple(int(s) for s in reversed(x.shape.tolist()))
        return torch.from_numpy(np.asarray(dequantize(x.data, x.tensor_type), dtype=np.float64)).reshape(
            shape
        )

    def field(key):
        f = r.fields[key]
        return [f.parts[i][0].item() for i in f.data]

    L = int(field("llama.block_count")[0])
    layers = [(floats(f"blk.{i}.ffn_norm.weight"), floats(f"blk.{i}.ffn_gate.weight")) for i in range(L)]
    eps = field("llama.attention.layer_norm_rms_epsilon")[0]
    return (
        layers,
        eps,
        field(names.SPARSIFY_THRESHOLDS),
        field(names.SPARSIFY_GRID),
        floats(names.SPARSIFY_QUANTILES),
    )


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("n_tokens", [9, 60])  # decode-sized (row gathers) and prefill-sized (GEMM)
def test_kept_neurons_are_those_over_the_threshold(tiny_swiglu, outtype, sparsity, n_tokens):
    path = tiny_swiglu.sparse[outtype]
    layers, eps, keyed, grid, table = _file_reference(path)
    # the kernels round: F16 gates in fp32; Q8_0 gates on int8-quantized activations (integer dot)
    band = 1e-4 if outtype == "f16" else 2.5e-2
    llm = hotcold.load(path, threads=1, sparsity=sparsity)
    seq = llm.engine.seq
    seq.keep_masks = True
    ids = (llm.tokenize(PROMPT * 8))[:n_tokens]
    llm.logits(ids)
    ambiguous = 0
    for i, (norm_w, gate) in enumerate(layers):
        # the stored threshold at the file's target, else the quantile table interpolated (numpy here)
        t = keyed[i] if sparsity == 0.5 else float(np.interp(sparsity, grid, table[i].numpy()))
        p, mask = seq.masks[i]
        p = p.double()
        h = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        score = F.silu(h @ gate.T).abs()
        clear = (score - t).abs() > band * float(score.mean())
        assert torch.equal(mask[clear], (score > t)[clear]), f"layer {i}"
        ambiguous += int((~clear).sum())
        # exactly, with the model's own norm and gate product (the same rounding) and the same threshold
        ffn = llm.loaded.model.layers[i].ffn
        own = F.silu(linear(ffn.norm(p.float()), ffn.weights.gate)).abs()
        assert torch.equal(mask, own > np.float32(t)), f"layer {i}"
        assert 0.0 < mask.float().mean() < 1.0
    assert ambiguous <= 0.05 * len(layers) * mask.numel()


def test_override_moves_the_computed_share(tiny_swiglu):
    rates = []
    for s in (0.3, 0.5, 0.7):
        llm = hotcold.load(tiny_swiglu.sparse["f16"], threads=1, sparsity=s)
        llm.generate(PROMPT, max_tokens=16, ignore_eos=True)
        rates.append(llm.last_stats.firing_rate)
    assert rates[0] > rates[1] > rates[2]


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_batched_equals_alone(tiny_swiglu, outtype):
    llm = hotcold.load(tiny_swiglu.sparse[outtype], threads=1, sparsity=0.4)
    prompts = [PROMPT, "The quick brown fox", "Line 12: 84 jumps over"]
    alone = [llm.generate(p, max_tokens=10, ignore_eos=True) for p in prompts]
    assert llm.generate_batch(prompts, max_tokens=10, ignore_eos=True) == alone


def test_bad_sparsity_values(tiny_swiglu, tiny_dense_gguf):
    for bad in (1.0, -0.1, float("nan"), 2):
        with pytest.raises(ValueError, match="sparsity"):
            hotcold.load(tiny_swiglu.sparse["f16"], sparsity=bad)
    with pytest.raises(ValueError, match="hotcold sparsify"):
        hotcold.load(tiny_dense_gguf, sparsity=0.4)
    assert hotcold.load(tiny_dense_gguf, sparsity=0).loaded.dense  # 0 is dense for any file


@pytest.mark.parametrize("T", [1, 5, 64])
def test_gate_probe_scores_and_the_exact_gate_computes(T):
    """With a probe the mask comes from the probe's score, the kept neurons' activation from the exact gate."""
    from gguf import GGMLQuantizationType as Q

    from hotcold.gguf import quants
    from hotcold.kernels import cpu

    F_, D = 512, 64
    w = ffn_weights(F_, D, dtype=torch.float16, seed=T, scale=4.0)
    w.activation = "silu"
    data = quants.quantize(w.gate.float(), Q.Q4_0)
    probe = quants.QuantTensor(torch.from_numpy(data).reshape(F_, -1), Q.Q4_0, (F_, D))
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    probe_score = F.silu(cpu.matmul(probe, h)).abs()
    t = float(probe_score.flatten().quantile(0.5))
    down = w.down_t.T.contiguous() if T == 64 else None
    seq = SequenceState(None, [FFNCounts()], keep_masks=True)
    out = ThresholdedFFN(w, t, layer=0, down=down, probe=probe).apply(h, h, Batch.single(seq, 0, T))
    mask = seq.masks[0][1]
    assert torch.equal(mask, probe_score > np.float32(t))
    h64 = h.double()
    a = torch.where(mask, F.silu(h64 @ w.gate.double().T) * (h64 @ w.up.double().T), 0.0)
    expect = a @ w.down_t.double()
    assert torch.allclose(out.double(), expect, rtol=1e-3, atol=1e-3 * float(expect.abs().max()))


def test_sparsified_with_a_gate_probe(tiny_swiglu, tmp_path):
    from hotcold.convert.sparsify import sparsify_file
    from hotcold.gguf.io import ModelFile

    out = tmp_path / "probe.gguf"
    r = sparsify_file(
        tiny_swiglu.dense["f16"], out, tiny_swiglu.corpus, sparsity=0.5, max_tokens=1500, probe="q4_0"
    )
    assert r["gate_probe"] == "q4_0" and abs(r["calibration_sparsity"] - 0.5) < 0.03
    assert ModelFile(out).entry(names.tensor(names.FFN_GATE_PROBE, 0)).qtype.name == "Q4_0"
    llm = hotcold.load(out, threads=1)
    seq = llm.engine.seq
    seq.keep_masks = True
    ids = llm.tokenize(PROMPT * 4)[:20]
    llm.logits(ids)
    for i, layer in enumerate(llm.loaded.model.layers):
        p, mask = seq.masks[i]
        ffn = layer.ffn
        own = F.silu(linear(ffn.norm(p.float()), ffn.probe)).abs()
        if ffn.scale is not None:
            own = own * ffn.scale
        assert torch.equal(mask, own > np.float32(ffn.threshold))
    dense = hotcold.load(tiny_swiglu.dense["f16"], threads=1)
    assert torch.equal(hotcold.load(out, threads=1, sparsity=0).logits(ids), dense.logits(ids))
    prompts = [PROMPT, "The quick brown fox"]
    alone = [llm.generate(p, max_tokens=8, ignore_eos=True) for p in prompts]
    assert llm.generate_batch(prompts, max_tokens=8, ignore_eos=True) == alone


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_thread_count_does_not_change_the_bits(tiny_swiglu, outtype):
    ids = list(range(3, 40))
    one = hotcold.load(tiny_swiglu.sparse[outtype], threads=1, sparsity=0.5)
    two = hotcold.load(tiny_swiglu.sparse[outtype], threads=2, sparsity=0.5)
    for n in (9, 37):  # row gathers, then more rows (still below GEMM_MIN_TOKENS)
        assert torch.equal(one.logits(ids[:n]), two.logits(ids[:n]))


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "probe"])
@pytest.mark.parametrize("dense", [False, True])
def test_one_call_decode_equals_the_layer_ops(tiny_swiglu, tmp_path, monkeypatch, outtype, dense):
    """A sparsified file's decode token in one C call (cpu_step, the thresholded or, with `--dense`, the
    dense tail), as two C calls a layer (attention; the o projection, residuals and the FFN step) and as the
    ops one by one: the same logits, greedy tokens and computed-neuron counts."""
    from hotcold.convert.sparsify import sparsify_file
    from hotcold.kernels import ffn_calls
    from hotcold.models import llama
    from hotcold.runtime.cpu_step import CPUDecoder

    path = tiny_swiglu.sparse.get(outtype)
    if path is None:  # a Q4_0 gate probe: the score from the probe, the exact gate gathered
        path = tmp_path / "probe.gguf"
        sparsify_file(
            tiny_swiglu.dense["f16"], path, tiny_swiglu.corpus, sparsity=0.5, max_tokens=800, probe="q4_0"
        )
    ids = [1, 7, 42, 99, 3, 250, 17, 8]

    def run():
        llm = hotcold.load(path, device="cpu", threads=2, dense=dense)
        logits = llm.logits(ids)
        out = llm.generate("Line 1", max_tokens=6, temperature=0.0, ignore_eos=True)
        return logits, out, llm.engine.seq.neuron_totals()

    used = []
    real = CPUDecoder.__call__
    monkeypatch.setattr(
        CPUDecoder, "__call__", lambda self, x, ctx: used.append(got := real(self, x, ctx)) or got
    )
    whole = run()
    assert len(used) >= 5 and all(u is not None for u in used)  # every decode token in one call
    monkeypatch.setattr(CPUDecoder, "__call__", lambda self, x, ctx: None)
    owner, name = (ffn_calls.DenseTail, "__call__") if dense else (ffn_calls.ThresholdedPlan, "tail")
    tails, real_tail = [], getattr(owner, name)
    monkeypatch.setattr(
        owner, name, lambda self, *a, **k: tails.append(got := real_tail(self, *a, **k)) or got
    )
    halves = run()
    assert len(tails) > 10 and all(
        t is not None for t in tails
    )  # prefill (few tokens) and decode, every layer
    monkeypatch.setattr(ThresholdedTail, "__call__", lambda self, *a: None)
    monkeypatch.setattr(llama, "decode_attention", lambda *a, **k: None)
    steps = run()  # the FFN step still one C call (the plan), the rest op by op
    monkeypatch.setattr(ThresholdedFFN, "plan_for", lambda self, x, ctx: None)
    ops = run()
    for got in (whole, halves, steps):
        assert torch.equal(got[0], ops[0])
        assert got[1] == ops[1] and got[2] == ops[2]
    if not dense:
        computed, total = ops[2]
        assert 0.2 < computed / total < 0.8  # thresholded, not every neuron
