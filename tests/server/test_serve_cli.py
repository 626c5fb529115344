"""`hotcold serve` as a person runs it: a subprocess on 127.0.0.1, a free port, an API key."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from hotcold.cli import main
from tests.server.conftest import openai_client

STARTUP_S = 90


def start_serve(*flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`hotcold serve FLAGS --port 0` as a subprocess, until it is ready: the process, its URL and the stderr
    lines so far (more keep coming into that list). It listens before the model is loaded: /health must
    say 503 "loading model" until it says 200 "ok", nothing else."""
    cmd = [sys.executable, "-m", "hotcold", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + STARTUP_S
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, "did not start:\n" + "".join(seen)
            url = next(
                (m.group(1) for s in list(seen) if (m := re.search(r"running on (http://[\d.]+:\d+)", s))),
                None,
            )
            time.sleep(0.05)
        while (r := httpx.get(url + "/health", timeout=10)).status_code != 200:
            assert (r.status_code, r.json()) == (503, {"status": "loading model"})
            assert proc.poll() is None and time.monotonic() < deadline, "never ready:\n" + "".join(seen)
            time.sleep(0.05)
        assert r.json()["status"] == "ok"
        return proc, url, seen
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def test_serve_subprocess_with_api_key(tiny_sparse_gguf):
    proc, url, seen = start_serve(
        "-m", str(tiny_sparse_gguf), "--parallel", "2", "--api-key", "k3y", "-c", "128"
    )
    try:
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        deadline = time.monotonic() + 10
        while not any("2 slots, API key required" in s for s in seen):
            assert time.monotonic() < deadline, "".join(seen)
            time.sleep(0.05)

        assert httpx.get(url + "/health", timeout=10).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai_client(url).completions.create(model="x", prompt="x", max_tokens=2)
        client = openai_client(url, api_key="k3y")
        r = client.completions.with_raw_response.create(
            model="x", prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert r.parse().usage.completion_tokens == 4
        rid = r.headers["x-request-id"]
        with pytest.raises(openai.BadRequestError, match="context size of 128 tokens"):
            client.completions.create(model="x", prompt="fox " * 200, max_tokens=2)
        # the request log names each request by its id (uvicorn's own access log has none)
        deadline = time.monotonic() + 10
        while not any(f'{rid} "POST /v1/completions" 200' in s for s in seen):
            assert time.monotonic() < deadline, "".join(seen)
            time.sleep(0.05)
    finally:
        stop(proc)


def test_default_server_opens_llama_servers_four_slots(tiny_sparse_gguf):
    """No -np: 4 slots, as llama-server's auto (their KV caches fit this machine's memory), so a request with
    n=2 is answered (one slot before: refused)."""
    proc, url, seen = start_serve("-m", str(tiny_sparse_gguf), "-c", "128", "-t", "1")
    try:
        deadline = time.monotonic() + 10
        while not any("4 slots (-np 4, as llama-server)" in s for s in seen):
            assert time.monotonic() < deadline, "".join(seen)
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=10).json()["slots_idle"] == 4
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2, "n": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    finally:
        stop(proc)


def test_sigterm_drains_a_streaming_request_refuses_new_ones_and_exits_0():
    """Issue #17: SIGTERM during a streaming request: that request completes, new requests (and /health)
    get 503 meanwhile, then the process exits with status 0 and stops listening."""
    proc, url, seen = start_serve("-t", "1", "--parallel", "2")  # the bundled demo model, 512 context
    try:
        first, out = threading.Event(), {}

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            body["stream_options"] = {"include_usage": True}
            chunks = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        first.set()
            out["chunks"], out["end"] = chunks, time.monotonic()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(timeout=60), "the stream never started:\n" + "".join(seen)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the signal is handled between two of the server's steps
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        health = httpx.get(url + "/health", timeout=10)
        refused_at = time.monotonic()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        reader.join(timeout=120)
        assert not reader.is_alive()
        assert refused_at < out["end"], "the stream ended before the 503: the test proves nothing"
        chunks = out["chunks"]
        assert out["status"] == 200 and chunks[-1]["usage"]["completion_tokens"] == 400
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=30) == 0, "".join(seen)
        with pytest.raises(httpx.ConnectError):  # and it no longer listens
            httpx.get(url + "/health", timeout=5)
    finally:
        stop(proc)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallel", "0"], "--parallel must be >= 1"),
        (["--port", "70000"], "--port must be in"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--replicas", "2"], "go with --ray"),
        (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    ],
)
def test_serve_refuses_bad_flags(tiny_sparse_gguf, capsys, flags, message):
    assert main(["serve", "-m", str(tiny_sparse_gguf), *flags]) == 1
    assert message in capsys.readouterr().err


def test_a_model_that_fails_to_load_stops_the_server_with_one_line(tmp_path, capsys):
    # the server listens before the model loads; a failed load stops it and reports as any command does
    assert main(["serve", "-m", str(tmp_path / "missing.gguf"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "hotcold: error:" in err and "missing.gguf" in err


def test_ray_without_the_extra_names_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else real(name, *a)
    )
    assert main(["serve", "--ray", "--replicas", "2"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "hotcold: error: --ray needs Ray Serve, an optional extra: pip install 'hotcold[ray]'"
    )
