"""hotcold replicas on Ray Serve: one model per replica, each replica the same server as `hotcold serve`
(the FastAPI app of hotcold.server.app, as a `@serve.ingress` deployment), behind Ray's HTTP proxy,
which spreads requests over the replicas, restarts a replica whose process dies, and drains one it
stops (no new requests; the running ones get `graceful_shutdown_timeout_s` to finish).

    hotcold serve --ray --replicas 2 -m MODEL -t 4      # a local Ray cluster, or --ray-address ADDR
    serve run deploy/serve.yaml                         # the same from a Ray Serve config file

Each replica reserves the CPU cores its cold neurons run on (`num_cpus` = its threads) and one GPU
when the cluster has one. Ray is an optional extra (`pip install 'hotcold[ray]'`): this module imports
it only when a deployment is made, so it can be named in a config file checked without Ray."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

log = logging.getLogger(__name__)

RAY_MISSING = "--ray needs Ray Serve, an optional extra: pip install 'hotcold[ray]'"
DEPLOYMENT = "HotcoldReplica"  # the deployment's name (in `serve status`, config files, metrics)
APP_NAME = "hotcold"  # the Serve application `hotcold serve --ray` runs


@dataclass(frozen=True)
class ReplicaConfig:
    """What each replica loads and serves: `hotcold serve`'s model and server flags."""

    model: str | None = None  # None: the bundled demo model
    threads: int = 1  # CPU threads, and the CPU cores the replica reserves
    ctx_size: int | None = None
    device: str = "auto"
    dense: bool = False
    vram_budget: float | None = None
    sparsity: float | None = None  # `hotcold sparsify` files: share of FFN neurons skipped (None: the file's)
    parallel: int = 1
    api_key: str | None = None
    max_tokens: int | None = None
    max_queue: int = 64
    max_body_kib: int = 1024

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown replica settings {unknown}; known: {sorted(known)}")
        return cls(**d)


class HotcoldReplica:
    """One replica: loads the model in its constructor (Ray routes to a replica only once that returns,
    so no request meets a loading model) and serves the app over it."""

    def __init__(self, config: dict):
        import hotcold
        from hotcold.server.app import Limits, create_app

        self.config = ReplicaConfig.from_dict(config)
        c = self.config
        self.llm = hotcold.load(
            c.model,
            threads=c.threads,
            ctx_size=c.ctx_size,
            device=c.device,
            dense=c.dense,
            vram_budget=c.vram_budget,
            sparsity=c.sparsity,
            kv_sequences=c.parallel + 1,  # a KV cache per slot, plus the Model's own
        )
        limits = Limits(max_body_bytes=c.max_body_kib * 1024, max_tokens=c.max_tokens, max_queue=c.max_queue)
        # Ray's proxy gives every request an id (the client's X-Request-Id if sent), passes it in the request
        # headers, where the app picks it up for its log and response ids, and adds it to the response itself
        self._app = create_app(
            self.llm, parallel=c.parallel, api_key=c.api_key, limits=limits, request_id_header=False
        )

    def __serve_build_asgi_app__(self):
        return self._app

    def check_health(self) -> None:
        """Ray calls this every `health_check_period_s`; raising marks the replica unhealthy (restarted)."""
        if not self._app.state.server.scheduler.alive:
            raise RuntimeError("the batch thread has stopped")


def replica_options(
    config: ReplicaConfig,
    *,
    replicas: int = 1,
    max_replicas: int | None = None,
    num_gpus: float = 0,
    graceful_shutdown_timeout_s: float = 30.0,
) -> dict:
    """Ray Serve deployment options for `replicas` replicas, or autoscaling between `replicas` and
    `max_replicas` on ongoing requests (target: one per slot)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if max_replicas is not None and max_replicas < replicas:
        raise ValueError(f"--max-replicas ({max_replicas}) must be >= --replicas ({replicas})")
    options: dict = {
        "name": DEPLOYMENT,
        "ray_actor_options": {"num_cpus": config.threads, "num_gpus": num_gpus},
        # a replica takes what its slots and queue take; beyond that Ray's proxy queues, then answers 503
        "max_ongoing_requests": config.parallel + config.max_queue,
        "max_queued_requests": config.max_queue,
        "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
    }
    if max_replicas is None or max_replicas == replicas:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": config.parallel,
        }
    return options


def deployment(config: ReplicaConfig, **options):
    """The Ray Serve application (`serve.run(...)` it): HotcoldReplica as an ingress deployment."""
    from ray import serve

    ingress = serve.deployment(serve.ingress()(HotcoldReplica))
    return ingress.options(**replica_options(config, **options)).bind(asdict(config))


def build(args: dict):
    """The application builder a Ray Serve config file names (`import_path:
    hotcold.server.ray_serve:build`): `args` are ReplicaConfig's fields; replica counts, autoscaling and
    `ray_actor_options` come from the config file's `deployments` section, which overrides these."""
    args = dict(args or {})
    replicas = int(args.pop("replicas", 1))
    return deployment(ReplicaConfig.from_dict(args), replicas=replicas)


@contextmanager
def serving(
    make_app,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    num_cpus: int | None = None,
    stop_timeout_s: float = 90.0,
):
    """Run `make_app(cluster resources)` (an application, e.g. from `deployment`) on Ray Serve with its
    HTTP proxy at host:port and yield (that URL, the Ray cluster's address): on the cluster at `address`,
    or on a local one started here (no dashboard) and stopped on exit. On exit the app is deleted, which
    drains its replicas, for at most `stop_timeout_s` seconds.

    Only the HTTP proxy listens on `host`; Ray's own processes listen on every interface, as Ray always
    does (ray.init turns a 127.0.0.1 node address into the machine's), and since Ray 2.52 they want the
    cluster's token (~/.ray/auth_token)."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports sent from a cluster we start
    local = address is None
    if local:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(make_app(ray.cluster_resources()), name=APP_NAME, route_prefix="/")
        yield f"http://{host}:{port}", ray.get_runtime_context().gcs_address
    finally:
        # bounded: a Ray process that took the signal too (a terminal's Ctrl-C reaches the whole process
        # group) must not make the stop hang
        stop = threading.Thread(
            target=serve.shutdown if local else lambda: serve.delete(APP_NAME), daemon=True
        )
        stop.start()
        stop.join(timeout=stop_timeout_s)
        if stop.is_alive():
            log.warning("Ray Serve did not stop within %.0f s; stopping Ray", stop_timeout_s)
        ray.shutdown()
