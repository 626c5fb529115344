"""Streaming and disconnects: server-sent events from a request's jobs, merged in arrival order, that stop
(and free the slots) the moment the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from hotcold.runtime.engine import Chunk, GenerationStats
from hotcold.server.protocol import Format, error_body
from hotcold.server.scheduler import RequestFailed

log = logging.getLogger(__name__)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(jobs, fmt: Format) -> AsyncIterator[str]:
    try:
        for obj in fmt.start(len(jobs)):
            yield sse(obj)
        stats = [GenerationStats() for _ in jobs]
        async with contextlib.aclosing(merged(jobs)) as chunks:
            async for i, chunk in chunks:
                if chunk.text or chunk.logprobs:
                    obj = fmt.chunk(i, chunk.text, chunk.logprobs)
                    if obj is not None:  # a format may hold text back (tool calls: until the end)
                        yield sse(obj)
                if chunk.finish_reason is not None:
                    stats[i] = chunk.stats
                    for obj in fmt.end(i, chunk.finish_reason, chunk.stats):
                        yield sse(obj)
        for obj in fmt.tail(stats):
            yield sse(obj)
    except (
        RequestFailed
    ) as exc:  # this request alone failed: its status as llama-server reports one mid-stream
        log.warning("%s: stream failed: %s", fmt.id, exc)
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        yield sse(error_body(str(exc), type=kind, param=exc.param, code=exc.status))
    except Exception as exc:  # headers are sent: report in the stream (the OpenAI client raises on it)
        log.warning("%s: stream failed: %s", fmt.id, exc)  # the id ends with the request id
        yield sse(error_body(f"generation failed: {exc}", type="server_error"))
    finally:
        for job in jobs:
            job.cancel()  # a no-op when finished; else the client went away and the slot is freed
    if fmt.done:
        yield sse(fmt.done)


async def merged(jobs) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) from every job as they come; a job's error is raised."""
    if len(jobs) == 1:
        async for chunk in jobs[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job) -> None:
        try:
            async for chunk in job:
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that stop the moment the client disconnects (whatever ASGI spec version the
    server speaks): a disconnect cancels the body iterator, whose `finally` cancels the job."""

    media_type = "text/event-stream"

    def __init__(self, content):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def cancel_on_disconnect(request: Request, jobs) -> None:
    # the body has been read, so the next message is the disconnect (or nothing until we answer)
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()
