"""`n` choices and logprobs through the real server (uvicorn on 127.0.0.1, the tiny sparse model, the
official `openai` client). References: single requests (choice i = the n=1 request with seed + i), and
`log_softmax(llm.logits(prompt + generated))` at the generated tokens."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest
import torch

from hotcold.runtime.engine import Engine
from hotcold.runtime.sampling import SamplingParams
from hotcold.server.app import create_app
from hotcold.server.scheduler import GenerationRequest, QueueFull, Scheduler
from tests.server.conftest import SlowModel, off_main_thread, openai_client, running

N = 8  # tokens per choice
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me about the fox."}]
SAMPLED = dict(temperature=1.0, top_p=0.9)


def reference_ids(llm, prompt_ids: list[int], params: SamplingParams, n: int = N) -> list[int]:
    """The tokens a lone generation samples (Engine.generate_step: no server, no batch, no stop)."""
    engine = Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size)
    return list(itertools.islice(engine.generate_step(prompt_ids, params), n))


def reference_logprobs(llm, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    """log_softmax of the full forward's logits at the positions that predicted `ids`: [len(ids), V]."""
    logits = off_main_thread(llm.logits, prompt_ids + ids)
    return torch.log_softmax(logits.float(), -1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(ids)]


def token_text(llm, token: int) -> str:
    return llm.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def test_n_seeded_choices_equal_single_requests_with_seed_plus_i(server_url, llm):
    client = openai_client(server_url)
    kwargs = dict(model="x", prompt=PROMPT, max_tokens=N, extra_body={"ignore_eos": True}, **SAMPLED)
    r = client.completions.create(n=3, seed=1234, **kwargs)
    singles = [client.completions.create(seed=1234 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so (on this model) do the samples
    assert r.usage.completion_tokens == 3 * N and r.usage.prompt_tokens == len(llm.tokenize(PROMPT))

    stream = client.completions.create(
        n=3, seed=1234, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    texts, finished = ["", "", ""], [None, None, None]
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == singles and finished == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 3 * N

    chat_kwargs = dict(model="x", messages=CHAT, max_tokens=N, extra_body={"ignore_eos": True}, **SAMPLED)
    chat = client.chat.completions.create(n=2, seed=7, **chat_kwargs)
    alone = [client.chat.completions.create(seed=7 + i, **chat_kwargs) for i in range(2)]
    assert [c.message.content for c in chat.choices] == [a.choices[0].message.content for a in alone]


def test_n_greedy_choices_are_all_the_greedy_answer(server_url, llm):
    client = openai_client(server_url)
    expected = off_main_thread(llm.generate, PROMPT, max_tokens=N, temperature=0.0)
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0, n=3)
    assert [c.text for c in r.choices] == [expected] * 3
    chat = client.chat.completions.create(model="x", messages=CHAT, max_tokens=N, temperature=0, n=3)
    assert len({c.message.content for c in chat.choices}) == 1 and len(chat.choices) == 3


@pytest.mark.parametrize("seed", [None, 99])  # greedy, and seeded sampling
def test_completion_logprobs_are_log_softmax_of_the_logits(server_url, llm, seed):
    ids = llm.tokenize(PROMPT)
    params = SamplingParams(temperature=0.0) if seed is None else SamplingParams(**SAMPLED, seed=seed)
    generated = off_main_thread(reference_ids, llm, ids, params)
    lp = reference_logprobs(llm, ids, generated)
    client = openai_client(server_url)
    kwargs = dict(
        model="x",
        prompt=PROMPT,
        max_tokens=N,
        logprobs=2,
        extra_body={"ignore_eos": True},
        **({"temperature": 0} if seed is None else SAMPLED | {"seed": seed}),
    )
    r = client.completions.create(**kwargs).choices[0]
    got = r.logprobs
    assert got.tokens == [token_text(llm, t) for t in generated]
    assert torch.allclose(torch.tensor(got.token_logprobs), lp[range(N), generated], atol=1e-4)
    for i, top in enumerate(got.top_logprobs):
        values, best = torch.topk(lp[i], 2)
        expected = {token_text(llm, int(t)): float(v) for t, v in zip(best, values)}
        expected.setdefault(token_text(llm, generated[i]), float(lp[i, generated[i]]))  # the sampled one too
        assert top.keys() == expected.keys()
        assert all(abs(top[k] - expected[k]) < 1e-4 for k in expected)
    # text_offset: where each token's text starts in the completion
    assert got.text_offset == [len("".join(got.tokens[:i])) for i in range(N)]
    assert "".join(got.tokens) == r.text

    stream = list(client.completions.create(stream=True, **kwargs))
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == got.tokens
    # (bits may differ: this request reuses the cached prefix, so its last prompt row ran alone)
    assert torch.allclose(
        torch.tensor(sum((p.token_logprobs for p in parts), [])), lp[range(N), generated], atol=1e-4
    )
    assert sum((p.text_offset for p in parts), []) == got.text_offset
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.text


def test_echo_with_logprobs_scores_the_prompt(server_url, llm):
    """echo + logprobs (how evaluation harnesses score text, max_tokens 0): every prompt token gets its
    log-probability under the prompt's own forward (the first gets null), then the generated tokens theirs."""
    ids = llm.tokenize(PROMPT)
    full = torch.log_softmax(off_main_thread(llm.logits, ids).float(), -1)
    client = openai_client(server_url)
    for max_tokens in (0, 3):
        r = client.completions.create(
            model="x",
            prompt=PROMPT,
            max_tokens=max_tokens,
            logprobs=2,
            echo=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0]
        got = r.logprobs
        assert r.text.startswith(PROMPT) and len(got.tokens) == len(ids) + max_tokens
        assert got.tokens[: len(ids)] == [token_text(llm, t) for t in ids]
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        want = full[range(len(ids) - 1), ids[1:]]
        assert torch.allclose(torch.tensor(got.token_logprobs[1 : len(ids)]), want, atol=1e-4)
        for j in range(1, len(ids)):
            values, best = torch.topk(full[j - 1], 2)
            assert {token_text(llm, int(t)) for t in best} <= got.top_logprobs[j].keys()
        assert got.text_offset == [len("".join(got.tokens[:i])) for i in range(len(got.tokens))]
    stream = list(
        client.completions.create(
            model="x",
            prompt=PROMPT,
            max_tokens=3,
            logprobs=2,
            echo=True,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == got.tokens


def test_chat_logprobs_and_top_logprobs(server_url, llm):
    ids = llm.chat_prompt_ids(CHAT)
    generated = off_main_thread(reference_ids, llm, ids, SamplingParams(temperature=0.0))
    lp = reference_logprobs(llm, ids, generated)
    client = openai_client(server_url)
    kwargs = dict(
        model="x",
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kwargs).choices[0]
    content = r.logprobs.content
    assert [e.token for e in content] == [token_text(llm, t) for t in generated]
    assert [bytes(e.bytes) for e in content] == [llm.tokenizer.token_bytes(t) for t in generated]
    assert torch.allclose(torch.tensor([e.logprob for e in content]), lp[range(N), generated], atol=1e-4)
    for i, e in enumerate(content):
        values, best = torch.topk(lp[i], 2)
        assert [t.token for t in e.top_logprobs] == [token_text(llm, int(t)) for t in best]
        assert torch.allclose(torch.tensor([t.logprob for t in e.top_logprobs]), values, atol=1e-4)
        if generated[i] in best.tolist():  # greedy: the chosen token is the most likely one
            assert e.top_logprobs[0].token == e.token
    assert "".join(e.token for e in content) == r.message.content

    stream = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [e for c in stream for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert torch.allclose(torch.tensor([e.logprob for e in streamed]), lp[range(N), generated], atol=1e-4)

    plain = client.chat.completions.create(model="x", messages=CHAT, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="x", messages=CHAT, max_tokens=2).choices[0].logprobs is None


def test_logprobs_with_n_choices(server_url, llm):
    r = openai_client(server_url).completions.create(
        model="x", prompt=PROMPT, max_tokens=4, n=2, seed=5, logprobs=0, extra_body={"ignore_eos": True}
    )
    ids = llm.tokenize(PROMPT)
    for i, c in enumerate(r.choices):
        generated = off_main_thread(reference_ids, llm, ids, SamplingParams(1.0, top_p=1.0, seed=5 + i), 4)
        assert c.logprobs.tokens == [token_text(llm, t) for t in generated]
        assert [list(t) for t in c.logprobs.top_logprobs] == [[t] for t in c.logprobs.tokens]


def test_n_choices_are_queued_all_or_none(llm):
    """A request's n choices start together when the slots are free, else take one queue place together (a
    request is one place, whatever its n: tests/server/test_scheduler.py), or are refused together."""
    sched = Scheduler([Engine(llm.loaded.model, llm.tokenizer, llm.ctx_size) for _ in range(2)], max_queue=0)
    req = GenerationRequest(llm.tokenize(PROMPT), 2)

    async def main():
        with pytest.raises(QueueFull):
            sched.submit_all(
                [req] * 3
            )  # 2 slots, no queue place: 3 choices cannot all start, so none is queued
        assert sched.queue_depth == 0
        jobs = sched.submit_all([req] * 2)
        results = []
        for job in jobs:
            results.append([c async for c in job])
        return results

    try:
        results = asyncio.run(main())
    finally:
        sched.close()
    assert len({"".join(c.text for c in chunks) for chunks in results}) == 1


def test_a_streaming_client_that_hangs_up_frees_every_choice_slot(llm):
    slow = SlowModel(llm.loaded.model, 0.05)  # one forward per step for the three choices
    engines = [Engine(slow, llm.tokenizer, llm.ctx_size) for _ in range(3)]
    scheduler = Scheduler(engines)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 3, "stream": True}
    with running(create_app(llm, scheduler=scheduler)) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert [line for line, _ in zip(lines, range(8)) if line.startswith("data: ")]
        deadline = time.monotonic() + 5
        while (scheduler.busy or scheduler.cancelled < 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.busy == 0 and scheduler.cancelled == 3
