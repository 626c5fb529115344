"""The one-call CPU decode token (cpu_step): where it runs and where it steps aside. Its bits against the
layer-by-layer paths are in tests/sparse/test_ffn.py (test_one_call_decode_equals_the_layer_ops)."""

from __future__ import annotations

import pytest
import torch

import hotcold
from hotcold.kernels import cpu
from hotcold.runtime.cpu_step import CPUDecoder
from hotcold.runtime.engine import Engine


@pytest.fixture
def q4_sparse(tmp_path, tiny_sparse_gguf):
    from hotcold.convert.quantize import quantize_file

    return quantize_file(tiny_sparse_gguf, tmp_path / "m.q4_0.gguf", "q4_0")


def counted(monkeypatch) -> list[bool]:
    used: list[bool] = []
    real = CPUDecoder.__call__

    def wrapped(self, x, ctx):
        got = real(self, x, ctx)
        used.append(got is not None)
        return got

    monkeypatch.setattr(CPUDecoder, "__call__", wrapped)
    return used


def test_engines_sharing_a_model_keep_their_own_caches(q4_sparse, monkeypatch):
    """Two engines on one model, decoding in turns, each get the tokens they get alone: a plan is per KV cache."""
    if cpu.backend() != "c":
        pytest.skip("C kernels unavailable")
    used = counted(monkeypatch)
    llm = hotcold.load(q4_sparse, device="cpu", threads=2)
    model, tok = llm.loaded.model, llm.tokenizer

    def greedy(engine, ids, n):
        logits = engine.prefill(ids)
        out = []
        for pos in range(len(ids), len(ids) + n):
            out.append(int(torch.argmax(logits.reshape(-1))))
            logits = engine.forward([out[-1]], pos, last_only=True)[-1]
        return out

    alone = [greedy(Engine(model, tok, 64), ids, 6) for ids in ([1, 5, 9], [1, 300, 2, 77])]
    engines = [Engine(model, tok, 64), Engine(model, tok, 64)]
    logits = [engines[0].prefill([1, 5, 9]), engines[1].prefill([1, 300, 2, 77])]
    starts, got = [3, 4], [[], []]
    for step in range(6):
        for j, engine in enumerate(engines):  # one token of each engine in turn
            got[j].append(int(torch.argmax(logits[j].reshape(-1))))
            logits[j] = engine.forward([got[j][-1]], starts[j] + step, last_only=True)[-1]
    assert [got[0], got[1]] == alone
    assert used and all(used)


def test_steps_aside_for_profiling_and_overflows_like_the_layers(q4_sparse, monkeypatch):
    """A profiled forward (keep_masks: every layer's mask is kept) runs layer by layer; past the context
    the error is the layers' own."""
    if cpu.backend() != "c":
        pytest.skip("C kernels unavailable")
    used = counted(monkeypatch)
    llm = hotcold.load(q4_sparse, device="cpu", threads=2, ctx_size=8)
    engine = llm.engine
    engine.prefill([1, 5, 9])
    engine.seq.keep_masks = True
    engine.forward([7], 3, last_only=True)
    assert used == [False]
    engine.seq.keep_masks = False
    engine.forward([7], 4, last_only=True)
    assert used == [False, True]
    with pytest.raises(ValueError, match="context overflow"):
        engine.forward([7], 8, last_only=True)


@pytest.mark.parametrize("outtype, kind", [("f16", "sparse"), ("q4_0", "sparse"), ("f16", "dense")])
def test_a_decode_batch_in_one_call_equals_the_layers(
    tmp_path, tiny_sparse_gguf, tiny_dense_gguf, outtype, kind, monkeypatch
):
    """One token of each of three sequences (different prompts, so different positions and caches) through
    every layer in one C call (hc_decode_step) gives the logits, bit for bit, and the per-sequence
    firing counts of the same batched step layer by layer: the predictor's sparse tail and a dense file's."""
    if cpu.backend() != "c":
        pytest.skip("C kernels unavailable")
    from hotcold.convert.quantize import quantize_file
    from hotcold.runtime.state import Batch

    src = tiny_sparse_gguf if kind == "sparse" else tiny_dense_gguf
    path = quantize_file(src, tmp_path / f"m.{outtype}.gguf", outtype)
    prompts = [[1, 5, 9], [1, 300, 2, 77, 8], [1, 42]]

    def run():
        llm = hotcold.load(path, device="cpu", threads=2)
        model, tok = llm.loaded.model, llm.tokenizer
        engines = [Engine(model, tok, 64) for _ in prompts]
        for engine, ids in zip(engines, prompts):
            engine.prefill(ids)
        tokens, steps = [7, 11, 13], []
        with torch.inference_mode():
            for step in range(4):
                ctx = Batch([e.seq for e in engines], [len(p) + step for p in prompts], [1] * len(prompts))
                logits = model.forward(torch.tensor(tokens), ctx, last_only=True)
                steps.append(logits)
                tokens = [int(t) for t in logits.argmax(-1)]
        return steps, [e.seq.neuron_totals() for e in engines]

    used = counted(monkeypatch)
    one_call = run()
    assert len(used) == 4 and all(used)  # every batched step took the one call
    real = CPUDecoder.__call__
    monkeypatch.setattr(
        CPUDecoder, "__call__", lambda self, x, ctx: None if len(ctx.seqs) > 1 else real(self, x, ctx)
    )
    layers = run()
    assert all(torch.equal(a, b) for a, b in zip(one_call[0], layers[0]))
    assert one_call[1] == layers[1]
    if kind == "sparse":
        assert len({c for c in one_call[1]}) == 3  # each sequence counted its own rows
