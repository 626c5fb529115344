"""The speed and sparsity figures every response carries (`timings`, hotcold.server.figures) and the
placement at `/props`, through the real server and the official `openai` client, CPU-only and hybrid
(a second CPU placement standing in for the GPU).

References: the engine's own counts for the request (its sequence's totals before and after), and an
independent count from the predictor masks of a lone generation of the same prompt (neurons computed,
and those among the placement's hot neurons)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from hotcold.runtime.engine import Engine
from hotcold.runtime.generation import Generation, GenerationStats
from hotcold.server.app import create_app
from hotcold.server.figures import timings
from hotcold.server.scheduler import Scheduler
from tests.server.conftest import off_main_thread, openai_client, running

N = 6
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me about the fox."}]
LLAMA_TIMINGS = (
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
)
OURS = ("cache_n", "ffn_neurons_computed", "ffn_neurons_total", "ffn_computed_share", "ffn_gpu_share")


def mask_counts(llm, prompt_ids: list[int], max_tokens: int) -> tuple[int, int, int]:
    """(computed, total, on the hot rows) from the predictor masks of a lone generation, forward by forward."""
    hot = llm.loaded.hot
    engine = Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size)
    engine.seq.keep_masks = True
    gen = Generation(engine, prompt_ids, max_tokens=max_tokens, ignore_eos=True)
    computed = total = on_hot = 0
    with torch.inference_mode():
        while not gen.done:
            ids, pos = gen.want()
            logits = engine.forward(ids, pos, last_only=True)[-1]
            for layer, (_, mask) in engine.seq.masks.items():
                computed += int(mask.sum())
                total += mask.numel()
                if hot is not None:
                    on_hot += int(mask[:, torch.as_tensor(hot[layer], dtype=torch.long)].sum())
            engine.seq.masks.clear()
            gen.take(logits)
    return computed, total, on_hot


def check_consistent(t: dict, *, n_layer: int, n_ff: int) -> None:
    assert set(LLAMA_TIMINGS + OURS) <= set(t)
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / (t["prompt_ms"] / 1000))
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    # predicted_ms times the forwards after the first token (which comes from the prompt's)
    decoded = t["predicted_n"] - 1
    assert t["predicted_per_second"] == pytest.approx(decoded / (t["predicted_ms"] / 1000))
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / decoded)
    # every forward token runs every layer's FFN: the prompt tokens run, then one per token after the first
    assert t["ffn_neurons_total"] == (t["prompt_n"] + decoded) * n_layer * n_ff
    assert 0 < t["ffn_neurons_computed"] < t["ffn_neurons_total"]
    assert t["ffn_computed_share"] == pytest.approx(t["ffn_neurons_computed"] / t["ffn_neurons_total"])


def test_timings_is_a_pure_function_of_the_stats():
    a = GenerationStats(4, 5, 0.2, 3, 0.5, 30, 100, 12)
    b = GenerationStats(4, 1, 0.1, 4, 0.0, 10, 40, 0)
    t = timings([a], hybrid=True)
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (3, 1, 5)
    assert t["prompt_per_second"] == pytest.approx(15.0) and t["predicted_per_second"] == pytest.approx(8.0)
    assert t["predicted_per_token_ms"] == pytest.approx(125.0)
    assert t["ffn_gpu_neurons"] == 12 and t["ffn_gpu_share"] == pytest.approx(0.4)
    both = timings([a, b], hybrid=False)  # n choices: summed, rates per sequence
    assert (both["prompt_n"], both["predicted_n"], both["ffn_neurons_computed"]) == (7, 6, 40)
    assert both["predicted_per_second"] == pytest.approx(4 / 0.5)
    assert both["ffn_gpu_neurons"] is None and both["ffn_gpu_share"] is None
    empty = timings([GenerationStats()], hybrid=True)  # max_tokens 0: nothing ran, nothing divides by 0
    assert empty["predicted_per_second"] == 0.0 and empty["ffn_computed_share"] is None
    assert empty["ffn_gpu_share"] is None


@pytest.fixture(scope="module")
def cpu_server(llm):
    engine = Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size)
    with running(create_app(llm, scheduler=Scheduler([engine]))) as url:
        yield url, engine


def test_openai_routes_carry_the_engines_counts(cpu_server, llm):
    url, engine = cpu_server
    client = openai_client(url)
    shape = dict(n_layer=llm.config.n_layer, n_ff=llm.config.n_ff)
    ids = llm.tokenize(PROMPT)
    computed, total, _ = off_main_thread(mask_counts, llm, ids, N)
    engine.cached_ids = []  # a cold cache: the whole prompt runs, as in the reference
    before = engine.seq.neuron_totals()
    start = time.perf_counter()
    r = client.completions.create(
        model="x", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    wall_ms = (time.perf_counter() - start) * 1000
    after = engine.seq.neuron_totals()
    t = r.timings  # the client keeps the extension field
    check_consistent(t, **shape)
    assert t["ffn_neurons_computed"] == after[0] - before[0] == computed
    assert t["ffn_neurons_total"] == after[1] - before[1] == total
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (len(ids), 0, N)
    assert t["predicted_n"] == r.usage.completion_tokens
    assert 0 < t["prompt_ms"] + t["predicted_ms"] < wall_ms  # measured inside the request
    assert t["ffn_gpu_neurons"] is None and t["ffn_gpu_share"] is None  # CPU only

    # the same request again: its prefix is cached, the figures say so and count only what ran
    before = engine.seq.neuron_totals()
    again = client.completions.create(model="x", prompt=PROMPT, max_tokens=N, extra_body={"ignore_eos": True})
    assert again.timings["cache_n"] == len(ids) - 1 and again.timings["prompt_n"] == 1
    assert again.timings["ffn_neurons_computed"] == engine.seq.neuron_totals()[0] - before[0]

    # chat, streamed: the chunk that finishes the choice has the timings; with usage, the usage chunk too
    for include_usage in (False, True):
        before = engine.seq.neuron_totals()
        stream = client.chat.completions.create(
            model="x",
            messages=CHAT,
            max_tokens=N,
            stream=True,
            stream_options={"include_usage": include_usage},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        spent = engine.seq.neuron_totals()[0] - before[0]
        with_timings = [c for c in chunks if (c.model_extra or {}).get("timings")]
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishing[0] in with_timings
        assert len(with_timings) == 1 + include_usage and with_timings[-1] is chunks[-1]
        for c in with_timings:
            check_consistent(c.timings, **shape)
            assert c.timings["ffn_neurons_computed"] == spent
        if include_usage:
            assert chunks[-1].usage.completion_tokens == chunks[-1].timings["predicted_n"] == N
    whole = client.chat.completions.create(model="x", messages=CHAT, max_tokens=N)
    check_consistent(whole.timings, **shape)
    assert whole.timings["predicted_n"] == whole.usage.completion_tokens


def test_llama_completion_keeps_llamacpp_timings(cpu_server, llm):
    url, engine = cpu_server
    body = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "temperature": 0}
    before = engine.seq.neuron_totals()[0]
    r = httpx.post(url + "/completion", json=body, timeout=60).json()
    t = r["timings"]
    check_consistent(t, n_layer=llm.config.n_layer, n_ff=llm.config.n_ff)
    assert t["ffn_neurons_computed"] == engine.seq.neuron_totals()[0] - before
    assert t["predicted_n"] == r["tokens_predicted"] == N
    assert t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"] and t["cache_n"] == r["tokens_cached"]
    with httpx.stream("POST", url + "/completion", json=body | {"stream": True}, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-1][len("data: ") :])
    assert last["stop"] is True and set(LLAMA_TIMINGS) <= set(last["timings"])
    assert all("timings" not in json.loads(e[len("data: ") :]) for e in events[:-1])


def test_props_says_where_the_model_runs(cpu_server, llm):
    url, _ = cpu_server
    props = httpx.get(url + "/props", timeout=10).json()
    assert props["total_slots"] == 1 and props["default_generation_settings"]["n_ctx"] == llm.ctx_size
    p = props["hotcold"]
    assert p["mode"] == "sparse" and p["hybrid"] is False and p["hot_neurons_per_layer"] is None
    assert p["ffn_neurons"] == llm.config.n_layer * llm.config.n_ff and p["hot_share"] == 0.0
    assert "CPU only" in p["summary"]


def test_hybrid_reports_the_share_on_the_gpu(hybrid_llm):
    llm = hybrid_llm
    hot = [len(h) for h in llm.loaded.hot]
    ids = llm.tokenize(PROMPT)
    computed, _, on_hot = off_main_thread(mask_counts, llm, ids, N)
    assert 0 < on_hot < computed
    engines = [Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size) for _ in range(2)]
    with running(create_app(llm, scheduler=Scheduler(engines))) as url:
        p = httpx.get(url + "/props", timeout=10).json()["hotcold"]
        assert p["hybrid"] is True and p["hot_neurons_per_layer"] == hot
        assert p["hot_share"] == pytest.approx(sum(hot) / (2 * 1280))
        assert f"{100 * p['hot_share']:.1f}% of FFN neurons hot on cpu" in p["summary"]
        client = openai_client(url)
        r = client.completions.create(
            model="x", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        t = r.timings
        check_consistent(t, n_layer=2, n_ff=1280)
        assert (t["ffn_neurons_computed"], t["ffn_gpu_neurons"]) == (computed, on_hot)
        assert t["ffn_gpu_share"] == pytest.approx(on_hot / computed)
        # two choices in one batch (greedy: the same tokens): each sequence's counts are its own, summed; the
        # prompt runs once (the second choice starts from a copy of the first one's cache)
        for e in engines:
            e.cached_ids = []
        r = client.completions.create(
            model="x", prompt=PROMPT, max_tokens=N, temperature=0, n=2, extra_body={"ignore_eos": True}
        )
        t = r.timings
        assert computed < t["ffn_neurons_computed"] < 2 * computed
        assert on_hot < t["ffn_gpu_neurons"] < 2 * on_hot
        assert t["predicted_n"] == r.usage.completion_tokens == 2 * N
        # streamed: only the chunk that finishes the last choice carries them
        for e in engines:
            e.cached_ids = []
        chunks = list(
            client.completions.create(
                model="x",
                prompt=PROMPT,
                max_tokens=N,
                temperature=0,
                n=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishing) == 2
        assert [c for c in chunks if (c.model_extra or {}).get("timings")] == [finishing[-1]]
        counts = (
            "prompt_n",
            "cache_n",
            "predicted_n",
            "ffn_neurons_computed",
            "ffn_neurons_total",
            "ffn_gpu_neurons",
        )
        assert {k: finishing[-1].timings[k] for k in counts} == {k: t[k] for k in counts}
