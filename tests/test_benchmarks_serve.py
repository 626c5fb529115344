"""The load-taking parts of benchmarks/serve.py, with a stand-in for the HTTP loads (no server runs here)."""

from __future__ import annotations

import threading

import pytest

from benchmarks import serve


def test_loads_of_each_client_count_run_in_turns_and_each_turn_gives_a_ratio(monkeypatch):
    calls = []
    rates = {1: iter([40.0, 50.0, 45.0]), 8: iter([120.0, 160.0, 150.0])}

    def fake_run_clients(url, n, max_tokens):
        calls.append(n)
        load = {"clients": n, "aggregate_tokens_per_s": next(rates[n]), "prompt_tokens": 10 * n}
        return load | {
            "per_client_tokens_per_s_mean": 1.0,
            "ttft_s_mean": 0.1,
            "ttft_s_max": 0.2,
            "wall_s": 1.0,
        }

    monkeypatch.setattr(serve, "run_clients", fake_run_clients)
    one, eight = serve.interleaved_loads("http://x", [1, 8], 32, 3, "test")
    assert calls == [1, 8, 1, 8, 1, 8]
    assert one["aggregate_tokens_per_s"] == 45.0 and one["rounds_aggregate_tokens_per_s"] == [
        40.0,
        45.0,
        50.0,
    ]
    assert eight["aggregate_tokens_per_s"] == 150.0
    assert eight["rounds_ratio_to_fewest"] == {"clients": 1, "ratios": [3.0, 3.2, 3.33]}
    assert "rounds_ratio_to_fewest" not in one
    line = serve.results_section(
        {
            "machine": {
                "cpu": "c",
                "cores": 2,
                "torch": "t",
                "torch_threads": 2,
                "loadavg_before": [],
                "loadavg_after": [],
            },
            "date": "2026-12-04T00:00",
            "max_tokens": 32,
            "parallel": 8,
            "rounds": 3,
            "servers": {"hotcold sparse": [one, eight]},
            "direct_tokens_per_s": {},
        },
        "cmd",
        "label",
    )
    assert (
        "hotcold sparse: 8 clients' aggregate over 1 client's, load by load" in line
        and "3.0x, 3.2x, 3.33x" in line
    )


def test_a_client_builds_its_http_client_before_the_clock_starts(monkeypatch):
    order = []

    class FakeResponse:
        def raise_for_status(self):
            pass

        def iter_lines(self):
            yield 'data: {"choices": [{"text": "a"}]}'
            yield 'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}'
            yield "data: [DONE]"

    class FakeStream:
        def __enter__(self):
            order.append("request")
            return FakeResponse()

        def __exit__(self, *exc):
            return False

    class FakeClient:
        def __init__(self, timeout):
            order.append("client")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream(self, method, url, json):
            assert method == "POST" and url.endswith("/v1/completions") and json["stream"]
            return FakeStream()

    class Barrier(threading.Barrier):
        def wait(self, timeout=None):
            order.append("start")
            return super().wait(timeout)

    monkeypatch.setattr(serve.httpx, "Client", FakeClient)
    out: dict = {}
    serve.one_client("http://x", "hi", 4, Barrier(1), out)
    assert order == ["client", "start", "request"]
    assert out["tokens"] == 1 and out["prompt_tokens"] == 3 and out["end"] >= out["first"] >= out["start"]


@pytest.mark.parametrize("clients", [[1], [8]])
def test_a_single_client_count_has_no_ratio(monkeypatch, clients):
    monkeypatch.setattr(
        serve, "run_clients", lambda url, n, mt: {"clients": n, "aggregate_tokens_per_s": 1.0}
    )
    (only,) = serve.interleaved_loads("http://x", clients, 32, 2, "test")
    assert "rounds_ratio_to_fewest" not in only
