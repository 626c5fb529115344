"""The replica contract routers and orchestrators rely on (issue #17), on the real server over the tiny
sparse model: /health 503 while the model loads and 200 once it is ready, 503 for everything while
draining, request ids in responses and logs, and the router gauges' values under load. (SIGTERM to a real
`hotcold serve` process: test_serve_cli.py.)"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from hotcold.runtime.engine import Engine
from hotcold.server.app import create_app
from hotcold.server.lifecycle import Lifecycle
from hotcold.server.scheduler import Scheduler
from tests.server.conftest import SlowModel, running


def _completion(url: str, **kwargs) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60, **kwargs)


def test_health_is_503_while_loading_then_200_and_503_while_draining(llm):
    release = threading.Event()

    def build():  # the load, held until the test lets it finish
        assert release.wait(timeout=60), "the test never released the load"
        return create_app(llm, parallel=2)

    lifecycle = Lifecycle(build)
    with running(lifecycle) as url:
        r = httpx.get(url + "/health", timeout=10)  # listening, the model still loading
        assert (r.status_code, r.json()) == (503, {"status": "loading model"})
        assert r.headers["Retry-After"] == "5" and r.headers["X-Request-Id"]
        r = _completion(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading_model"
        assert httpx.get(url + "/metrics", timeout=10).status_code == 503
        release.set()
        deadline = time.monotonic() + 30
        while (r := httpx.get(url + "/health", timeout=10)).status_code == 503:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.02)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert _completion(url).json()["usage"]["completion_tokens"] == 4

        lifecycle.drain()  # what SIGTERM does (test_serve_cli sends a real one)
        r = httpx.get(url + "/health", timeout=10)
        assert (r.status_code, r.json()) == (503, {"status": "draining"})
        r = _completion(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # gauges stay readable
        assert lifecycle.drained()


def test_a_failed_load_is_kept_for_the_cli_and_the_server_stays_503(llm):
    def build():
        raise OSError("model.gguf: no such file")

    lifecycle = Lifecycle(build)
    with running(lifecycle) as url:
        deadline = time.monotonic() + 10
        while not lifecycle.failed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.get(url + "/health", timeout=10).status_code == 503
    assert "no such file" in str(lifecycle.error)


def test_request_ids_in_headers_bodies_and_the_log(server_url, caplog):
    with caplog.at_level(logging.INFO, logger="hotcold.server.access"):
        r = _completion(server_url, headers={"X-Request-Id": "trace-42"})
        assert r.headers["X-Request-Id"] == "trace-42"
        assert r.json()["id"] == "cmpl-trace-42"  # the body's id is the request's, as vLLM makes it
        fresh = _completion(server_url)
        rid = fresh.headers["X-Request-Id"]
        assert len(rid) == 32 and fresh.json()["id"] == f"cmpl-{rid}"
        # a header unfit for a log line (spaces, too long) is replaced, not echoed
        for bad in ("two words", "x" * 200):
            r = httpx.get(server_url + "/health", headers={"X-Request-Id": bad}, timeout=10)
            assert r.headers["X-Request-Id"] not in (bad, "") and len(r.headers["X-Request-Id"]) == 32
        # errors carry one too
        r = httpx.post(server_url + "/v1/completions", json={"prompt": 7}, headers={"X-Request-Id": "bad-1"})
        assert r.status_code == 400 and r.headers["X-Request-Id"] == "bad-1"
        chat = httpx.post(
            server_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
            headers={"X-Request-Id": "chat-7"},
            timeout=60,
        )
        assert chat.headers["X-Request-Id"] == "chat-7" and '"id": "chatcmpl-chat-7"' in chat.text
    logged = caplog.text
    assert 'trace-42 "POST /v1/completions" 200' in logged
    assert f'{rid} "POST /v1/completions" 200' in logged
    assert 'bad-1 "POST /v1/completions" 400' in logged


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}


def test_router_gauges_under_load(llm):
    """2 slots, 4 long requests: 2 running, 2 waiting, the KV usage the running ones' share of the
    positions; all done: 0, 0, 0 (idle slots' prefix caches count as free, as in vLLM)."""
    slow = SlowModel(llm.loaded.model, 0.05)
    engines = [Engine(slow, llm.tokenizer, llm.ctx_size) for _ in range(2)]
    scheduler = Scheduler(engines)
    with running(create_app(llm, scheduler=scheduler)) as url, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_completion, url) for _ in range(4)]
        deadline = time.monotonic() + 30
        while (g := _gauges(url))["vllm:num_requests_waiting"] < 2 or g["vllm:gpu_cache_usage_perc"] == 0:
            assert time.monotonic() < deadline, g
            time.sleep(0.01)
        assert g["vllm:num_requests_running"] == 2 == g["hotcold_slots_busy"]
        assert g["vllm:num_requests_waiting"] == 2 == g["hotcold_queue_depth"]
        # each running slot holds at most its prompt and 4 generated tokens, out of 2 slots' positions
        prompt = len(llm.tokenize("Once upon a time"))
        assert g["vllm:gpu_cache_usage_perc"] <= 2 * (prompt + 4) / (2 * llm.ctx_size)
        assert [f.result(timeout=120).status_code for f in futures] == [200] * 4
        g = _gauges(url)
        assert g["vllm:num_requests_running"] == g["vllm:num_requests_waiting"] == 0
        assert g["vllm:gpu_cache_usage_perc"] == 0
        assert g["llamacpp:tokens_predicted_total"] == 16 == g["hotcold_generated_tokens_total"]
