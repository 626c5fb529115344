"""The batching scheduler over the bundled model: FIFO order, cancellation (queued and running), errors,
prefix affinity, and every request's tokens equal to running it alone, whatever else is in the batch."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import hotcold
from hotcold.runtime.engine import Engine
from hotcold.runtime.sampling import SamplingParams
from hotcold.server.scheduler import GenerationRequest, QueueFull, RequestFailed, Scheduler, SchedulerClosed
from hotcold.structured import Constraint

TIMEOUT_S = 60
PROMPTS = [
    "In the beginning God created the heaven and the earth.",
    "And God said",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures",
    "Blessed are the meek",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel",
    "For God so loved the world",
    "Now the serpent was more subtil than any beast of the field",
    "Let there be light",
]


@pytest.fixture(scope="module", params=["sparse", "dense"])
def llm(request):
    return hotcold.load(device="cpu", threads=2, dense=request.param == "dense", ctx_size=256)


class Model:
    """The real model behind a forward hook: an optional delay per forward, a token that makes the forward
    fail, and a record of the prompt chunks prefilled (segments of more than one token), in order."""

    def __init__(self, model, delay: float = 0.0, fail_on: int | None = None):
        self._model, self.delay, self.fail_on = model, delay, fail_on
        self.started: list[int] = []
        self.forwards = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, ctx, **kwargs):
        self.forwards += 1
        row = 0
        for n in ctx.lengths:
            if n > 1:
                self.started.append(tokens[row : row + n].tolist())
            row += n
        if self.fail_on is not None and self.fail_on in tokens.tolist():
            raise RuntimeError("kernel exploded")
        time.sleep(self.delay)
        return self._model.forward(tokens, ctx, **kwargs)


def scheduler(llm, n_slots: int, model=None, **kwargs) -> Scheduler:
    model = model or Model(llm.loaded.model)
    return Scheduler([Engine(model, llm.tokenizer, llm.ctx_size) for _ in range(n_slots)], **kwargs)


def request(
    llm, i: int, n: int = 8, params: SamplingParams = SamplingParams(), ids=None
) -> GenerationRequest:
    return GenerationRequest(ids or llm.tokenize(PROMPTS[i % len(PROMPTS)]), n, params, ignore_eos=True)


def started(model: Model, reqs: list[GenerationRequest]) -> list[int]:
    """Which requests began prefilling, in order (a chunk is the end of its prompt: the rest was cached)."""
    return [next(i for i, r in enumerate(reqs) if r.prompt_ids[-len(c) :] == c) for c in model.started]


def alone(llm, r: GenerationRequest) -> tuple[str, list[int]]:
    engine = Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size)
    chunks = list(engine.stream(r.prompt_ids, max_tokens=r.max_tokens, params=r.params, ignore_eos=True))
    return "".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None]


async def collect(job) -> tuple[str, list[int]]:
    chunks = [c async for c in job]
    return "".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def run_then_close(sched: Scheduler, main):
    """run(main()), then close the scheduler whatever happened."""
    try:
        return run(main())
    finally:
        sched.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_of_mixed_requests_equals_each_alone(llm, threads):
    """8 requests of different prompts, lengths and arrival times, greedy and seeded sampling, in one
    batch: each gets exactly the tokens it gets alone; the batch really ran them together."""
    torch.set_num_threads(threads)
    try:
        reqs = [
            request(llm, i, n=6 + 3 * i, params=SamplingParams(0.9, seed=i) if i % 2 else SamplingParams())
            for i in range(8)
        ]
        refs = [alone(llm, r) for r in reqs]
        model = Model(llm.loaded.model)
        sched = scheduler(llm, 8, model)

        async def main():
            jobs = []
            for i, r in enumerate(reqs):
                jobs.append(sched.submit(r))
                if i in (2, 5):
                    await asyncio.sleep(0.05)  # later arrivals join a running batch
            return await asyncio.gather(*(collect(j) for j in jobs))

        got = run_then_close(sched, main)
        assert got == refs
        total_tokens = sum(r.max_tokens for r in reqs)
        assert model.forwards < total_tokens / 2  # several requests per forward
    finally:
        torch.set_num_threads(2)


def test_request_arriving_while_seven_decode_and_a_cancelled_one(llm):
    reqs = [request(llm, i, n=24) for i in range(7)]
    late = request(llm, 7, n=10)
    refs = [alone(llm, r) for r in reqs]
    late_ref = alone(llm, late)
    sched = scheduler(llm, 8)

    async def main():
        jobs = [sched.submit(r) for r in reqs]
        async for _ in jobs[3]:
            break  # its client reads one chunk and goes away: the others must not notice
        jobs[3].cancel()
        await asyncio.sleep(0.05)
        late_job = sched.submit(late)
        others = await asyncio.gather(*(collect(j) for i, j in enumerate(jobs) if i != 3))
        return others, await collect(late_job)

    others, got_late = run_then_close(sched, main)
    assert others == [ref for i, ref in enumerate(refs) if i != 3]
    assert got_late == late_ref
    assert sched.cancelled == 1


def test_one_slot_serves_requests_first_in_first_out(llm):
    model = Model(llm.loaded.model)
    sched = scheduler(llm, 1, model)
    reqs = [request(llm, i, n=3) for i in range(4)]

    async def main():
        jobs = [sched.submit(r) for r in reqs]
        assert sched.queue_depth == 3 and sched.busy == 1
        return await asyncio.gather(*(collect(j) for j in jobs))

    got = run_then_close(sched, main)
    assert got == [alone(llm, r) for r in reqs]
    assert started(model, reqs) == [0, 1, 2, 3]
    assert sched.queue_depth == 0 and sched.busy == 0


def test_cancelled_running_job_stops_and_frees_its_slot(llm):
    model = Model(llm.loaded.model, delay=0.01)
    sched = scheduler(llm, 1, model)
    waiting_req = request(llm, 1, n=2)

    async def main():
        long = sched.submit(request(llm, 0, n=200))
        waiting = sched.submit(waiting_req)
        async for _ in long:
            break  # the client read one chunk and went away
        long.cancel()
        return await collect(waiting)

    try:
        assert run(main()) == alone(llm, waiting_req)
    finally:
        sched.close()
    assert model.forwards < 60  # the long generation left the batch at the next step
    assert sched.cancelled == 1


def test_cancelled_queued_job_never_runs(llm):
    model = Model(llm.loaded.model)
    sched = scheduler(llm, 1, model)
    first, queued, last = (request(llm, i, n=3) for i in (0, 1, 3))

    async def main():
        jobs = [sched.submit(r) for r in (first, queued, last)]
        jobs[1].cancel()
        assert sched.queue_depth == 1
        return await asyncio.gather(collect(jobs[0]), collect(jobs[2]))

    try:
        assert run(main()) == [alone(llm, first), alone(llm, last)]
    finally:
        sched.close()
    assert started(model, [first, queued, last]) == [0, 2]


def test_cancel_after_the_end_is_not_counted(llm):
    sched = scheduler(llm, 1)

    async def main():
        job = sched.submit(request(llm, 0, n=2))
        text = await collect(job)
        job.cancel()
        return text

    run_then_close(sched, main)
    assert sched.cancelled == 0


def test_forward_error_reaches_the_client_and_the_server_carries_on(llm):
    marker = llm.tokenize("zebra", add_bos=False)[0]
    sched = scheduler(llm, 1, Model(llm.loaded.model, fail_on=marker))
    good = request(llm, 1, n=2)

    async def main():
        bad = sched.submit(request(llm, 0, ids=llm.tokenize("zebra zebra")))
        with pytest.raises(RuntimeError, match="kernel exploded"):
            await collect(bad)
        return await collect(sched.submit(good))

    try:
        assert run(main()) == alone(llm, good)
    finally:
        sched.close()


def test_free_slot_with_the_longest_shared_prefix_is_chosen(llm):
    engines = [Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size) for _ in range(2)]
    a_ids, b_ids = llm.tokenize(PROMPTS[0]), llm.tokenize(PROMPTS[2])
    engines[0].cached_ids, engines[1].cached_ids = a_ids[:3], b_ids[:5]  # pretend earlier requests
    sched = Scheduler(engines)

    async def main():
        await collect(sched.submit(GenerationRequest(b_ids, 1)))
        await collect(sched.submit(GenerationRequest(a_ids, 1)))

    run_then_close(sched, main)
    assert engines[1].cached_ids[: len(b_ids)] == b_ids and engines[0].cached_ids[: len(a_ids)] == a_ids


def test_full_queue_is_refused_and_close_fails_queued_jobs(llm):
    release = threading.Event()

    class Blocking(Model):
        def forward(self, *args, **kwargs):
            release.wait(TIMEOUT_S)
            return super().forward(*args, **kwargs)

    sched = scheduler(llm, 1, Blocking(llm.loaded.model), max_queue=2)

    async def main():
        sched.submit(request(llm, 0, n=1))
        await asyncio.sleep(0.05)  # the slot picks it up
        queued = [sched.submit(request(llm, i, n=1)) for i in (1, 2)]
        with pytest.raises(QueueFull):
            sched.submit(request(llm, 3, n=1))
        sched.close()
        with pytest.raises(SchedulerClosed):
            await collect(queued[0])
        with pytest.raises(SchedulerClosed):
            sched.submit(request(llm, 4, n=1))
        release.set()

    run(main())


def test_without_a_queue_only_free_slots_take_requests(llm):
    sched = scheduler(llm, 1, max_queue=0)

    async def main():
        job = sched.submit(request(llm, 0, n=4))
        with pytest.raises(QueueFull):
            sched.submit(request(llm, 1, n=1))
        return await collect(job)

    run_then_close(sched, main)


def test_choices_of_one_prompt_run_it_once_and_equal_each_alone(llm):
    """`n` choices (submit_all of one prompt, seeds s, s+1, s+2): the prompt is prefilled once, the others
    start from a copy of its cache and its last logits, and each choice's tokens equal its request alone.
    A choice whose leader was cancelled before it ran prefills for itself."""
    prompt = llm.tokenize(PROMPTS[3])
    reqs = [request(llm, 0, n=8, params=SamplingParams(1.0, seed=40 + i), ids=prompt) for i in range(3)]
    refs = [alone(llm, r) for r in reqs]
    model = Model(llm.loaded.model)
    sched = scheduler(llm, 3, model)

    async def main():
        jobs = sched.submit_all(reqs)
        return await asyncio.gather(*(collect(j) for j in jobs))

    got = run_then_close(sched, main)
    assert got == refs
    assert len(set(tuple(t) for _, t in got)) > 1  # the seeds differ, so do the samples
    assert len(model.started) == 1  # one prefill for the three

    model = Model(llm.loaded.model)
    sched = scheduler(llm, 1, model)  # one slot: the followers queue behind the leader

    async def cancelled_leader():
        jobs = sched.submit_all(reqs[:2])
        jobs[0].cancel()
        return await collect(jobs[1])

    try:
        assert run(cancelled_leader()) == refs[1]
    finally:
        sched.close()
    assert len(model.started) == 1  # the follower's own prefill


def _sharing(llm, suffix_a: str, suffix_b: str):
    """Prompts A and B that share their first part; A runs in one slot, B arrives while it decodes and takes
    the other slot: (A, B, shared token count, the two results, the prompt chunks prefilled, refs alone)."""
    shared = PROMPTS[2] + " " + PROMPTS[4]
    a = GenerationRequest(llm.tokenize(shared + suffix_a), 30, SamplingParams(), ignore_eos=True)
    b = GenerationRequest(llm.tokenize(shared + suffix_b), 8, SamplingParams(), ignore_eos=True)
    n = next(i for i, (x, y) in enumerate(zip(a.prompt_ids, b.prompt_ids)) if x != y)
    refs = [alone(llm, a), alone(llm, b)]
    model = Model(llm.loaded.model)
    sched = scheduler(llm, 2, model)

    async def main():
        job_a = sched.submit(a)
        it = job_a.__aiter__()
        first = await it.__anext__()  # A's prompt is in its slot now
        job_b = sched.submit(b)
        rest_a = [c async for c in it]
        got_b = await collect(job_b)
        chunks = [first, *rest_a]
        return ("".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None]), got_b

    got_a, got_b = run_then_close(sched, main)
    return a, b, n, got_a, got_b, model.started, refs


def test_prompt_sharing_its_start_with_another_slot_copies_it(llm):
    """B shares its first tokens with A, which is decoding in the other slot: B's slot copies those keys and
    values and prefills only the rest, and both get exactly the tokens they get alone."""
    a, b, n, got_a, got_b, started, refs = _sharing(llm, " and then", " but now")
    assert n > 10
    assert [got_a, got_b] == refs
    assert started == [a.prompt_ids, b.prompt_ids[n:]]  # B computed only what A's slot did not hold


def test_rows_forwarded_with_many_others_are_not_shared(llm):
    """A prompt of GEMM_MIN_TOKENS rows or more is prefilled in one forward whose rows' bits depend on each
    other (the GEMM path): its slot's rows are not copied, B prefills its whole prompt, and still gets the
    tokens it gets alone."""
    long_tail = " " + " ".join(PROMPTS)
    a, b, n, got_a, got_b, started, refs = _sharing(llm, long_tail, " but now")
    assert len(a.prompt_ids) >= 96 and n > 10
    assert [got_a, got_b] == refs
    assert started == [a.prompt_ids, b.prompt_ids]


def test_prompts_arriving_together_share_their_start(llm):
    """A and B arrive together and share their first 50 tokens; together they do not fit in one forward, so A
    prefills first and B, before its own first forward, copies A's 50 rows and prefills only its last 10;
    both get exactly the tokens they get alone."""
    base = llm.tokenize(" ".join(PROMPTS * 3))
    other = llm.tokenize(" ".join(reversed(PROMPTS)))
    a = GenerationRequest(base[:60], 6, SamplingParams(), ignore_eos=True)
    b = GenerationRequest(base[:50] + other[1:11], 6, SamplingParams(), ignore_eos=True)
    assert b.prompt_ids[50] != a.prompt_ids[50]
    refs = [alone(llm, a), alone(llm, b)]
    model = Model(llm.loaded.model)
    sched = scheduler(llm, 2, model)

    async def main():
        jobs = sched.submit_all([a, b])
        return await asyncio.gather(*(collect(j) for j in jobs))

    got = run_then_close(sched, main)
    assert got == refs
    assert model.started == [a.prompt_ids, b.prompt_ids[50:]]


def test_a_request_failing_in_its_own_step_fails_alone(llm):
    """A constraint that fails at the first token (compiled past the admission check) ends its request with
    a 400 naming its field; the requests batched with it give what they give alone (before, the error
    raised out of the batch step and every request of it got a 500 with this request's text)."""
    import llguidance

    endless = Constraint(llguidance.grammar_from("grammar", 'root ::= "a" root'), "grammar")
    good = [request(llm, i, n=6) for i in (1, 2)]
    bad = GenerationRequest(llm.tokenize(PROMPTS[0]), 6, constraint=endless)
    sched = scheduler(llm, 3)

    async def main():
        jobs = sched.submit_all([good[0]]), sched.submit_all([bad]), sched.submit_all([good[1]])
        results = await asyncio.gather(*(collect(j[0]) for j in jobs), return_exceptions=True)
        return results, await collect(sched.submit(good[0]))  # and the server goes on

    (first, failed, second), again = run_then_close(sched, main)
    assert isinstance(failed, RequestFailed), failed
    assert failed.status == 400 and failed.param == "grammar" and str(failed).startswith("grammar: ")
    assert "<state>" not in str(failed)  # llguidance's first line, not its parser dump
    assert [first, second, again] == [alone(llm, good[0]), alone(llm, good[1]), alone(llm, good[0])]


def test_a_request_with_several_choices_takes_one_queue_place(llm):
    """The queue counts requests: with one place left, a request with n=3 gets it as a request with n=1
    would (counting choices, n=3 needed three places free at once and n=1 requests kept taking them)."""
    release = threading.Event()

    class Blocking(Model):
        def forward(self, *args, **kwargs):
            release.wait(TIMEOUT_S)
            return super().forward(*args, **kwargs)

    sched = scheduler(llm, 1, Blocking(llm.loaded.model), max_queue=2)

    async def main():
        running = sched.submit(request(llm, 0, n=1))
        one = sched.submit(request(llm, 1, n=1))  # the first queue place
        prompt = llm.tokenize(PROMPTS[2])
        three = sched.submit_all([request(llm, 2, n=2, ids=prompt) for _ in range(3)])  # the second
        with pytest.raises(QueueFull, match="2 requests are already queued"):
            sched.submit(request(llm, 3, n=1))
        release.set()
        return await asyncio.gather(collect(running), collect(one), *(collect(j) for j in three))

    results = run_then_close(sched, main)
    assert [len(tokens) for _, tokens in results] == [1, 1, 2, 2, 2]


def test_a_request_failing_mid_stream_reports_its_own_status():
    """Headers are sent when a streamed request fails on its own: the error event carries its 400 and field (as
    llama-server's in-stream errors do), not a server_error."""
    import json

    from hotcold.server.streaming import events

    class Failing:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise RequestFailed("grammar: no token is allowed", status=400, param="grammar")

        def cancel(self):
            pass

    class Plain:
        id, done = "cmpl-1", "[DONE]"

        def start(self, n):
            return []

        def tail(self, stats):
            return []

    async def main():
        return [line async for line in events([Failing()], Plain())]

    lines = asyncio.run(main())
    error = json.loads(lines[0].removeprefix("data: "))["error"]
    assert error == {"message": "grammar: no token is allowed", "type": "invalid_request_error",
                     "param": "grammar", "code": 400}  # fmt: skip
    assert lines[-1] == "data: [DONE]\n\n"
