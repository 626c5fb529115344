"""hotcold serve: the OpenAI-compatible HTTP API and a chat page at /, on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import ipaddress
import os
import sys

from hotcold.cli import add_model_args, load_from_args


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        help="requests generated at once, each with its own KV cache; more wait in a FIFO queue",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("HOTCOLD_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and the chat page"
        " (default: $HOTCOLD_API_KEY)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="tokens generated per request at most (default: -c)"
    )
    p.add_argument("--max-queue", type=int, default=64, help="queued requests at most; beyond that 503")
    p.add_argument(
        "--max-body-kib", type=int, default=1024, help="largest request body in KiB; beyond that 413"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    import uvicorn

    from hotcold.server.app import Limits, create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_kib < 1:
        raise ValueError(f"--max-body-kib must be >= 1, got {args.max_body_kib}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"hotcold: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    llm = load_from_args(args)
    for note in llm.loaded.notes:
        print(f"hotcold: {note}", file=sys.stderr)
    limits = Limits(
        max_body_bytes=args.max_body_kib * 1024, max_tokens=args.max_tokens, max_queue=args.max_queue
    )
    app = create_app(llm, parallel=args.parallel, api_key=args.api_key or None, limits=limits)
    print(
        f"hotcold: {llm.path} loaded in {llm.load_seconds:.1f} s; context {llm.ctx_size} tokens,"
        f" {args.parallel} slot(s){', API key required' if args.api_key else ''}",
        file=sys.stderr,
    )
    # uvicorn prints the address it listens on (with the real port when --port 0)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
