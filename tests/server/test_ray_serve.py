"""hotcold on Ray Serve (issue #17): `hotcold serve --ray --replicas 2` (a real subprocess, which starts a
local Ray cluster, its HTTP proxy on 127.0.0.1) over the bundled demo model; 16 concurrent `openai`
clients whose greedy text must equal `llm.generate`; one replica's process killed mid-run (every request
completes or gets a clean 5xx, in bounded time), Ray brings it back, the next 16 all succeed; SIGTERM
stops it all, exit status 0. One cluster for the module; the replicas are found as processes (Ray
titles them ray::ServeReplica:APP:DEPLOYMENT) in the CLI's session. Every wait is bounded; a SIGALRM watchdog ends the module if Ray itself hangs, and the
subprocess's whole process group (Ray's processes with it) is killed on the way out in any case."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'hotcold[ray]'")
pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install 'hotcold[ray]'")

from hotcold.server.ray_serve import APP_NAME, DEPLOYMENT  # noqa: E402
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
    """{"url", "proc", "stderr"}: `hotcold serve --ray` running."""

    def expired(*_):
        raise Watchdog(f"the Ray test module ran past {MODULE_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(MODULE_LIMIT_S)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hotcold", "serve", "--ray", "--replicas", "2", "-t", "1", "-np", "4"]
    cmd += ["-c", "256", "--port", str(port), "--drain-timeout", "10"]
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True).start()
    try:
        found, deadline = None, time.monotonic() + 240
        while found is None:
            assert proc.poll() is None and time.monotonic() < deadline, "did not start:\n" + "".join(seen)
            pattern = r"running on (http://127\.0\.0\.1:\d+) \(Ray cluster at ([\w.:-]+);"
            found = next((m for line in list(seen) if (m := re.search(pattern, line))), None)
            time.sleep(0.2)
        assert "2 Ray Serve replica(s), 1 thread(s) and 0 GPU each" in found.string
        yield {"url": found.group(1), "proc": proc, "stderr": seen}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        try:  # whatever happened above: nothing of this cluster outlives the module
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the CLI and the Ray processes it started
        except ProcessLookupError:
            pass  # all gone already
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def expected():
    import hotcold

    llm = hotcold.load(device="cpu", threads=1)
    return [off_main_thread(llm.generate, p, max_tokens=N, temperature=0.0) for p in PROMPTS]


def _complete(url: str, prompt: str) -> str:
    client = openai_client(url, timeout=REQUEST_TIMEOUT_S)
    return client.completions.create(model="demo", prompt=prompt, max_tokens=N, temperature=0).choices[0].text


def _replica_pids(session: int) -> set[int]:
    """The live replica processes of the CLI started in `session`."""
    title = f"ray::ServeReplica:{APP_NAME}:{DEPLOYMENT}".encode()
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == session:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(title):
                        pids.add(int(entry))
        except OSError:
            pass  # gone meanwhile
    return pids


def _completions_counted(url: str) -> float:
    """Completions the replica answering this /metrics request has counted."""
    text = httpx.get(url + "/metrics", timeout=10).text
    line = re.search(r'hotcold_requests_total\{route="/v1/completions",status="200"\} (\d+)', text)
    return float(line.group(1)) if line else 0.0


def test_two_replicas_serve_greedy_text_survive_a_killed_replica_and_recover(cluster, expected):
    url = cluster["url"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # 16 concurrent requests over 2 replicas: each the text llm.generate gives
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS, timeout=REQUEST_TIMEOUT_S * 2))
        assert got == expected
        session = cluster["proc"].pid
        pids = _replica_pids(session)
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

        # Ray replaces the dead replica: a new process, which takes requests once it has loaded (a
        # fresh replica's /metrics counts no completions; the survivor's counts at least 8)
        deadline = time.monotonic() + 120
        while len(new := _replica_pids(session) - {victim}) < 2 or _completions_counted(url) > 0:
            assert time.monotonic() < deadline, f"not recovered: replicas {new}"
            time.sleep(0.2)
        assert victim not in _replica_pids(session)
        print(f"recovered in {time.monotonic() - t_kill:.1f} s: replicas {sorted(new)}")

        # and the next 16 all succeed
        got = list(pool.map(lambda p: _complete(url, p), PROMPTS, timeout=REQUEST_TIMEOUT_S * 2))
        assert got == expected


def test_health_metrics_and_request_ids_through_the_proxy(cluster):
    url = cluster["url"]
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": "ray-7"},
        timeout=REQUEST_TIMEOUT_S,
    )
    # Ray's proxy adds the header (the client's id when sent); the replica uses the same id, once
    assert r.headers.get_list("x-request-id") == ["ray-7"] and r.json()["id"] == "cmpl-ray-7"
    text = httpx.get(url + "/metrics", timeout=10).text  # one replica's gauges
    assert "vllm:num_requests_waiting 0" in text and "vllm:gpu_cache_usage_perc" in text


def test_sigterm_drains_and_stops_the_cluster_with_status_0(cluster):
    proc = cluster["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=150) == 0, "".join(cluster["stderr"])
    assert any("draining the replicas" in line for line in cluster["stderr"])
