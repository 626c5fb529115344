"""Sparse FFN against the dense reference: all-firing, oracle masks, thread counts, batches, the one-call
C step against the op-by-op step, the norm folded into the call."""

from __future__ import annotations

import pytest
import torch

from hotcold.kernels import cpu, ffn_calls
from hotcold.ops import Norm, rms_norm
from hotcold.sparse.ffn import DenseFFN, SparseFFN, sparse_step
from hotcold.sparse.predictor import Predictor
from hotcold.sparse.tails import DenseTail, SparseTail
from tests.fixtures import ffn_state, ffn_weights

F, D = 1280, 96


def weights(kind="gated", dtype=torch.float32, seed=0, bias=False):
    return ffn_weights(F, D, kind, dtype, seed=seed, bias=bias, scale=6)


def predictor(seed: int, threshold: float) -> Predictor:
    g = torch.Generator().manual_seed(seed)
    return Predictor(
        (torch.randn(32, D, generator=g) / 4).half(), (torch.randn(F, 32, generator=g) / 4).half(), threshold
    )


CASES = [("gated", False), ("gated_both", False), ("plain", True)]


@pytest.mark.parametrize("kind, bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_firing_predictor_equals_dense(kind, bias, dtype):
    w = weights(kind, dtype, bias=bias)
    x = torch.randn(4, D)
    dense = DenseFFN(w, layer=0).apply(x, x, ffn_state())
    all_fire = SparseFFN(w, lambda p: torch.ones(p.shape[0], F, dtype=torch.bool), layer=0)
    seq = ffn_state()
    sparse = all_fire.apply(x, x, seq)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert (sparse - dense).abs().max() <= tol * dense.abs().max()
    assert seq.counts[0].computed == seq.counts[0].total == 4 * F


@pytest.mark.parametrize("kind, bias", CASES)
def test_oracle_mask_equals_dense_restricted_to_firing_neurons(kind, bias):
    """With the true firing set as the mask, the sparse FFN is the dense FFN over exactly those neurons;
    for ReLU models that is the dense FFN itself (non-firing neurons output exactly 0)."""
    w = weights(kind, bias=bias)
    x = torch.randn(6, D)
    seen = {}
    seq = ffn_state(observe=lambda layer, ffn_in, p, a: seen.setdefault("a", a))
    dense = DenseFFN(w, layer=0).apply(x, x, seq)
    firing = seen["a"] != 0
    assert 0.05 < firing.float().mean() < 0.95
    sparse = SparseFFN(w, lambda p: firing, layer=0).apply(x, x, ffn_state())
    # reference restricted to the firing neurons, computed independently
    a = torch.where(firing, seen["a"], 0.0)
    restricted = a @ w.down_t + (w.down_bias if w.down_bias is not None else 0)
    assert (sparse - restricted).abs().max() <= 1e-5 * restricted.abs().max()
    if kind != "plain" or not bias:  # relu(b) of a non-firing neuron is 0 only without bias
        assert (sparse - dense).abs().max() <= 1e-5 * dense.abs().max()


def test_dense_state_computes_every_neuron_and_is_observed():
    """seq.dense: a sparse FFN gives the dense reference and shows observers its true activations."""
    w = weights("gated")
    x = torch.randn(3, D)
    seen = []
    seq = ffn_state(dense=True, observe=lambda layer, h, p, a: seen.append((layer, a)))
    sparse_as_dense = SparseFFN(w, predictor(1, 0.5), layer=0).apply(x, x, seq)
    assert torch.equal(sparse_as_dense, DenseFFN(w, layer=0).apply(x, x, ffn_state()))
    assert [layer for layer, _ in seen] == [0] and seen[0][1].shape == (3, F)
    assert seq.counts[0].computed == seq.counts[0].total == 3 * F


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_identical_bits_for_any_thread_count(dtype):
    w = weights("gated", dtype)
    x = torch.randn(9, D)
    mask = torch.rand(9, F, generator=torch.Generator().manual_seed(1)) < 0.2
    outs = [SparseFFN(w, lambda p: mask, layer=0, threads=t).apply(x, x, ffn_state()) for t in (1, 2, 4)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prefill_batch_equals_token_by_token():
    w = weights("gated_both")
    x = torch.randn(12, D)
    mask = torch.rand(12, F, generator=torch.Generator().manual_seed(2)) < 0.15
    batch = SparseFFN(w, lambda p: mask, layer=0).apply(x, x, ffn_state())
    single = torch.cat(
        [
            SparseFFN(w, lambda p, t=t: mask[t : t + 1], layer=0).apply(
                x[t : t + 1], x[t : t + 1], ffn_state()
            )
            for t in range(12)
        ]
    )
    assert (batch - single).abs().max() <= 1e-6 * batch.abs().max()


@pytest.mark.parametrize("kind, bias", CASES + [("gated", True)])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_step_equals_separate_kernels(kind, bias, t):
    """With a real predictor the CPU step runs as one C call; it must give the very bits of the
    kernel-by-kernel path (predictor, then sparse_step without its C plan)."""
    if cpu.backend() != "c":
        pytest.skip("C kernels unavailable")
    w = weights(kind, torch.float16, seed=3, bias=bias)
    pred = predictor(4, 0.5)
    g = torch.Generator().manual_seed(5)
    x, p = torch.randn(t, D, generator=g), torch.randn(t, D, generator=g)
    fused_ffn = SparseFFN(w, pred, layer=0, threads=2)
    assert isinstance(fused_ffn.fused_plan, ffn_calls.SparseFFNPlan)  # the fused path is the one that runs
    seq = ffn_state()
    fused = fused_ffn.apply(x, p, seq)
    mask = pred(p)
    by_kernels = w.add_down_bias(sparse_step(w, x, mask, None, threads=3))
    assert torch.equal(fused, by_kernels)
    assert seq.counts[0].computed == int(mask.sum()) and seq.counts[0].total == mask.numel()
    assert 0.05 < seq.counts[0].rate < 0.95  # a real mix of firing and silent neurons
    with_plan = SparseFFN(w, lambda q: pred(q), layer=0, threads=1)  # a plain callable: no fused plan
    assert with_plan.fused_plan is None
    assert torch.equal(with_plan.apply(x, p, ffn_state()), by_kernels)  # the row plan: same bits again


@pytest.mark.parametrize("t", [1, 3, 6])  # the norm inside the C call (t <= 4) and before it
def test_ffn_norm_inside_the_call_equals_norm_first(t):
    w = weights("gated", torch.float16, seed=5)
    pred = predictor(6, 0.3)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, D, generator=g) * 2
    norm = Norm(torch.randn(D, generator=g), 1e-5)
    with_norm = SparseFFN(w, pred, layer=0, norm=norm)(x, ffn_state())
    norm_first = SparseFFN(w, pred, layer=0).apply(rms_norm(x, norm.weight, norm.eps), x, ffn_state())
    assert torch.equal(with_norm, norm_first)
    unfused = SparseFFN(w, lambda q: pred(q), layer=0, norm=norm)(x, ffn_state())  # norm in torch first
    assert torch.equal(with_norm, unfused)


@pytest.mark.parametrize("outtype", ["f16", "q4_0"])
@pytest.mark.parametrize("mode", ["sparse", "dense file", "--dense"])
def test_one_call_decode_equals_the_layer_ops(
    tmp_path, tiny_sparse_gguf, tiny_dense_gguf, outtype, mode, monkeypatch
):
    """A llama decode token in one C call (cpu_step: every layer), as two C calls a layer (q/k/v + RoPE
    attention; o projection, residual, the fused FFN with its norm, residual: sparse, or dense for a dense
    file and for `--dense`) and as the ops one by one: the same prompt logits, greedy tokens and firing
    counts the timings report."""
    import hotcold
    from hotcold.convert.quantize import quantize_file
    from hotcold.models import llama
    from hotcold.runtime.cpu_step import CPUDecoder

    src = tiny_dense_gguf if mode == "dense file" else tiny_sparse_gguf
    path = quantize_file(src, tmp_path / f"m.{outtype}.gguf", outtype)  # weights in the C kernels' types
    ids = [1, 7, 42, 99, 3, 250, 17, 8]

    def run():
        llm = hotcold.load(path, device="cpu", threads=2, dense=mode == "--dense")
        logits = llm.logits(ids)
        out = llm.generate("Line 1", max_tokens=6, temperature=0.0, ignore_eos=True)
        return logits, out, llm.engine.seq.neuron_totals()

    calls = {"tail": [], "attend": [], "token": []}

    def counting(name, real):
        def wrapped(self, *a, **k):
            got = real(self, *a, **k)
            calls[name].append(got is not None)
            return got

        return wrapped

    monkeypatch.setattr(CPUDecoder, "__call__", counting("token", CPUDecoder.__call__))
    whole = run()
    assert len(calls["token"]) >= 5 and all(calls["token"])  # every decode token
    monkeypatch.setattr(CPUDecoder, "__call__", lambda self, x, ctx: None)
    tail = ffn_calls.SparseFFNPlan.tail if mode == "sparse" else ffn_calls.DenseTail.__call__
    owner, name = (ffn_calls.SparseFFNPlan, "tail") if mode == "sparse" else (ffn_calls.DenseTail, "__call__")
    monkeypatch.setattr(owner, name, counting("tail", tail))
    monkeypatch.setattr(cpu.MatvecGroup, "attend", counting("attend", cpu.MatvecGroup.attend))
    halves = run()
    assert len(calls["attend"]) >= 5 * 2 and all(calls["attend"])  # every decode forward, every layer
    assert len(calls["tail"]) > 10 and all(calls["tail"])  # prefill (few tokens) and decode, every layer
    monkeypatch.setattr(SparseTail, "__call__", lambda self, *a: None)
    monkeypatch.setattr(DenseTail, "__call__", lambda self, *a: None)
    monkeypatch.setattr(llama, "decode_attention", lambda *a, **k: None)
    ops = run()
    for got in (whole, halves):
        assert torch.equal(got[0], ops[0])
        assert got[1] == ops[1] and got[2] == ops[2]
