"""hotcold.runtime.engine over one shared model: each engine's state is its own, so generations running at the
same time get the tokens and the firing figures they get alone."""

from __future__ import annotations

import threading

import pytest
import torch

import hotcold
from hotcold.runtime.engine import Engine
from hotcold.runtime.sampling import SamplingParams

PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying"]
N_TOKENS = 24


@pytest.fixture(scope="module")
def demo():
    return hotcold.load(device="cpu", threads=2)  # the bundled sparse model: C kernels, fused sparse step


def run(llm, prompt: str, params: SamplingParams, start: threading.Barrier | None = None):
    engine = Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size)
    ids = llm.tokenize(prompt)
    if start is not None:
        start.wait()
    tokens, final = [], None
    for chunk in engine.stream(ids, max_tokens=N_TOKENS, params=params, ignore_eos=True):
        if chunk.token is not None:
            tokens.append(chunk.token)
        final = chunk
    return tokens, final.stats.neurons_computed, final.stats.neurons_total, engine.cached_ids


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_concurrent_generations_equal_each_alone(demo, params):
    alone = [run(demo, p, params) for p in PROMPTS]
    assert alone[0][0] != alone[1][0]  # different prompts, different text: the test can tell them apart
    for _, computed, total, _ in alone:
        assert 0.05 < computed / total < 0.95  # the predictors really skip neurons
    for _ in range(2):  # twice: the threads interleave differently each time
        results: list = [None, None]
        start = threading.Barrier(2)

        def worker(i: int, results=results, start=start) -> None:
            results[i] = run(demo, PROMPTS[i], params, start)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == alone  # token ids, neurons computed / total, the cached ids: all each one's own


def test_logits_reference_flag_is_per_call(demo):
    """engine.logits(dense=True) computes every neuron for that call only; the next call is sparse again."""
    engine = Engine(demo.loaded.model, demo.tokenizer, demo.ctx_size)
    ids = demo.tokenize(PROMPTS[0])
    engine.logits(ids, dense=True)
    computed, total = engine.seq.neuron_totals()
    assert computed == total > 0
    sparse = engine.logits(ids)
    c2, t2 = engine.seq.neuron_totals()
    assert t2 == 2 * total and c2 - computed < (t2 - total) * 0.95
    dense_model = hotcold.load(device="cpu", dense=True)
    reference = dense_model.logits(ids)
    assert torch.allclose(engine.logits(ids, dense=True), reference, atol=1e-4 * reference.abs().max())
    assert not torch.equal(sparse, reference)


def test_exact_counts_the_cached_rows_another_slot_may_copy(demo):
    """Engine.exact: rows forwarded a few at a time on the CPU kernels keep their own bits wherever they ran
    (another slot may copy them); a forward of GEMM_MIN_TOKENS rows or more, or the dense reference, does
    not, and rows after it inherit that."""
    from hotcold.kernels import cpu

    engine = Engine(demo.loaded.model, demo.tokenizer, demo.ctx_size)
    ids = demo.tokenize(PROMPTS[0])
    list(engine.stream(ids, max_tokens=4, ignore_eos=True))
    assert engine.exact == len(engine.cached_ids) == len(ids) + 3  # the last sampled token is not forwarded
    other = Engine(demo.loaded.model, demo.tokenizer, demo.ctx_size)
    other.copy_prefix(engine, 5)
    assert other.exact == 5 and other.cached_ids == ids[:5]
    long_ids = (ids * cpu.GEMM_MIN_TOKENS)[: len(ids) + cpu.GEMM_MIN_TOKENS]
    engine.prefill(long_ids)  # shares its prompt with the cache: GEMM_MIN_TOKENS rows after it, one forward
    assert engine.exact == len(ids) and len(engine.cached_ids) == len(long_ids)
    engine.logits(ids, dense=True)
    assert engine.exact == 0
    engine.prefill(ids)
    assert engine.exact == 0  # the dense rows before stay, so nothing after them counts either
    engine.logits(ids)
    assert engine.exact == len(ids)
