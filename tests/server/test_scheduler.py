"""The scheduler over fake engines: FIFO order, cancellation (queued and running), errors, prefix affinity."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hotcold.engine import Chunk, GenerationStats
from hotcold.server.scheduler import GenerationRequest, QueueFull, Scheduler, SchedulerClosed

TIMEOUT_S = 10


class FakeEngine:
    """Yields one chunk per 'token' ("t0", "t1", ...), `delay` seconds apart; records what it ran."""

    def __init__(self, delay: float = 0.0, fail_on: int | None = None):
        self.delay = delay
        self.fail_on = fail_on
        self.cached_ids: list[int] = []
        self.started: list[int] = []  # first prompt id of each request, in the order they started
        self.produced = 0

    def stream(self, prompt_ids, *, max_tokens, params, stop, ignore_eos):
        self.started.append(prompt_ids[0])
        if prompt_ids[0] == self.fail_on:
            raise RuntimeError("kernel exploded")
        self.cached_ids = list(prompt_ids)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        for i in range(max_tokens):
            time.sleep(self.delay)
            stats.generated_tokens += 1
            self.produced += 1
            yield Chunk(f"t{i}", i, None, stats)
        yield Chunk("", None, "length", stats)


def request(first_id: int, n: int = 3, prompt_len: int = 2) -> GenerationRequest:
    return GenerationRequest([first_id] + [7] * (prompt_len - 1), n)


async def collect(job) -> str:
    return "".join([c.text async for c in job])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def test_one_slot_serves_requests_first_in_first_out():
    engine = FakeEngine(delay=0.005)
    sched = Scheduler([engine])

    async def main():
        jobs = [sched.submit(request(i)) for i in range(5)]
        assert sched.queue_depth == 4 and sched.busy == 1
        return await asyncio.gather(*(collect(j) for j in jobs))

    try:
        texts = run(main())
    finally:
        sched.close()
    assert texts == ["t0t1t2"] * 5
    assert engine.started == [0, 1, 2, 3, 4]


def test_many_slots_run_side_by_side_and_all_finish():
    engines = [FakeEngine(delay=0.01) for _ in range(3)]
    sched = Scheduler(engines)

    async def main():
        jobs = [sched.submit(request(i, n=5)) for i in range(9)]
        await asyncio.sleep(0.02)
        assert sched.busy == 3  # every slot took a request before any finished
        return await asyncio.gather(*(collect(j) for j in jobs))

    try:
        texts = run(main())
    finally:
        sched.close()
    assert texts == ["t0t1t2t3t4"] * 9
    assert sorted(i for e in engines for i in e.started) == list(range(9))
    assert sched.queue_depth == 0 and sched.busy == 0


def test_cancelled_running_job_stops_and_frees_its_slot():
    engine = FakeEngine(delay=0.01)
    sched = Scheduler([engine])

    async def main():
        long = sched.submit(request(0, n=10_000))
        waiting = sched.submit(request(1, n=2))
        async for _ in long:
            break  # the client read one chunk and went away
        long.cancel()
        return await collect(waiting)

    try:
        start = time.monotonic()
        assert run(main()) == "t0t1"
        assert time.monotonic() - start < 5
    finally:
        sched.close()
    assert engine.produced < 100  # the long generation stopped at its next chunk
    assert sched.cancelled == 1


def test_cancelled_queued_job_never_runs():
    engine = FakeEngine(delay=0.01)
    sched = Scheduler([engine])

    async def main():
        first = sched.submit(request(0, n=5))
        queued = sched.submit(request(1, n=5))
        last = sched.submit(request(2, n=1))
        queued.cancel()
        assert sched.queue_depth == 1
        return await asyncio.gather(collect(first), collect(last))

    try:
        assert run(main()) == ["t0t1t2t3t4", "t0"]
    finally:
        sched.close()
    assert engine.started == [0, 2]


def test_cancel_after_the_end_is_not_counted():
    sched = Scheduler([FakeEngine()])

    async def main():
        job = sched.submit(request(0, n=2))
        text = await collect(job)
        job.cancel()
        return text

    try:
        assert run(main()) == "t0t1"
    finally:
        sched.close()
    assert sched.cancelled == 0


def test_engine_error_reaches_the_client_and_the_slot_carries_on():
    sched = Scheduler([FakeEngine(fail_on=13)])

    async def main():
        bad = sched.submit(request(13))
        with pytest.raises(RuntimeError, match="kernel exploded"):
            await collect(bad)
        return await collect(sched.submit(request(1, n=2)))

    try:
        assert run(main()) == "t0t1"
    finally:
        sched.close()


def test_free_slot_with_the_longest_shared_prefix_is_chosen():
    a, b = FakeEngine(), FakeEngine()
    a.cached_ids, b.cached_ids = [5, 1, 2], [5, 9, 9, 9]
    sched = Scheduler([a, b])

    async def main():
        await collect(sched.submit(GenerationRequest([5, 9, 9, 4], 1)))
        await collect(sched.submit(GenerationRequest([5, 1, 2, 3], 1)))

    try:
        run(main())
    finally:
        sched.close()
    assert b.started == [5] and a.started == [5]
    assert b.cached_ids == [5, 9, 9, 4] and a.cached_ids == [5, 1, 2, 3]


def test_full_queue_is_refused_and_close_fails_queued_jobs():
    release = threading.Event()

    class Blocking(FakeEngine):
        def stream(self, prompt_ids, **kwargs):
            release.wait(TIMEOUT_S)
            yield from super().stream(prompt_ids, **kwargs)

    sched = Scheduler([Blocking()], max_queue=2)

    async def main():
        running = sched.submit(request(0, n=1))
        await asyncio.sleep(0.05)  # the slot picks it up
        queued = [sched.submit(request(i, n=1)) for i in (1, 2)]
        with pytest.raises(QueueFull):
            sched.submit(request(3, n=1))
        sched.close()
        with pytest.raises(SchedulerClosed):
            await collect(queued[0])
        with pytest.raises(SchedulerClosed):
            sched.submit(request(4, n=1))
        release.set()
        return running

    run(main())


def test_without_a_queue_only_free_slots_take_requests():
    sched = Scheduler([FakeEngine(delay=0.01)], max_queue=0)

    async def main():
        job = sched.submit(request(0, n=20))
        with pytest.raises(QueueFull):
            sched.submit(request(1, n=1))
        return await collect(job)

    try:
        assert run(main()).startswith("t0t1")
    finally:
        sched.close()
