"""In front of every route: OpenAI-shaped errors, the API key, the request body limits (size, and time to
arrive: uvicorn's timeouts end idle connections, not a body that trickles in), the JSON-only rule,
request counts for /metrics, a request id (`X-Request-Id`, the client's own when it sends a usable one)
in the response and in the log, and a JSON 500 for anything unexpected (the server carries on)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotcold.server.metrics import Metrics
from hotcold.server.protocol import ApiError, error_body

log = logging.getLogger(__name__)
access_log = logging.getLogger("hotcold.server.access")  # one line per request: id, route, status, time

REQUEST_ID_KEY = "hotcold.request_id"  # where a request's id lives in its ASGI scope
_USABLE_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces, bounded: safe in a log line

ROUTES = frozenset(
    (
        "/",
        "/health",
        "/metrics",
        "/v1/models",
        "/props",
        "/v1/completions",
        "/v1/chat/completions",
        "/completion",
        "/tokenize",
        "/detokenize",
    )
)
# No key needed: the health probe, and the chat page itself (static, no model data; it asks for the key
# and sends it with every request, as llama.cpp's web UI does).
OPEN_ROUTES = frozenset(("/health", "/"))


def _json_error(status: int, message: str, *, headers: dict | None = None, **kwargs) -> JSONResponse:
    return JSONResponse(error_body(message, **kwargs), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail})", None
    # a union field fails once per member: name the field they share, list the distinct complaints; with
    # several fields wrong, the first (as OpenAI names one)
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    errors = [e for e, loc in zip(errors, locs) if loc[:1] == locs[0][:1]]
    locs = [loc for loc in locs if loc[:1] == locs[0][:1]]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    param = ".".join(common) or None
    msgs = list(dict.fromkeys(e.get("msg", "invalid") for e in errors))[:3]
    return f"{param or 'the request body'}: {'; '.join(msgs)}", param


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _json_error(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _json_error(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_error(exc.status_code, str(exc.detail), type=kind)


def request_id(scope) -> str:
    """This request's id: the incoming `X-Request-Id` when it is usable (printable, at most 128
    characters), else a new one; the same for every later call on this scope."""
    if REQUEST_ID_KEY not in scope:
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        scope[REQUEST_ID_KEY] = given.decode() if _USABLE_ID.fullmatch(given) else uuid.uuid4().hex
    return scope[REQUEST_ID_KEY]


class Guard:
    """Pure ASGI middleware in front of every route: the request id, the API key, the body limits (the body
    is read here, bounded in size and in time: 413 or 408, then replayed), request counts for /metrics, and
    a JSON 500 for anything unexpected. `id_header=False` leaves the `X-Request-Id` response header to a proxy in front
    that adds it itself (Ray Serve's, which also hands us its id in the request headers)."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        id_header: bool = True,
        body_timeout_s: float = 30.0,
    ):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics
        self.id_header = id_header

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        status = 500
        started = False
        rid = request_id(scope)
        t0 = time.perf_counter()

        async def send_counted(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if self.id_header:
                    message = {
                        **message,
                        "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())],
                    }
            await send(message)

        try:
            if self.api_key is not None and path not in OPEN_ROUTES and not self._authorized(scope):
                return await _json_error(
                    401,
                    "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )(scope, receive, send_counted)
            if scope["method"] == "POST" and not _is_json(scope):
                # also keeps other web pages out: a cross-site form or no-cors fetch cannot send JSON
                return await _json_error(
                    415, "send the request body as JSON, with 'Content-Type: application/json'"
                )(scope, receive, send_counted)
            try:
                body = await asyncio.wait_for(self._read_body(scope, receive), self.body_timeout_s)
            except asyncio.TimeoutError:  # the same as TimeoutError from Python 3.11 on
                # the rest of the body may still come: the connection closes after the answer
                return await _json_error(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    code="body_timeout",
                    headers={"connection": "close"},
                )(scope, receive, send_counted)
            if body is None:
                return await _json_error(
                    413, f"the request body is larger than {self.max_body_bytes} bytes", code="body_too_large"
                )(scope, receive, send_counted)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send_counted)
        except _ClientGone:
            status = 499  # nginx's "client closed request": nothing to answer
        except Exception:
            log.exception("%s: internal error on %s %s", rid, scope.get("method"), path)
            if not started:
                await _json_error(500, "internal server error", type="server_error")(
                    scope, receive, send_counted
                )
        finally:
            self.metrics.request_done(route, status)
            access_log.info(
                '%s "%s %s" %d %.3f s', rid, scope["method"], path, status, time.perf_counter() - t0
            )

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None when it is over the limit (declared or actual)."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _is_json(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return False


class _ClientGone(Exception):
    pass
