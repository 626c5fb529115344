"""hotcold serve: the OpenAI-compatible HTTP API and a chat page at /, on 127.0.0.1 unless told otherwise.

The server listens at once and answers 503 until the model is loaded (`/health` too); SIGTERM drains it
(new requests 503, running ones finish, exit 0). `--ray --replicas N`: the same server as N Ray Serve
replicas behind Ray's proxy (hotcold.server.ray_serve)."""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import signal
import sys
import threading

from hotcold import memory
from hotcold.cli import add_model_args, load_from_args

# llama-server's -np default is -1, "auto": 4 slots (tools/server/server.cpp). Its 4 share one KV pool of
# the context size; here each slot has its own, which on the CPU costs memory only as it fills (an anonymous
# map, hotcold.runtime.state), and on a GPU is charged to the VRAM budget at load.
AUTO_PARALLEL = 4


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=None,
        help=f"requests generated at once, each with its own KV cache; more wait in a FIFO queue (default:"
        f" {AUTO_PARALLEL}, as llama-server's auto; fewer where their KV caches would not fit in memory)",
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
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish (new ones get 503) before the exit",
    )
    ray = p.add_argument_group("Ray Serve (pip install 'hotcold[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve as Ray Serve replicas, one model each")
    ray.add_argument("--replicas", type=int, default=1, help="replicas (with --max-replicas: the minimum)")
    ray.add_argument(
        "--max-replicas", type=int, default=None, help="autoscale between --replicas and this on load"
    )
    ray.add_argument(
        "--ray-address", default=None, help="an existing Ray cluster (default: start a local one)"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.parallel is not None and args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_kib < 1:
        raise ValueError(f"--max-body-kib must be >= 1, got {args.max_body_kib}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"hotcold: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    args.auto_parallel = args.parallel is None
    if args.auto_parallel:
        args.parallel = AUTO_PARALLEL  # the load charges a KV cache per slot (LoadOptions.from_args)
    if args.ray:
        return _run_ray(args)
    if args.replicas != 1 or args.max_replicas is not None or args.ray_address is not None:
        raise ValueError("--replicas, --max-replicas and --ray-address go with --ray")
    return _run_plain(args)


class _RequestLog(logging.StreamHandler):
    """One line per request on stderr (hotcold.server.access: request id, route, status, time), in place
    of uvicorn's access log, which has no request id. Writes to whatever sys.stderr is at the time."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("INFO:     %(message)s"))

    def emit(self, record) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _run_plain(args) -> int:
    import uvicorn

    from hotcold.server.app import Limits, create_app
    from hotcold.server.lifecycle import DrainingServer, Lifecycle

    limits = Limits(
        max_body_bytes=args.max_body_kib * 1024, max_tokens=args.max_tokens, max_queue=args.max_queue
    )

    def build():  # in a thread, once the server listens: /health says 503 "loading model" meanwhile
        llm = load_from_args(args)
        for note in llm.loaded.notes:
            print(f"hotcold: {note}", file=sys.stderr)
        slots, why = args.parallel, ""
        if getattr(args, "auto_parallel", False):
            per_slot, free = cpu_kv_bytes(llm), memory.available_memory()
            slots = fit_slots(AUTO_PARALLEL, per_slot, free)
            why = (
                f" (-np {AUTO_PARALLEL}, as llama-server)"
                if slots == AUTO_PARALLEL
                else f" (not {AUTO_PARALLEL}: a slot's KV cache at context {llm.ctx_size} takes up to"
                f" {per_slot / 2**30:.2f} GiB and {free / 2**30:.1f} GiB of memory are free; -np to choose)"
            )
        app = create_app(llm, parallel=slots, api_key=args.api_key or None, limits=limits)
        print(
            f"hotcold: {llm.path} loaded in {llm.load_seconds:.1f} s; context {llm.ctx_size} tokens,"
            f" {slots} slot{'' if slots == 1 else 's'}{why}{', API key required' if args.api_key else ''}",
            file=sys.stderr,
        )
        return app

    lifecycle = Lifecycle(build)
    # uvicorn prints the address it listens on (with the real port when --port 0)
    config = uvicorn.Config(
        lifecycle,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    access, handler = logging.getLogger("hotcold.server.access"), _RequestLog()
    level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    try:
        DrainingServer(config, lifecycle, drain_timeout=args.drain_timeout).run()
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
        access.propagate = True
    if lifecycle.error is not None:
        raise lifecycle.error
    return 0


def fit_slots(wanted: int, per_slot_bytes: int, available_bytes: int) -> int:
    """Slots, at most `wanted` and at least 1, whose KV caches (`per_slot_bytes` each when full) fit in
    `available_bytes` of memory."""
    if per_slot_bytes <= 0:
        return wanted
    return max(1, min(wanted, available_bytes // per_slot_bytes))


def cpu_kv_bytes(llm) -> int:
    """Bytes of one sequence's KV cache, full, in the layers that keep it in CPU memory (a GPU layer's is
    already within the VRAM budget the load spent)."""
    import torch

    from hotcold.device import kv_dtype
    from hotcold.placement.budget import kv_bytes_per_layer

    plan = getattr(llm.loaded.model, "plan", None)
    devices = plan.attention if plan is not None else [torch.device("cpu")] * llm.config.n_layer
    return sum(
        kv_bytes_per_layer(llm.config, llm.ctx_size, kv_dtype(d).itemsize) for d in devices if d.type == "cpu"
    )


def _run_ray(args) -> int:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        from hotcold.server.ray_serve import RAY_MISSING

        print(f"hotcold: error: {RAY_MISSING}", file=sys.stderr)
        return 1
    from hotcold.server.ray_serve import ReplicaConfig, deployment, replica_options, serving

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    local = args.ray_address is None
    threads = args.threads
    if threads is None:  # share this machine's cores between the replicas of a local cluster
        threads = max(1, (os.cpu_count() or 1) // args.replicas) if local else (os.cpu_count() or 1)
    config = ReplicaConfig(
        model=args.model,
        threads=threads,
        ctx_size=args.ctx_size,
        device=args.device,
        dense=args.dense,
        vram_budget=args.vram_budget,
        sparsity=args.sparsity,
        parallel=args.parallel,
        api_key=args.api_key or None,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        max_body_kib=args.max_body_kib,
    )
    replica_options(config, replicas=args.replicas, max_replicas=args.max_replicas)  # bad counts: say so now

    def make_app(resources: dict):  # once Ray is up: a GPU per replica where the cluster has them
        gpus = 0 if args.device == "cpu" or resources.get("GPU", 0) < 1 else 1
        info["gpus"] = gpus
        return deployment(
            config,
            replicas=args.replicas,
            max_replicas=args.max_replicas,
            num_gpus=gpus,
            graceful_shutdown_timeout_s=args.drain_timeout,
        )

    info: dict = {}
    port = args.port or _free_port(args.host)
    stop_s = args.drain_timeout + 60
    with serving(make_app, host=args.host, port=port, address=args.ray_address, stop_timeout_s=stop_s) as (
        url,
        address,
    ):
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        count = f"{args.replicas}-{args.max_replicas}" if args.max_replicas else str(args.replicas)
        print(
            f"hotcold: {count} Ray Serve replica(s), {threads} thread(s) and {info['gpus']} GPU each;"
            f" running on {url} (Ray cluster at {address}; SIGINT or SIGTERM: drain and stop)",
            file=sys.stderr,
        )
        while not stop.wait(1.0):
            pass
        print("hotcold: draining the replicas", file=sys.stderr)
    return 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
