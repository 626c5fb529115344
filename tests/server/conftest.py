"""Fixtures for the server tests: the tiny sparse model loaded once, and real uvicorn servers on
127.0.0.1 (a free port, in a thread) that the tests talk to over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

STARTUP_TIMEOUT_S = 20


@contextmanager
def running(app):
    """Serve `app` on 127.0.0.1 at a free port; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="session")
def llm(tiny_sparse_gguf):
    import hotcold

    return hotcold.load(tiny_sparse_gguf, device="cpu")


@pytest.fixture(scope="module")
def server_url(llm):
    """A server with 4 slots (so 8 clients also exercise the queue)."""
    from hotcold.server.app import create_app

    with running(create_app(llm, parallel=4)) as url:
        yield url


class SlowModel:
    """The real model, `delay` seconds slower per forward: makes an abandoned generation visibly long."""

    def __init__(self, model, delay: float):
        self._model, self._delay = model, delay

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._model.forward(*args, **kwargs)


def off_main_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread, as the server's slots run. Reference generations go here:
    on a loaded 2-core machine torch's small parallel ops were measured ~50x slower from the main thread
    than from another thread (OpenMP barriers), which made the references dominate the test time."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result(timeout=120)


def openai_client(base_url: str, api_key: str = "none", timeout: float = 60.0):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="session")
def hybrid_llm(tmp_path_factory, tiny_sparse_gguf):
    """The tiny sparse model with activation statistics, loaded with some of its hot neurons on a second
    CPU placement that stands in for the GPU (loader's fast_device): a hybrid model without a GPU."""
    import shutil

    import torch

    import hotcold
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.loader import load_model
    from hotcold.placement.budget import scratch_bytes
    from hotcold.placement.profile import write_activation_files

    folder = tmp_path_factory.mktemp("hybrid")
    path = folder / "m.powerinfer.gguf"
    shutil.copy(tiny_sparse_gguf, path)
    g = torch.Generator().manual_seed(0)
    write_activation_files(
        [torch.randint(0, 1000, (1280,), generator=g) for _ in range(2)], folder / "activation"
    )
    # scratch + the dense parts of the tiny model (~0.9 MB) + room for some hot rows (1280 x 768 B per layer)
    budget = (scratch_bytes(config_from_file(ModelFile(path))) + 900_000 + 800_000) / 2**30
    loaded = load_model(path, device="cpu", fast_device="cpu", vram_budget=budget)
    assert loaded.hot is not None and 0 < sum(len(h) for h in loaded.hot) < 2 * 1280
    return hotcold.Model(loaded)
