"""hotcold.runtime.batching.step: which generations share a forward, and that sharing never changes a token."""

from __future__ import annotations

import pytest

import hotcold
from hotcold import ops
from hotcold.runtime import batching
from hotcold.runtime.engine import Engine
from hotcold.runtime.generation import Generation, common_prefix

SHORT = ["In the beginning", "And God said", "Jesus wept", "Blessed are the meek"]


@pytest.fixture(scope="module")
def llm():
    return hotcold.load(device="cpu", threads=2)


@pytest.fixture
def forwards(llm, monkeypatch):
    """The row count of every forward the model runs."""
    model, rows = llm.loaded.model, []
    forward = model.forward

    def counted(tokens, ctx, **kw):
        rows.append([len(ids) for ids in _segments(tokens, ctx)])
        return forward(tokens, ctx, **kw)

    monkeypatch.setattr(model, "forward", counted)
    return rows


def _segments(tokens, ctx):
    return [tokens[a:b].tolist() for a, b in ctx.bounds]


def _generations(llm, prompts, max_tokens=6):
    model = llm.loaded.model
    ids = [llm.tokenize(p) for p in prompts]
    engines = [Engine(model, llm.tokenizer, 256) for _ in ids]
    return ids, [Generation(e, p, max_tokens=max_tokens, ignore_eos=True) for e, p in zip(engines, ids)]


def test_short_prompts_prefill_together_in_one_forward(llm, forwards):
    ids, gens = _generations(llm, SHORT)
    assert sum(map(len, ids)) <= batching.MAX_ROWS
    batching.step(llm.loaded.model, gens)
    assert forwards == [[len(p) for p in ids]]  # one forward, every prompt a segment
    assert not any(g.prefilling for g in gens)


def test_a_prefill_joins_only_when_it_fits(llm, forwards):
    long = "And the LORD spake unto Moses, saying"
    while len(llm.tokenize(long)) <= batching.MAX_ROWS:
        long += " And the LORD spake unto Moses, saying"
    ids, gens = _generations(llm, [long, "Jesus wept"])
    n_long = len(ids[0])
    assert batching.MAX_ROWS < n_long <= 512  # one chunk, too big to share a forward
    batching.step(llm.loaded.model, gens)
    assert forwards == [[n_long]] and gens[1].prefilling  # the short one waits
    batching.step(llm.loaded.model, gens)
    assert forwards[1] == [1, len(ids[1])]  # the long one's first token, then the short prompt


@pytest.mark.parametrize("rows_work", [None, 0, 12])
def test_tokens_equal_each_generation_alone(llm, monkeypatch, rows_work):
    """Also where prompt chunks attend through SDPA (rows_work 0) or some do and some as C rows (12: the
    shortest prompts' chunks only) beside decode rows: the rule follows each chunk, so alone is the same."""
    if rows_work is not None:
        monkeypatch.setattr(ops, "ROWS_ATTENTION_MAX_WORK", rows_work)
    _, gens = _generations(llm, SHORT, max_tokens=12)
    texts = [""] * len(gens)
    while any(not g.done for g in gens):
        batching.step(llm.loaded.model, gens)
        for i, g in enumerate(gens):
            texts[i] += "".join(c.text for c in g.drain())
    alone = [llm.generate(p, max_tokens=12, ignore_eos=True) for p in SHORT]
    assert texts == alone and len(set(texts)) == len(SHORT)


def test_a_prompt_waits_to_copy_the_start_an_earlier_one_computes(llm, forwards):
    """Two prompts from one template arriving together: the second waits one step, copies the start the first
    computed (share_starts) and prefills only the rest; each still gets the tokens it gets alone. A prompt
    sharing fewer than SHARE_WAIT_MIN tokens does not wait."""
    template = "Once upon a time there was a little girl who lived in a village near the forest."
    prompts = [template + " Jesus wept", template + " And God said", "Blessed are the meek"]
    ids, gens = _generations(llm, prompts, max_tokens=6)
    shared = common_prefix(ids[0], ids[1])
    assert shared >= batching.SHARE_WAIT_MIN and common_prefix(ids[0], ids[2]) < batching.SHARE_WAIT_MIN
    texts = [""] * len(gens)
    while any(not g.done for g in gens):
        batching.share_starts(gens)
        batching.step(llm.loaded.model, gens)
        for i, g in enumerate(gens):
            texts[i] += "".join(c.text for c in g.drain())
    assert forwards[0] == [len(ids[0]), len(ids[2])]  # the second waits; the third shares only the BOS
    assert (
        forwards[1][:2] == [1, 1] and forwards[1][2] == len(ids[1]) - shared
    )  # its rest beside two decode rows
    assert sum(n for f in forwards for n in f if n > 1) == len(ids[0]) + len(ids[2]) + len(ids[1]) - shared
    alone = [llm.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]
    assert texts == alone
