"""The example deployment files under deploy/ parse and point at real things: the Ray Serve import path
and deployment name exist, the replica settings are ReplicaConfig's, each replica reserves the cores
its threads use, the KubeRay manifest runs the same application on a Ray that has what we use, and LiteLLM
balances entries that name the model the server lists."""

from __future__ import annotations

import importlib
from dataclasses import fields
from pathlib import Path

import pytest

from hotcold.loader import demo_model_path
from hotcold.server import ray_serve

yaml = pytest.importorskip("yaml", reason="pyyaml comes with the test extra (and with Ray)")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def check_application(app: dict) -> None:
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), app["import_path"]
    assert set(app["args"]) <= {f.name for f in fields(ray_serve.ReplicaConfig)} | {"replicas"}
    (dep,) = app["deployments"]
    assert dep["name"] == ray_serve.DEPLOYMENT
    assert dep["ray_actor_options"]["num_cpus"] == app["args"]["threads"]
    assert dep["max_ongoing_requests"] == app["args"]["parallel"] + app["args"].get("max_queue", 64)


def ray_schema():
    pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install 'hotcold[ray]'")
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema


def test_serve_config_names_the_deployment_and_ray_accepts_it():
    config = load("serve.yaml")
    (app,) = config["applications"]
    check_application(app)
    assert app["args"]["model"] is None or Path(app["args"]["model"]).suffix == ".gguf"
    ray_schema().model_validate(config)  # Ray's own schema for `serve run` / `serve deploy` files
    built = ray_serve.build(app["args"])  # and the builder makes the application from its args
    assert type(built).__name__ == "Application"


def test_kuberay_rayservice_runs_the_same_application():
    manifest = load("kuberay-rayservice.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    check_application(app)
    assert app["import_path"] == load("serve.yaml")["applications"][0]["import_path"]
    cluster = manifest["spec"]["rayClusterConfig"]
    # a Ray with serve.ingress's late-bound app (the extra's floor), the one the images are built on
    assert tuple(int(p) for p in cluster["rayVersion"].split(".")[:2]) >= (2, 60)
    workers = cluster["workerGroupSpecs"]
    groups = [cluster["headGroupSpec"], *workers]
    assert all(cluster["rayVersion"] in g["template"]["spec"]["containers"][0]["image"] for g in groups)
    cpus = [int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) for g in workers]
    assert max(cpus) >= app["deployments"][0]["ray_actor_options"]["num_cpus"]  # a replica fits a pod
    ray_schema().model_validate(serve_config)


def test_litellm_balances_entries_naming_the_served_model():
    config = load("litellm.yaml")
    entries = config["model_list"]
    assert len(entries) >= 2 and len({e["model_name"] for e in entries}) == 1  # one name: balanced
    for e in entries:
        params = e["litellm_params"]
        provider, _, model = params["model"].partition("/")
        assert provider == "openai"  # LiteLLM's OpenAI-compatible provider
        assert model == demo_model_path().name  # what hotcold serve's /v1/models lists for the demo model
        assert params["api_base"].startswith("http://") and params["api_base"].endswith("/v1")
    assert config["router_settings"]["routing_strategy"] in {
        "simple-shuffle",
        "least-busy",
        "usage-based-routing",
        "latency-based-routing",
    }


def test_replica_options_reserve_the_threads_and_scale_between_the_counts():
    config = ray_serve.ReplicaConfig(threads=3, parallel=4, max_queue=8)
    fixed = ray_serve.replica_options(config, replicas=2, num_gpus=1)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 3, "num_gpus": 1}
    assert fixed["max_ongoing_requests"] == 12 and fixed["max_queued_requests"] == 8
    scaled = ray_serve.replica_options(config, replicas=1, max_replicas=4)
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 4,
    }
    with pytest.raises(ValueError, match="--max-replicas"):
        ray_serve.replica_options(config, replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ray_serve.replica_options(config, replicas=0)
    with pytest.raises(ValueError, match="unknown replica settings"):
        ray_serve.ReplicaConfig.from_dict({"modle": "x.gguf"})


def test_replica_loads_with_the_serve_flags(monkeypatch):
    """A replica loads its model with every model flag `hotcold serve` takes (--sparsity included)."""
    import hotcold

    seen = {}

    class Loaded(Exception):
        pass

    def fake_load(path, **kwargs):
        seen.update(kwargs, path=path)
        raise Loaded

    monkeypatch.setattr(hotcold, "load", fake_load)
    with pytest.raises(Loaded):
        ray_serve.HotcoldReplica({"model": "m.gguf", "threads": 2, "sparsity": 0.4, "dense": False})
    assert seen == {
        "path": "m.gguf",
        "threads": 2,
        "ctx_size": None,
        "device": "auto",
        "dense": False,
        "vram_budget": None,
        "sparsity": 0.4,
        "kv_sequences": 2,  # the default one slot's KV cache plus the Model's own
    }
