"""The output head's screen (hotcold.runtime.head_screen): its bounds hold on every row, the argmax it leaves is the
full head's, and greedy generation through it gives the full head's tokens while computing fewer rows."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

import hotcold
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import build
from hotcold.runtime import head_screen
from hotcold.runtime.engine import Engine
from hotcold.runtime.generation import Generation
from hotcold.runtime.head_screen import HeadScreen
from hotcold.runtime.sampling import SamplingParams
from hotcold.runtime.state import HeadNeed

pytestmark = pytest.mark.skipif(build.get_lib() is None, reason="the screen needs the C kernels")


def head(v: int, d: int, dtype=torch.float16, seed: int = 0) -> torch.Tensor:
    """Rows of very different norms and a few outlier columns, as trained heads have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) * torch.rand(v, 1, generator=g).mul(2).add(0.1)
    w[:, :3] *= 8.0
    return w.to(dtype)


def inputs(t: int, d: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    x[:, 5] *= 40.0  # a massive activation channel
    return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("massive", [False, True])
def test_bounds_hold_on_every_row(dtype, massive):
    w, x = head(4096, 128, dtype), inputs(4, 128)
    if not massive:
        x[:, 5] /= 40.0
    screen = HeadScreen.build(w)
    s, bound = screen.bounds(x)
    exact = x.double() @ w.double().T
    assert bool(((s - exact).abs() <= bound).all())
    mask = screen.candidates(x)
    assert torch.equal(mask[torch.arange(4), exact.argmax(-1)], torch.ones(4, dtype=torch.bool))
    # a massive activation channel coarsens x's int8 chunk around it (a looser bound, more rows survive)
    assert int(mask.sum()) < 4 * 4096 // (8 if massive else 50)


def test_screened_rows_are_the_full_heads_and_the_argmax_is_kept():
    w, x = head(8192, 256), inputs(3, 256, seed=7)
    screen = HeadScreen.build(w)
    values, mask = screen.rows(w, x)
    full = hotcold.kernels.cpu.matmul(w, x)
    assert torch.equal(values[mask], full[mask])  # the same row kernel, the same bits
    assert bool((values[~mask] == 0).all())
    assert torch.equal(values.masked_fill(~mask, float("-inf")).argmax(-1), full.argmax(-1))


def test_near_ties_keep_both_rows():
    """Two rows within a rounding step of each other: the screen cannot tell them apart, so both are
    computed and the exact comparison decides."""
    w, x = head(4096, 64, seed=3), inputs(1, 64, seed=4)
    best = int((x.double() @ w.double().T).argmax())
    w[best + 1] = w[best]
    w[best + 1, 10] += 1e-3  # fp16 step there: the rows differ in one value, by less than Q8_0 sees
    screen = HeadScreen.build(w)
    mask = screen.candidates(x)
    assert bool(mask[0, best]) and bool(mask[0, best + 1])


def test_no_screen_where_it_cannot_save_or_cannot_prove():
    assert HeadScreen.build(head(head_screen.MIN_ROWS - 1, 64)) is None  # too few rows to matter
    assert HeadScreen.build(head(4096, 48)) is None  # columns not in chunks of 32
    w = head(4096, 64)
    w[17, 3] = float("nan")
    assert HeadScreen.build(w) is None  # no bound on a NaN row (the full head reports it)
    from hotcold.gguf import quants

    q8 = GGMLQuantizationType.Q8_0
    q = QuantTensor(torch.from_numpy(quants.quantize(head(4096, 64).float(), q8)), q8, (4096, 64))
    assert HeadScreen.build(q) is None  # a block-format head: a cheaper copy's bounds are too loose


def test_greedy_generation_through_the_screen_equals_the_full_head():
    """The bundled model (F16 head, 8192 rows): the same greedy tokens from the prompt on, with a fraction
    of the head's rows computed; a sampled generation reads every row."""
    screened, full = hotcold.load(None, threads=1), hotcold.load(None, threads=1, head_screen=False)
    assert screened.loaded.model.head.screen is not None and full.loaded.model.head.screen is None
    prompt = "Once upon a time"
    a = screened.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    b = full.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert a == b
    computed, total = screened.engine.seq.head_rows
    assert 0 < computed < total / 10
    computed, total = full.engine.seq.head_rows
    assert computed == total


def test_what_each_decode_step_needs_of_the_head():
    llm = hotcold.load(None, threads=1)
    engine = Engine(llm.loaded.model, llm.tokenizer, 64)

    def need(**kw):
        logprobs = kw.pop("logprobs", None)
        g = Generation(engine, [1, 5, 9], max_tokens=4, params=SamplingParams(**kw), logprobs=logprobs)
        assert g.head_need is None  # the prompt's last logits may be shared with a request that samples
        g.take(engine.forward(*g.want(), last_only=True)[-1])
        return g.head_need, g.tokens

    assert need(temperature=0.0)[0] == HeadNeed(1, ((),))
    assert need(temperature=0.8, top_k=40)[0] == HeadNeed(40, ((),))
    got, tokens = need(temperature=0.0, repeat_penalty=1.1, repeat_last_n=2)
    assert got == HeadNeed(1, (tuple(sorted(set(tokens[-2:]))),))  # the penalty's window, computed exactly
    for kw in (dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(logprobs=2)):
        assert need(**kw)[0] is None, kw  # the whole distribution (or its normaliser) is read


def test_penalised_and_top_k_generation_through_the_screen_equals_the_full_head():
    """The repeat penalty lowers rows the screen set aside (computed exactly), top-k reads the k largest: the
    screened generation is the full head's, token for token."""
    screened, full = hotcold.load(None, threads=1), hotcold.load(None, threads=1, head_screen=False)
    prompt = "Once upon a time"
    for kw in (
        dict(temperature=0.0, repeat_penalty=1.3),
        dict(temperature=0.8, top_k=20, seed=3),
        dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.2, seed=4),
    ):
        a = screened.generate(prompt, max_tokens=24, ignore_eos=True, **kw)
        assert a == full.generate(prompt, max_tokens=24, ignore_eos=True, **kw), kw
    computed, total = screened.engine.seq.head_rows
    assert computed < total / 4


def test_keep_rows_and_top_k_are_always_candidates():
    w, x = head(4096, 128, seed=5), inputs(2, 128, seed=6)
    x[:, 5] /= 40.0
    screen = HeadScreen.build(w)
    exact = x.double() @ w.double().T
    keep = ((int(exact[0].argmin()), 7), ())
    mask = screen.candidates(x, top=8, keep=keep)
    assert bool(mask[0, keep[0][0]]) and bool(mask[0, 7])
    for t in range(2):
        assert bool(mask[t, exact[t].topk(8).indices].all())
    assert int(mask.sum()) < 2 * 4096 // 10


def test_screened_logits_are_minus_inf_off_the_candidates():
    llm = hotcold.load(None, threads=1)
    engine = Engine(llm.loaded.model, llm.tokenizer, 64)
    engine.prefill([1, 5, 9])
    logits = engine.forward([11], 3, last_only=True, head_need=HeadNeed(1))[-1]
    finite = torch.isfinite(logits)
    assert 0 < int(finite.sum()) < logits.numel() // 10
    assert bool((logits[~finite] == float("-inf")).all())


def test_non_finite_products_are_reported_as_without_the_screen():
    """An activation that overflows the head: the screened step's check still names it (a screened step whose
    computed rows are not finite is redone whole; a -inf the screen left is not an error)."""
    from hotcold.models.base import Head
    from hotcold.ops import Norm
    from hotcold.runtime.generation import NonFiniteLogits, check_finite
    from hotcold.runtime.state import Batch, SequenceState

    w = head(4096, 64)
    h = Head(Norm(torch.ones(64), 1e-6, rms=True), w, screen=HeadScreen.build(w))
    seq = SequenceState(None, [])
    fine = h(inputs(1, 64), Batch([seq], [0], [1], head_need=HeadNeed(1)), last_only=True)
    assert seq.head_screened and bool(torch.isinf(fine).any())
    check_finite(fine[0], "here", screened=seq.head_screened)  # the screen's -inf: no error
    x = inputs(1, 64)
    x[0, 7] = float("inf")
    bad = h(x, Batch([seq], [0], [1], head_need=HeadNeed(1)), last_only=True)
    with pytest.raises(NonFiniteLogits):
        check_finite(bad[0], "here", screened=seq.head_screened)


def test_a_batch_through_the_screen_equals_each_request_alone(monkeypatch):
    """Continuous batching: one forward for every sequence's next token, the head screened for all the rows
    (HeadNeed.of_rows: the largest top, each row's own penalty window), each sequence's tokens as alone."""
    llm = hotcold.load(None, threads=1)
    rows_seen = []
    screen_rows = HeadScreen.rows

    def counting(self, weight, x, **kw):
        rows_seen.append(x.shape[0])
        return screen_rows(self, weight, x, **kw)

    monkeypatch.setattr(HeadScreen, "rows", counting)
    prompts = ["Once upon a time", "The cat", "In the beginning there was"]
    for kw in (dict(temperature=0.0), dict(temperature=0.0, repeat_penalty=1.2)):
        alone = [llm.generate(p, max_tokens=12, ignore_eos=True, **kw) for p in prompts]
        assert llm.generate_batch(prompts, max_tokens=12, ignore_eos=True, **kw) == alone, kw
    assert 3 in rows_seen  # the batch's steps went through the screen, all three rows at once
    assert HeadNeed.of_rows([HeadNeed(1, ((3,),)), HeadNeed(40, ((),))]) == HeadNeed(40, ((3,), ()))
    assert HeadNeed.of_rows([HeadNeed(1, ((),)), None]) is None


def reference_candidates(screen: HeadScreen, x: torch.Tensor, top: int, keep) -> torch.Tensor:
    """The candidates as the bounds define them, in torch (float64): the C selection must give these rows."""
    s, bound = screen.bounds(x)
    low = s - bound
    kept = torch.zeros(low.shape, dtype=torch.bool)
    for j, ids in enumerate(keep):
        if ids:
            kept[j, torch.tensor(ids, dtype=torch.long)] = True
    lo = low.masked_fill(kept, float("-inf")).topk(top, dim=-1).values[:, -1:]
    return (s + bound >= lo) | kept


@pytest.mark.parametrize("top", [1, 2, 40, 256])
def test_the_c_selection_gives_the_bounds_candidates(top):
    """hc_screen_select (a heap of the top lower bounds, then the mask) against the same rule in torch, with kept
    rows (a repeat penalty's window) on some tokens and not others, 1 and 2 threads."""
    w, x = head(8192, 128, seed=11), inputs(3, 128, seed=12)
    screen = HeadScreen.build(w)
    keep = ((3, 4095, 17), (), (8191,))
    want = reference_candidates(screen, x, top, keep)
    for threads in (1, 2):
        assert torch.equal(screen.candidates(x, top=top, keep=keep, threads=threads), want)
    assert torch.equal(screen.candidates(x, top=top), reference_candidates(screen, x, top, ()))


def test_the_c_selection_refuses_bad_arguments_and_keeps_every_row_for_nan():
    w = head(4096, 64)
    screen = HeadScreen.build(w)
    x = inputs(2, 64)
    with pytest.raises(ValueError, match="kept row out of range"):
        screen.candidates(x, keep=((4096,), ()))
    with pytest.raises(ValueError, match="top 4097"):
        screen.candidates(x, top=4097)
    x[1, 3] = float("nan")
    mask = screen.candidates(x)
    assert (
        bool(mask[1].all()) and int(mask[0].sum()) < 4096 // 10
    )  # the NaN token: every row, for the head to see
