"""The real server (uvicorn on 127.0.0.1) over the tiny sparse model, driven by the official `openai`
client and raw HTTP. Reference: the Python API (`llm.generate`, `llm.chat`) on the same model."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from hotcold.runtime.engine import Engine
from hotcold.server.app import Limits, create_app
from hotcold.server.scheduler import Scheduler
from tests.server.conftest import SlowModel, off_main_thread, openai_client, running

N = 12  # tokens per request: short, the machine is shared
PROMPTS = [f"Line {i}: the quick brown fox" for i in range(8)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox."}]


def post(url: str, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    headers = {"Content-Type": "application/json"} | kwargs.pop("headers", {})
    kwargs.setdefault("timeout", 60)
    return httpx.post(url + path, content=content, headers=headers, **kwargs)


def sse_data(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]


def test_health_models_and_page(server_url, llm):
    assert httpx.get(server_url + "/health", timeout=10).json()["status"] == "ok"
    models = openai_client(server_url).models.list().data
    assert [m.id for m in models] == [llm.path.name]
    page = httpx.get(server_url + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # no external assets


def test_greedy_completion_equals_generate(server_url, llm):
    client = openai_client(server_url)
    for prompt in PROMPTS[:2]:
        expected = off_main_thread(llm.generate, prompt, max_tokens=N, temperature=0.0)
        r = client.completions.create(model="x", prompt=prompt, max_tokens=N, temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.prompt_tokens == len(llm.tokenize(prompt))
        assert r.choices[0].finish_reason in ("stop", "length")
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == N

        stream = client.completions.create(
            model="x",
            prompt=prompt,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # the same prompt again: all but its last token's keys and values come from a slot's cache
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(llm.tokenize(prompt)) - 1


def test_token_prompt_and_length_finish(server_url, llm):
    ids = llm.tokenize(PROMPTS[2])
    expected = off_main_thread(llm.generate, ids, max_tokens=5, temperature=0.0, ignore_eos=True)
    r = openai_client(server_url).completions.create(
        model="x", prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_greedy_chat_equals_llm_chat(server_url, llm):
    client = openai_client(server_url)
    expected = off_main_thread(llm.chat, CHAT, max_tokens=N, temperature=0.0)
    r = client.chat.completions.create(model="x", messages=CHAT, max_tokens=N, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(llm.chat_prompt_ids(CHAT))

    chunks = list(
        client.chat.completions.create(model="x", messages=CHAT, max_tokens=N, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_cut_the_text(server_url, llm):
    full = off_main_thread(llm.generate, PROMPTS[3], max_tokens=N, temperature=0.0, ignore_eos=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = off_main_thread(
        llm.generate, PROMPTS[3], max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop]
    )
    assert stop not in expected
    client = openai_client(server_url)
    for stops in (stop, [stop, "never-there"]):
        r = client.completions.create(
            model="x",
            prompt=PROMPTS[3],
            max_tokens=N,
            temperature=0,
            stop=stops,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server_url):
    client = openai_client(server_url)
    kwargs = dict(model="x", prompt=PROMPTS[4], max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_eight_concurrent_streaming_clients_get_their_greedy_text(server_url, llm):
    expected = [off_main_thread(llm.generate, p, max_tokens=N, temperature=0.0) for p in PROMPTS]

    def client_run(prompt: str) -> str:
        stream = openai_client(server_url).completions.create(
            model="x", prompt=prompt, max_tokens=N, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client_run, p) for p in PROMPTS]
        got = [f.result(timeout=120) for f in futures]
    assert got == expected
    health = httpx.get(server_url + "/health", timeout=10).json()
    assert health["queue"] == 0


BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "x", "max_tokens": 4', 400, None),  # malformed JSON
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),  # wrong type
    ("/v1/completions", {"prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 9}, 400, "n"),  # above 8
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n"),  # above --parallel (4)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", [1, 2, 3], 400, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/completion", {"prompt": "x", "n_predict": -2}, 400, "n_predict"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"content": None}, 400, "content"),
    ("/v1/nothing-here", {}, 404, None),
    # issue #47 D10: every 400 names its field
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "seed"),
    ("/completion", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": 7, "max_tokens": "x"}, 400, "prompt"),  # two fields wrong: the first
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
        400,
        "messages.0.content.1",
    ),
    # issue #47 D2: a call whose function is not an object was a 500
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": 5}]},
            ]
        },
        400,
        "messages.1.tool_calls.0.function",
    ),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_carries_on(server_url, path, body, status, param):
    r = post(server_url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = post(server_url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_prompt_longer_than_the_context_is_refused(server_url, llm):
    prompt = "the quick brown fox " * llm.ctx_size
    with pytest.raises(openai.BadRequestError, match="longer than the context size") as info:
        openai_client(server_url).completions.create(model="x", prompt=prompt, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="longer than the context size"):
        openai_client(server_url).chat.completions.create(
            model="x", messages=[{"role": "user", "content": prompt}], max_tokens=2
        )
    assert openai_client(server_url).completions.create(model="x", prompt="x", max_tokens=2).choices


def test_oversized_body_and_wrong_content_type(server_url):
    huge = json.dumps({"prompt": "a" * (Limits().max_body_bytes + 10)})
    r = post(server_url, "/v1/completions", huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = post(server_url, "/v1/completions", '{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert post(server_url, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_llama_cpp_routes(server_url, llm):
    prompt = PROMPTS[5]
    expected = off_main_thread(llm.generate, prompt, max_tokens=N, temperature=0.0)
    r = post(server_url, "/completion", {"prompt": prompt, "n_predict": N, "temperature": 0}).json()
    assert r["content"] == expected and r["stop"] is True
    assert r["tokens_evaluated"] == len(llm.tokenize(prompt)) and "predicted_per_second" in r["timings"]
    streamed = post(
        server_url, "/completion", {"prompt": prompt, "n_predict": N, "temperature": 0, "stream": True}
    )
    events = [json.loads(d) for d in sse_data(streamed)]
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])

    tokens = post(server_url, "/tokenize", {"content": prompt}).json()["tokens"]
    assert tokens == llm.tokenize(prompt, add_bos=False)
    with_bos = post(server_url, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert with_bos == llm.tokenize(prompt)
    assert post(server_url, "/detokenize", {"tokens": tokens}).json()["content"] == llm.detokenize(tokens)


def test_metrics_count_requests_and_tokens(server_url):
    post(server_url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(server_url + "/metrics", timeout=10).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    assert values['hotcold_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert values["hotcold_generated_tokens_total"] >= 3 and values["hotcold_prompt_tokens_total"] >= 1
    assert values["hotcold_queue_depth"] == 0 and values["hotcold_slots_total"] == 4
    assert "hotcold_tokens_per_second" in values
    # the router-facing names, with their meanings: nothing running or waiting now, so no KV cache in use
    # (the slot that served the request keeps its tokens for prefix reuse, but any request may take it:
    # free, as in vLLM; test_lifecycle checks the values under load)
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:gpu_cache_usage_perc"] == 0
    assert values["llamacpp:tokens_predicted_total"] == values["hotcold_generated_tokens_total"]
    assert values["llamacpp:prompt_tokens_total"] == values["hotcold_prompt_tokens_total"]


def test_api_key_is_required_everywhere_but_health(llm):
    with running(create_app(llm, api_key="s3cret")) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(url + path, timeout=10).status_code == 401
        r = post(url, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai_client(url, api_key="wrong").completions.create(model="x", prompt="x", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai_client(url, api_key="wrong").chat.completions.create(
                model="x", messages=CHAT, max_tokens=2
            )
        r = openai_client(url, api_key="s3cret").completions.create(model="x", prompt="x", max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_disconnected_clients_free_their_slot(llm):
    # one slot, 50 ms per token: an abandoned request alone would take ~10 s to finish
    engine = Engine(SlowModel(llm.loaded.model, 0.05), llm.tokenizer, llm.ctx_size)
    scheduler = Scheduler([engine])
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    with running(create_app(llm, scheduler=scheduler)) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]  # it has begun
        check_slot_is_free(url, scheduler, cancelled=1)  # the streaming client hung up
        with pytest.raises(httpx.ReadTimeout):
            post(url, "/v1/completions", body, timeout=0.5)
        check_slot_is_free(url, scheduler, cancelled=2)  # the waiting client gave up


def check_slot_is_free(url: str, scheduler: Scheduler, *, cancelled: int) -> None:
    """The next request gets the slot within a few tokens."""
    start = time.monotonic()
    r = openai_client(url).completions.create(
        model="x", prompt="x", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3
    assert time.monotonic() - start < 5
    assert scheduler.cancelled == cancelled


def test_errors_inside_are_500_json_and_the_server_carries_on(llm):
    class Broken:  # a model whose forward fails: the batch step's error reaches the clients
        def __getattr__(self, name):
            return getattr(llm.loaded.model, name)

        def forward(self, *args, **kwargs):
            raise RuntimeError("kernel exploded")

    stub = SimpleNamespace(
        path=llm.path,
        loaded=llm.loaded,
        ctx_size=llm.ctx_size,
        tokenizer=llm.tokenizer,
        config=llm.config,
        tokenize=llm.tokenize,
        detokenize=lambda ids: 1 / 0,
        chat_prompt_ids=llm.chat_prompt_ids,
    )
    with running(
        create_app(stub, scheduler=Scheduler([Engine(Broken(), llm.tokenizer, llm.ctx_size)]))
    ) as url:
        r = post(url, "/detokenize", {"tokens": [1, 2]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = post(url, "/v1/completions", {"prompt": "x"})
        assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="kernel exploded"):
            list(openai_client(url).completions.create(model="x", prompt="x", stream=True))
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        assert post(url, "/tokenize", {"content": "still here"}).status_code == 200


def test_lone_surrogates_and_huge_seeds_never_500(server_url, llm):
    """Issue #15 item 5: text with a lone surrogate is served (the tokenizer reads it as U+FFFD, as it
    reads any text); a seed outside [0, 2**64) is a 400 naming the rule, on every route."""
    r = post(server_url, "/v1/completions", '{"prompt": "\\ud800abc", "max_tokens": 3, "ignore_eos": true}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    chat = '{"messages": [{"role": "user", "content": "\\udfffx"}], "max_tokens": 2}'
    assert post(server_url, "/v1/chat/completions", chat).status_code == 200
    assert post(server_url, "/tokenize", '{"content": "\\ud800a"}').json()["tokens"] == llm.tokenize(
        "\ufffda", add_bos=False
    )
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**70}),
        ("/completion", {"prompt": "hi", "n_predict": 2, "seed": 2**64}),
    ):
        r = post(server_url, path, body)
        assert r.status_code == 400 and "seed must be in [0, 2**64)" in r.json()["error"]["message"]
    assert httpx.get(server_url + "/health", timeout=10).json()["status"] == "ok"


def test_chat_templates_that_fail_or_run_on_are_400s_naming_the_template(llm, monkeypatch):
    """Issue #47 D3: a model's template that divides by zero, recurses for ever or loops 10**10 times gave a
    500 or ran on (25 s and counting); now a 400 naming the template within a few seconds, and the server
    carries on."""
    import copy

    from hotcold import chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    model = copy.copy(llm)
    model.tokenizer = copy.copy(llm.tokenizer)
    body = {"messages": CHAT, "max_tokens": 2}
    with running(create_app(model)) as url:
        for template, problem in [
            ("{{ 1 // 0 }}", "failed: ZeroDivisionError"),
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed: RecursionError"),
            (
                "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                "was stopped",
            ),
            ("{{ 'x' * 10**10 }}", "was stopped"),
            ("{{ raise_exception('no system role') }}", "refused the conversation: no system role"),
        ]:
            model.tokenizer.chat_template = template
            start = time.monotonic()
            r = post(url, "/v1/chat/completions", body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["message"].startswith(
                f"{llm.path.name}'s chat template (tokenizer.chat_template) {problem}"
            )
            assert error["code"] == "chat_template_error" and error["param"] == "messages"
            assert time.monotonic() - start < 10
        model.tokenizer.chat_template = None
        assert post(url, "/v1/chat/completions", body).status_code == 200


def test_a_body_that_trickles_in_gets_408(llm):
    """Issue #47 D7: a client that sent its headers and then trickled the body held the connection for as
    long as it liked (40 s and more); the body must arrive within Limits.body_timeout_s."""
    import socket

    with running(create_app(llm, limits=Limits(body_timeout_s=1.0))) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n"
            )
            sock.sendall(head.encode() + b'{"prompt": ')  # and nothing more
            start = time.monotonic()
            answer = sock.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert '"code":"body_timeout"' in answer and time.monotonic() - start < 8
        assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
