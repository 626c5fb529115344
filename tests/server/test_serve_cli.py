"""`hotcold serve` as a person runs it: a subprocess on 127.0.0.1, a free port, an API key."""

from __future__ import annotations

import queue
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


def test_serve_subprocess_with_api_key(tiny_sparse_gguf):
    cmd = [sys.executable, "-m", "hotcold", "serve", "-m", str(tiny_sparse_gguf), "--port", "0"]
    cmd += ["--parallel", "2", "--api-key", "k3y", "-c", "128"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        url, seen, deadline = None, [], time.monotonic() + STARTUP_S
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            if m := re.search(r"running on (http://[\d.]+:\d+)", line):
                url = m.group(1)
        assert url is not None, "server did not start:\n" + "".join(seen)
        assert url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
        assert any("2 slot(s), API key required" in s for s in seen)

        assert httpx.get(url + "/health", timeout=10).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai_client(url).completions.create(model="x", prompt="x", max_tokens=2)
        client = openai_client(url, api_key="k3y")
        r = client.completions.create(
            model="x", prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="context size of 128 tokens"):
            client.completions.create(model="x", prompt="fox " * 200, max_tokens=2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallel", "0"], "--parallel must be >= 1"),
        (["--port", "70000"], "--port must be in"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_serve_refuses_bad_flags(tiny_sparse_gguf, capsys, flags, message):
    assert main(["serve", "-m", str(tiny_sparse_gguf), *flags]) == 1
    assert message in capsys.readouterr().err
