"""Request scheduling with continuous batching: N slots (each an `Engine`: its own KV cache over the
shared weights), one FIFO queue in front of them, and one batch thread that runs every running request
in one forward per step (hotcold.runtime.batching), admitting queued requests into free slots at every step and
dropping finished or cancelled ones at once.

The head of the queue always gets the next free slot, so no request waits behind one that arrived
later; among free slots it takes the one whose cached tokens share the longest prefix with its prompt
(a chat's next turn lands where its history already is, and skips that part of the prefill); where
another slot (running or free) holds a longer start of the prompt (a shared system prompt or template), the
slot copies those keys and values from it before the prompt's first forward (`batching.share_starts`: only rows
whose bits do not depend on their forward; requests arriving together prefill one after another when they do
not fit in one forward, so the later ones find the earlier ones' rows). Chunks
reach the event loop through `call_soon_threadsafe`. A cancelled job (its client went away) leaves the
queue at once, or leaves the batch at the next step and frees its slot. A request's tokens do not
depend on what else is in the batch (see hotcold.runtime.batching). The `n` choices of one prompt run it once:
the others start from a copy of the first one's cache and its prompt logits (Engine.copy_prefix).

One request's failure is its own: when its sampling, its constraint or anything else of its own fails in
a step, that request ends with the error (`RequestFailed`, status 400 when its input caused it: its
grammar or schema) and the other requests of the batch go on as if it had never been there. Only a
failure of the batched forward itself reaches every request in it.

`max_queue` counts requests: a request's `n` choices take one place, so a request with n > 1 gets a place
as often as one with n = 1 (counting choices, n = 3 needed three places free at once and a stream of n = 1
requests kept taking them one by one)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from hotcold.runtime import batching
from hotcold.runtime.engine import Chunk, Engine
from hotcold.runtime.generation import Generation, common_prefix
from hotcold.runtime.sampling import SamplingParams
from hotcold.structured import Constraint, ConstraintError

log = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token (Generation's logprobs); None: no logprobs
    constraint: Constraint | None = None  # structured output (hotcold.structured)
    request_id: str = ""  # the HTTP request's id (X-Request-Id), for the log


class QueueFull(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """One request failed on its own (the batch went on): `status` 400 when its input caused it (`param`:
    the request field), 500 otherwise."""

    def __init__(self, message: str, *, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param

    @classmethod
    def of(cls, exc: Exception) -> RequestFailed:
        if isinstance(exc, ConstraintError):
            return cls(str(exc), status=400, param=exc.field)
        if isinstance(exc, ValueError):  # the engine refused what the request asked (Generation's checks)
            return cls(str(exc), status=400)
        return cls(f"generation failed: {exc}")


class SchedulerClosed(RuntimeError):
    pass


class Job:
    """One request's generation, as seen by the event loop: `async for chunk in job` yields the engine's
    chunks; the last one has a finish_reason. `cancel()` from the loop stops it wherever it is."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, scheduler: Scheduler):
        self.request = request
        self.cancelled = threading.Event()
        self.generated = 0  # tokens generated so far (written by the worker)
        self._loop = loop
        self._scheduler = scheduler
        self._queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self._finished = False
        self.group: int = id(self)  # the request this job is a choice of (one queue place per request)
        self.leader: Job | None = None  # another choice of the same prompt, whose prefill this one reuses
        self.slot: _Running | None = None  # where it runs, once admitted (written under the scheduler lock)

    def cancel(self) -> None:
        """Stop this job (a no-op once its last chunk has been read)."""
        if not self._finished and not self.cancelled.is_set():
            self.cancelled.set()
            self._scheduler._forget(self)

    def _put(self, item: Chunk | BaseException) -> None:
        """From a worker thread: hand an item to the event loop (a closed loop cancels the job)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while not self._finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._finished = True
                raise item
            if item.finish_reason is not None:
                self._finished = True
            yield item


class _Isolated(Generation):
    """A Generation whose own failure in a step (sampling, constraint, stop strings) ends it with the error
    (`error`) instead of raising out of the batch: the other generations of the step still take their
    logits."""

    error: Exception | None = None

    def take(self, logits) -> None:
        try:
            super().take(logits)
        except Exception as exc:
            log.warning("a request failed in its own step: %s", exc)
            self.error, self.done, self.finish_reason = exc, True, "error"


@dataclass
class _Running:
    job: Job
    engine: Engine
    generation: Generation
    counted: int = 0  # tokens already reported to on_tokens


class Scheduler:
    """`submit()` from the event loop; `parallel` = number of engines = the batch capacity (-np)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_queue: int = 64,
        on_tokens: Callable[[int], None] | None = None,
    ):
        if not engines:
            raise ValueError("the scheduler needs at least one engine (--parallel >= 1)")
        models = {id(e.model) for e in engines}
        if len(models) != 1:
            raise ValueError("the scheduler's engines must share one model (one batched forward)")
        self.model = engines[0].model
        self.max_queue = max_queue
        self.on_tokens = on_tokens  # called from the batch thread with each count of new tokens
        self._engines = list(engines)
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: list[_Running] = []
        self._free = list(self._engines)
        self._closed = False
        self.cancelled = 0  # jobs cancelled by their clients, queued or running
        self.steps = 0  # batched forwards run
        self._thread = threading.Thread(target=self._loop, name="hotcold-batch", daemon=True)
        self._thread.start()

    @property
    def parallel(self) -> int:
        return len(self._engines)

    @property
    def alive(self) -> bool:
        """The batch thread runs and takes requests (a replica's health check)."""
        return self._thread.is_alive() and not self._closed

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return len(self._running)

    def kv_usage(self) -> float:
        """Share of all slots' KV cache positions held by running requests (vllm:gpu_cache_usage_perc's
        meaning: as in vLLM, cached tokens that no running request holds count as free, since any new
        request may take that slot; an idle server reports 0)."""
        with self._cond:
            used = sum(len(r.engine.cached_ids) for r in self._running)
        return used / sum(e.ctx_size for e in self._engines)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        return self.submit_all([request], loop)[0]

    def submit_all(
        self, requests: Sequence[GenerationRequest], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[Job]:
        """Queue the requests together (one request's `n` choices): all of them or, when the queue has
        no room for all, none (QueueFull). They are admitted in order, into one batch when the slots are
        free (each takes the free slot sharing the longest prefix with its prompt)."""
        loop = loop or asyncio.get_running_loop()
        jobs = [Job(r, loop, self) for r in requests]
        for job in jobs[1:]:  # the n choices of one prompt: the prompt runs once, for the first
            job.group = jobs[0].group
            if job.request.prompt_ids == jobs[0].request.prompt_ids:
                job.leader = jobs[0]
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            starts_now = not self._pending and len(jobs) <= len(self._free)
            queued = len({j.group for j in self._pending})  # requests, whatever their n
            if not starts_now and queued + 1 > self.max_queue:
                raise QueueFull(f"the server is busy: {queued} requests are already queued")
            self._pending.extend(jobs)
            self._admit()
            self._cond.notify()
        return jobs

    def close(self) -> None:
        """Stop the batch after this step (running jobs are cancelled); fail the queued ones."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            for r in self._running:
                r.job.cancelled.set()
            self._cond.notify()
        for job in pending:
            job._put(SchedulerClosed("the server is shutting down"))

    # --- the batch thread ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued jobs into free slots, head of the queue first (caller holds the lock). A choice whose
        leader is still running its prompt waits for it (a step or a few), then starts from a copy of the
        leader's cache and its prompt logits; the jobs behind it are not held up meanwhile."""
        waiting: deque[Job] = deque()
        while self._pending and self._free:
            job = self._pending.popleft()
            if job.cancelled.is_set():
                continue
            leader = self._shareable(job.leader)
            if leader == "wait":
                waiting.append(job)
                continue
            r = job.request
            engine = max(self._free, key=lambda e: common_prefix(e.cached_ids, r.prompt_ids))
            prefilled = None
            if leader is not None:
                if engine is not leader.engine:
                    engine.copy_prefix(leader.engine, len(r.prompt_ids))
                prefilled = leader.generation.prompt_logits
            try:
                gen = _Isolated(
                    engine,
                    r.prompt_ids,
                    max_tokens=r.max_tokens,
                    params=r.params,
                    stop=r.stop,
                    ignore_eos=r.ignore_eos,
                    logprobs=r.logprobs,
                    constraint=r.constraint,
                    prefilled=prefilled,
                )
            except Exception as exc:  # a prompt the engine refuses: this request fails, the others go on
                job._put(RequestFailed.of(exc))
                continue
            self._free.remove(engine)
            job.slot = _Running(job, engine, gen)
            self._running.append(job.slot)
        self._pending.extendleft(reversed(waiting))

    def _shareable(self, leader: Job | None):
        """The leader's slot when its cache holds the prompt with its last logits, "wait" while it is
        still to run it, None when there is nothing to share (no leader, or it failed or was cancelled)."""
        if leader is None:
            return None
        slot = leader.slot
        if slot is None:
            return None if leader.cancelled.is_set() or leader._finished else "wait"
        gen = slot.generation
        if gen.prompt_logits is None:
            return "wait" if slot in self._running and not leader.cancelled.is_set() else None
        n = len(gen.prompt)
        return slot if slot.engine.cached_ids[:n] == gen.prompt else None

    def _release(self, r: _Running) -> None:
        # caller holds the lock
        self._running.remove(r)
        self._free.append(r.engine)

    def _loop(self) -> None:
        while True:
            with self._cond:
                for r in [r for r in self._running if r.job.cancelled.is_set()]:
                    log.info("%s: cancelled after %d tokens", r.job.request.request_id, r.job.generated)
                    self._release(r)
                if not self._closed:
                    self._admit()
                while not self._running and not self._closed and not self._pending:
                    self._cond.wait()
                    self._admit()
                if self._closed and not self._running:
                    return
                batch = list(self._running)
                # under the lock: the free slots are sources too, and a running slot's rows are final
                batching.share_starts([r.generation for r in batch], others=self._free)
            if not batch:
                continue
            try:
                batching.step(self.model, [r.generation for r in batch])
                self.steps += 1
            except Exception as exc:  # the clients of this step get a 500; the server carries on
                log.exception("batched step failed")
                with self._cond:
                    for r in batch:
                        r.job._put(exc)
                        self._release(r)
                continue
            with self._cond:
                for r in batch:
                    self._deliver(r)

    def _deliver(self, r: _Running) -> None:
        gen, job = r.generation, r.job
        job.generated = gen.stats.generated_tokens
        if self.on_tokens is not None and job.generated > r.counted:
            self.on_tokens(job.generated - r.counted)
            r.counted = job.generated
        if not job.cancelled.is_set():
            for chunk in gen.drain():
                job._put(chunk)
            if gen.error is not None:
                job._put(RequestFailed.of(gen.error))
        if gen.done or job.cancelled.is_set():
            self._release(r)

    def _forget(self, job: Job) -> None:
        with self._cond:
            self.cancelled += 1
            try:
                self._pending.remove(job)
            except ValueError:
                pass  # already running (it leaves the batch at the next step) or done
