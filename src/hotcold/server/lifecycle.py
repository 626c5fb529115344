"""The contract routers and orchestrators rely on, around the server's app: listen while the model loads
and answer 503 until it is ready (as llama.cpp: `/health` gives 503 `{"status": "loading model"}`, then
200 `{"status": "ok"}`); on SIGTERM drain: every new request gets 503 (`/health` too, so a load
balancer or a Kubernetes readiness probe takes the server out), the running ones, streams included,
finish, then the process exits 0. `Lifecycle` is the ASGI app in front; `DrainingServer` is uvicorn's
server with SIGTERM meaning "drain" (SIGINT, or a second signal, still stops at once).

Under Ray Serve neither is used: Ray routes to a replica only once its constructor (the load) returns
and drains a replica it stops by itself (`graceful_shutdown_timeout_s`; see hotcold.server.ray_serve)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi.responses import JSONResponse

from hotcold.server.guard import access_log, request_id
from hotcold.server.protocol import error_body

log = logging.getLogger(__name__)

LOADING, READY, DRAINING = "loading model", "ok", "draining"
RETRY_AFTER_S = "5"  # what a 503 while loading tells a client to wait before trying again


class Lifecycle:
    """ASGI app: loading -> ready -> draining. `build()` (run in a thread at startup, so the server is
    already listening) loads the model and returns the server's app; its lifespan is run from here."""

    def __init__(self, build: Callable[[], object]):
        self._build = build
        self.app = None
        self.error: BaseException | None = None  # the load failed: the server stops and reports it
        self.state = LOADING
        self.in_flight = 0  # requests inside the app, counted until their last byte is sent
        self.loaded_at: float | None = None
        self._lifespan = None
        self._loop = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def drain(self) -> None:
        """Stop admitting requests (signal-handler safe: one assignment)."""
        self.state = DRAINING

    def drained(self) -> bool:
        return self.state == DRAINING and self.in_flight == 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(receive, send)
        if scope["type"] != "http":  # no websockets here
            return None
        if self.state != READY:
            if (
                scope["path"] == "/metrics" and self.app is not None
            ):  # the gauges stay readable while draining
                return await self.forward(scope, receive, send)
            return await self._refuse(scope, receive, send)
        return await self.forward(scope, receive, send)

    async def forward(self, scope, receive, send) -> None:
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, scope, receive, send) -> None:
        rid = request_id(scope)
        headers = {"X-Request-Id": rid, "Retry-After": RETRY_AFTER_S}
        if scope["path"] == "/health":
            response = JSONResponse({"status": self.state}, status_code=503, headers=headers)
        elif self.state == LOADING:
            body = error_body("Loading model", type="unavailable_error", code="loading_model")
            response = JSONResponse(body, status_code=503, headers=headers)
        else:
            body = error_body("the server is shutting down", type="unavailable_error", code="shutting_down")
            response = JSONResponse(body, status_code=503, headers={"X-Request-Id": rid})
        access_log.info('%s "%s %s" 503 (%s)', rid, scope["method"], scope["path"], self.state)
        await response(scope, receive, send)

    # --- startup: load in a thread, then start the app's own lifespan in the loop -------------------

    async def _run_lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                threading.Thread(target=self._load, name="hotcold-load", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)  # closes the scheduler
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _load(self) -> None:
        try:
            app = self._build()
        except BaseException as exc:  # reported by the CLI once the server has stopped
            self.error = exc
            return
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._ready(app)))

    async def _ready(self, app) -> None:
        try:
            self._lifespan = app.router.lifespan_context(app)
            await self._lifespan.__aenter__()
        except Exception as exc:
            self.error = exc
            return
        self.app, self.loaded_at = app, time.monotonic()
        if self.state == LOADING:  # not if a SIGTERM came first
            self.state = READY


class DrainingServer(uvicorn.Server):
    """uvicorn's server where SIGTERM drains (see the module doc) for at most `drain_timeout` seconds,
    and then exits normally (exit status 0: the signal is not re-raised); it also stops when the load
    fails."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, *, drain_timeout: float = 30.0):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and self._drain_deadline is None and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.drain_timeout
            self.lifecycle.drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.lifecycle.failed:
            return True
        if self._drain_deadline is None:
            return False
        if self.lifecycle.drained():
            log.info("drained: no request left running")
            return True
        if time.monotonic() > self._drain_deadline:
            n = self.lifecycle.in_flight
            log.warning("drain timeout: %d %s still running cut", n, "request" if n == 1 else "requests")
            return True
        return False
