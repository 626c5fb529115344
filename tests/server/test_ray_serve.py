"""hotcold on Ray Serve (issue #17): a local Ray cluster on 127.0.0.1 started here, 2 replicas of the
bundled demo model behind Ray's proxy, 16 concurrent `openai` clients whose greedy text must equal
`llm.generate`; one replica's process killed mid-run (every request completes or gets a clean 5xx, in
bounded time), Ray brings it back, the next 16 all succeed. One cluster for the module; every wait is
bounded, and a SIGALRM watchdog stops the module if Ray itself hangs."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor, wait

import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'hotcold[ray]'")
pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install 'hotcold[ray]'")

from ray import serve  # noqa: E402

from hotcold.server.ray_serve import APP_NAME, DEPLOYMENT, ReplicaConfig, deployment, serving  # noqa: E402
from tests.server.conftest import off_main_thread, openai_client  # noqa: E402

pytestmark = pytest.mark.slow

N = 24  # tokens per request
PROMPTS = [f"Request {i}: once upon a time" for i in range(16)]
MODULE_LIMIT_S = 420  # the whole module, cluster start and stop included (typically ~1-2 min)
REQUEST_TIMEOUT_S = 60


class Watchdog(Exception):
    pass


@pytest.fixture(scope="module")
def cluster():
    def expired(*_):
        raise Watchdog(f"the Ray test module ran past {MODULE_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(MODULE_LIMIT_S)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ReplicaConfig(threads=1, parallel=4, ctx_size=256)
    try:
        with serving(lambda resources: deployment(config, replicas=2), port=port, num_cpus=2) as url:
            yield url
            signal.alarm(90)  # what is left of the limit no longer matters: the shutdown gets its own
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def expected():
    import hotcold

    llm = hotcold.load(device="cpu", threads=1)
    return [off_main_thread(llm.generate, p, max_tokens=N, temperature=0.0) for p in PROMPTS]


def _complete(url: str, prompt: str) -> str:
    client = openai_client(url, timeout=REQUEST_TIMEOUT_S)
    return client.completions.create(model="demo", prompt=prompt, max_tokens=N, temperature=0).choices[0].text


def _replica_pids() -> set[int]:
    """The live replicas' process ids, from their actors (named SERVE_REPLICA::app#deployment#id)."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#"
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    calls = [
        ray.get_actor(a["name"], namespace=a["namespace"]).__ray_call__.remote(lambda _: os.getpid())
        for a in actors
    ]
    return set(ray.get(calls, timeout=30))


def _running_replicas() -> dict:
    return serve.status().applications[APP_NAME].deployments[DEPLOYMENT].replica_states


def test_two_replicas_serve_greedy_text_survive_a_killed_replica_and_recover(cluster, expected):
    url = cluster
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # 16 concurrent requests over 2 replicas: each the text llm.generate gives
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS, timeout=REQUEST_TIMEOUT_S * 2))
        assert got == expected
        pids = _replica_pids()
        assert len(pids) == 2, pids

        # again, and kill one replica's process once the first request is back (the rest still running)
        futures = [pool.submit(_complete, url, p) for p in PROMPTS]
        wait(futures, timeout=REQUEST_TIMEOUT_S, return_when="FIRST_COMPLETED")
        victim = min(pids)
        outstanding = sum(not f.done() for f in futures)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        done, pending = wait(futures, timeout=REQUEST_TIMEOUT_S + 10)
        assert not pending, f"{len(pending)} requests hung after the kill"
        outcomes = []
        for f, want in zip(futures, expected):
            exc = f.exception()
            if exc is None:
                assert f.result() == want  # a request that completes is right
                outcomes.append(200)
            else:  # or it fails cleanly: an HTTP 5xx answer, not a hang or a cut connection
                assert isinstance(exc, openai.APIStatusError) and exc.status_code >= 500, repr(exc)
                outcomes.append(exc.status_code)
        assert outstanding > 0, "every request had finished before the kill: nothing was mid-run"
        print(f"killed replica pid {victim} with {outstanding} requests outstanding: statuses {outcomes}")

        # Ray replaces the dead replica
        deadline = time.monotonic() + 120
        while _running_replicas() != {"RUNNING": 2} or len(new_pids := _replica_pids() - {victim}) < 2:
            assert time.monotonic() < deadline, f"not recovered: {_running_replicas()}"
            time.sleep(0.5)
        assert victim not in _replica_pids()
        print(f"recovered in {time.monotonic() - t_kill:.1f} s: replicas {sorted(new_pids)}")

        # and the next 16 all succeed
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS, timeout=REQUEST_TIMEOUT_S * 2))
        assert got == expected


def test_health_metrics_and_request_ids_through_the_proxy(cluster):
    import httpx

    r = httpx.get(cluster + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.post(
        cluster + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": "ray-7"},
        timeout=REQUEST_TIMEOUT_S,
    )
    # Ray's proxy adds the header (the client's id when sent); the replica uses the same id, once
    assert r.headers.get_list("x-request-id") == ["ray-7"] and r.json()["id"] == "cmpl-ray-7"
    text = httpx.get(cluster + "/metrics", timeout=10).text  # one replica's gauges
    assert "vllm:num_requests_waiting 0" in text and "vllm:gpu_cache_usage_perc" in text
