"""Tool calling: tools rendered into the prompt (the model's template or the documented fallback), calls
parsed into OpenAI `tool_calls` (streamed as deltas too), `tool` messages in the history, and with
`required` or a named function a grammar-constrained call that always parses; through the real server
and the official `openai` client."""

from __future__ import annotations

import json

import httpx
import pytest

from hotcold.chat import TOOLS_PROMPT, render_chat
from hotcold.runtime.generation import GenerationStats
from hotcold.server import tools
from hotcold.server.protocol import ApiError
from tests.server.conftest import openai_client, running
from tests.test_structured import check

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def short(name: str, props: dict) -> dict:
    """A tool small enough for the tiny server model's 256-token context."""
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


WX = short("wx", {"c": {"type": "string", "maxLength": 5}, "u": {"enum": ["c", "f"]}})
TZ = short("tz", {"z": {"type": "integer", "minimum": -12, "maximum": 12}})
Q = [{"role": "user", "content": "Paris?"}]


@pytest.fixture(scope="module")
def server_url(tiny_sparse_gguf):
    """The tiny model with room for the tools prompt (its own 256 tokens are too few for its 512-token
    vocabulary's long encodings)."""
    import hotcold
    from hotcold.server.app import create_app

    with running(create_app(hotcold.load(tiny_sparse_gguf, device="cpu", ctx_size=1024), parallel=2)) as url:
        yield url


def test_parse_tagged_bare_and_plain():
    content, calls = tools.parse('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    two = tools.parse(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert [c.name for c in two[1]] == ["f", "g"] and len({c.id for c in two[1]}) == 2
    assert tools.parse('{"name": "f", "parameters": {"x": "y"}}')[1][0].arguments == '{"x": "y"}'
    assert tools.parse("just text") == ("just text", [])
    assert tools.parse("<tool_call>not json</tool_call>")[1] == []


def test_choice_rules():
    assert tools.choice(None, None) == (None, None)
    assert tools.choice([WEATHER], "none") == (None, None)
    assert tools.choice([WEATHER], "auto") == ([WEATHER], None)
    offered, grammar = tools.choice([WEATHER, TIME], "required")
    assert offered == [WEATHER, TIME] and "get_time" in grammar and "get_weather" in grammar
    _, grammar = tools.choice([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in grammar and "get_weather" not in grammar
    for bad in [{"type": "function", "function": {"name": "nope"}}, "sometimes"]:
        with pytest.raises(ApiError) as err:
            tools.choice([WEATHER], bad)
        assert err.value.status == 400 and err.value.param == "tool_choice"
    with pytest.raises(ApiError):
        tools.choice([{"type": "retrieval"}], "auto")


def test_fallback_template_renders_tools_calls_and_results(llm):
    assert llm.tokenizer.chat_template is None or "tools" not in llm.tokenizer.chat_template
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_chat(llm.tokenizer, history, tools=[WEATHER])
    assert TOOLS_PROMPT.split("{tools}")[0] in text and '"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text


def test_required_call_always_parses(server_url):
    client = openai_client(server_url)
    for seed in range(3):
        r = client.chat.completions.create(
            model="x",
            messages=Q,
            tools=[WX, TZ],
            tool_choice="required",
            max_tokens=80,
            seed=seed,
            temperature=1.0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        fn = {"wx": WX, "tz": TZ}[call.function.name]["function"]
        check(json.loads(call.function.arguments), fn["parameters"])
        assert call.id.startswith("call_") and call.type == "function"


def test_streamed_named_call_reassembles(server_url):
    client = openai_client(server_url)
    stream = client.chat.completions.create(
        model="x",
        messages=Q,
        tools=[WX, TZ],
        max_tokens=80,
        seed=4,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "wx"}},
    )
    name, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                name += (d.function.name or "") if d.function else ""
                args += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert name == "wx" and finish == "tool_calls"
    check(json.loads(args), WX["function"]["parameters"])


def test_streamed_auto_sends_text_as_it_comes(server_url):
    """With tools offered but no call made, the streamed content equals the whole answer's, in pieces."""
    client = openai_client(server_url)
    kwargs = dict(model="x", messages=Q, tools=[WX], max_tokens=20, seed=2, temperature=1.0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices and c.choices[0].delta.content
    ]
    if whole.tool_calls is None:
        assert "".join(pieces) == whole.content and len(pieces) > 1


def test_format_holds_back_calls_and_their_starts():
    fmt = tools.ToolChatFormat("m")
    fmt.start(1)
    sent = [
        fmt.chunk(0, t, None)
        for t in ["Sure", ", <tool", '_call>{"name": "f", "arguments": {}}</tool_call> bye']
    ]
    assert [s and s["choices"][0]["delta"].get("content") for s in sent] == ["Sure", ", ", None]
    end = fmt.end(0, "stop", GenerationStats())
    assert end[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert end[-1]["choices"][0]["finish_reason"] == "tool_calls"
    fmt.start(1)
    assert fmt.chunk(0, '{"name": "f",', None) is None  # a possible bare call waits


def test_tool_messages_in_history_and_auto(server_url):
    client = openai_client(server_url)
    history = Q + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "wx", "arguments": '{"c": "Paris", "u": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ]
    r = client.chat.completions.create(model="x", messages=history, tools=[WX], max_tokens=10, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(
        model="x", messages=history, tools=[WX], tool_choice="none", max_tokens=5
    )
    assert r.choices[0].message.tool_calls is None


def test_bad_tool_requests_are_400(server_url):
    base = {"messages": Q, "max_tokens": 4}
    for extra, param in [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": 5}]}, "tools.0"),
        # issue #47 D11: names as OpenAI requires them (^[a-zA-Z0-9_-]{1,64}$); these were accepted
        ({"tools": [WX, short(7, {})]}, "tools.1.function.name"),
        ({"tools": [short(["f"], {})]}, "tools.0.function.name"),
        ({"tools": [short("f</tool_call>", {})]}, "tools.0.function.name"),
        ({"tools": [short("f" * 65, {})]}, "tools.0.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ]:
        r = httpx.post(f"{server_url}/v1/chat/completions", json=base | extra, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_that_knows_tools_gets_them(llm):
    """A Qwen-style template renders tools and calls itself (no fallback text)."""
    import copy

    tok = copy.copy(llm.tokenizer)
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}{% endfor %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render_chat(tok, history, tools=[WEATHER, TIME])
    assert text.startswith("TOOLS:get_weather;get_time;") and "assistant:CALL get_weather" in text
    assert "tool:sunny" in text and "<tool_call>" not in text
