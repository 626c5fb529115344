"""Request scheduling: N slots, each an `Engine` (its own KV cache over the shared weights) driven by its
own worker thread, and one FIFO queue in front of them.

The head of the queue always gets the next free slot, so no request waits behind one that arrived
later; among free slots it takes the one whose cached tokens share the longest prefix with its prompt
(a chat's next turn lands where its history already is). Generation runs in the worker threads (torch
and the C kernels release the GIL); chunks reach the event loop through `call_soon_threadsafe`. A
cancelled job (its client went away) leaves the queue at once, or stops at its next chunk and frees
its slot.

Requests run side by side, one forward per request: decoding several sequences in one batched forward
would need a batched KV cache in the engine."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from hotcold.engine import Chunk, Engine
from hotcold.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


class QueueFull(RuntimeError):
    pass


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


class _Slot:
    def __init__(self, index: int, engine: Engine, scheduler: Scheduler):
        self.index = index
        self.engine = engine
        self.scheduler = scheduler
        self.job: Job | None = None
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=f"hotcold-slot-{index}", daemon=True)

    def assign(self, job: Job | None) -> None:
        self._inbox.put(job)

    def _work(self) -> None:
        while (job := self._inbox.get()) is not None:
            try:
                self._run(job)
            finally:
                self.scheduler._release(self)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        r = job.request
        on_tokens = self.scheduler.on_tokens
        steps = self.engine.stream(
            r.prompt_ids, max_tokens=r.max_tokens, params=r.params, stop=r.stop, ignore_eos=r.ignore_eos
        )
        counted = 0
        try:
            for chunk in steps:
                job.generated = chunk.stats.generated_tokens
                if on_tokens is not None and job.generated > counted:
                    on_tokens(job.generated - counted)
                    counted = job.generated
                if job.cancelled.is_set():
                    log.info("slot %d: request cancelled after %d tokens", self.index, job.generated)
                    return
                job._put(chunk)
        except Exception as exc:  # the client gets a 500; the slot carries on
            log.exception("slot %d: generation failed", self.index)
            job._put(exc)
        finally:
            steps.close()


class Scheduler:
    """`submit()` from the event loop; `parallel` = number of engines = requests generating at once."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_queue: int = 64,
        on_tokens: Callable[[int], None] | None = None,
    ):
        if not engines:
            raise ValueError("the scheduler needs at least one engine (--parallel >= 1)")
        self.max_queue = max_queue
        self.on_tokens = on_tokens  # called from workers with each count of newly generated tokens
        self._lock = threading.Lock()
        self._pending: deque[Job] = deque()
        self._slots = [_Slot(i, e, self) for i, e in enumerate(engines)]
        self._idle = list(self._slots)
        self._closed = False
        self.cancelled = 0  # jobs cancelled by their clients, queued or running
        for slot in self._slots:
            slot.thread.start()

    @property
    def parallel(self) -> int:
        return len(self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return len(self._slots) - len(self._idle)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        job = Job(request, loop or asyncio.get_running_loop(), self)
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if not self._idle and len(self._pending) >= self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._pending)} requests are already queued")
            self._pending.append(job)
            self._dispatch()
        return job

    def close(self) -> None:
        """Stop the workers after their current jobs; fail the queued ones."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            for slot in self._slots:
                if slot.job is not None:
                    slot.job.cancelled.set()
                slot.assign(None)
        for job in pending:
            job._put(SchedulerClosed("the server is shutting down"))

    def _dispatch(self) -> None:
        # caller holds the lock
        while self._pending and self._idle:
            job = self._pending.popleft()
            ids = job.request.prompt_ids
            slot = max(self._idle, key=lambda s: _common_prefix(s.engine.cached_ids, ids))
            self._idle.remove(slot)
            slot.job = job
            slot.assign(job)

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.job = None
            if self._closed:
                return
            self._idle.append(slot)
            self._dispatch()

    def _forget(self, job: Job) -> None:
        with self._lock:
            self.cancelled += 1
            try:
                self._pending.remove(job)
            except ValueError:
                pass  # already running (it stops at its next chunk) or done


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
