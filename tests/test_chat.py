"""Chat templates: the model's own (jinja2, as transformers renders them) or the built-in fallback."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hotcold import chat
from hotcold.chat import ChatInputError, ChatTemplateError, render_chat


class FakeTokenizer:
    bos_id, eos_id = 1, 2

    def __init__(self, template=None):
        self.chat_template = template

    def piece(self, token_id):
        return {1: "<s>", 2: "</s>"}[token_id]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_model_template_with_special_tokens_and_strftime():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ strftime_now('%Y') }}"
    out = render_chat(FakeTokenizer(template), MESSAGES)
    assert out.startswith("<s>[system]Be brief.[user]Hi") and out[-4:].isdigit()


def test_fallback_template_ends_with_assistant_cue():
    out = render_chat(FakeTokenizer(), MESSAGES)
    assert out == "Be brief.\n\nUser: Hi\nAssistant:"


@pytest.mark.parametrize(
    "template, messages, match",
    [
        ("{{ raise_exception('no system role') }}", MESSAGES, "no system role"),
        ("{% for %}", MESSAGES, "does not parse"),
        (None, [{"role": "robot", "content": "x"}], "role"),
        (None, [], "non-empty"),
        (
            "{{ messages[0].content + 1 }}",
            MESSAGES,
            r"chat template \(tokenizer.chat_template\) failed: TypeError",
        ),
    ],
)
def test_errors_are_value_errors(template, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(FakeTokenizer(template), messages)


def test_loop_controls_and_generation_blocks_render():
    """{% break %} / {% continue %} (Command R, Kimi) and {% generation %} blocks (LFM2, Laguna), as transformers
    renders them: the generation block keeps its body."""
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}U:{{ m.content }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "user", "content": "never"}]  # fmt: skip
    assert render_chat(FakeTokenizer(template), msgs) == "U:u1A:a1U:u2"


UPSTREAM_TEMPLATES = (
    Path(os.environ.get("HOTCOLD_LLAMA_CPP", Path.home() / ".cache" / "hotcold-anchors" / "llama.cpp"))
    / "models"
    / "templates"
)
# templates whose own rules refuse this conversation: Gemma 2 has no system role; FireFunction wants `functions`
REFUSING = {"google-gemma-2-2b-it.jinja", "fireworks-ai-llama-3-firefunction-v2.jinja"}


def test_upstream_templates_render_a_conversation():
    """Every chat template upstream llama.cpp keeps (models/templates/*.jinja, from the source the anchors script
    unpacks) renders a system + user + assistant + user conversation with the last message in it, or refuses it
    by its own rule with a ValueError naming it."""
    if not UPSTREAM_TEMPLATES.is_dir():
        pytest.skip(
            f"no {UPSTREAM_TEMPLATES} (../shared/anchors/build-llama-cpp.sh unpacks it; HOTCOLD_LLAMA_CPP)"
        )
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "How are you today?"}]  # fmt: skip
    failed = {}
    for path in sorted(UPSTREAM_TEMPLATES.glob("*.jinja")):
        try:
            if "How are you today?" not in render_chat(FakeTokenizer(path.read_text()), msgs):
                failed[path.name] = "the last message is missing"
        except ValueError as exc:
            if path.name not in REFUSING:
                failed[path.name] = str(exc)
    assert len(list(UPSTREAM_TEMPLATES.glob("*.jinja"))) > 50
    assert not failed, failed


TOOL_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": 5}]},
]


@pytest.mark.parametrize(
    "calls, field",
    [
        (
            [{"id": "c1", "type": "function", "function": 5}],
            r"messages\[1\]\.tool_calls\[0\]\.function must be an object",
        ),
        (
            [{"function": {"name": 7, "arguments": "{}"}}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.name must be a string",
        ),
        (
            [{"function": {"name": "f", "arguments": [1]}}],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments",
        ),
        ([5], r"messages\[1\]\.tool_calls\[0\] must be an object"),
        ("call", r"messages\[1\]\.tool_calls must be a list"),
    ],
)
def test_malformed_tool_calls_name_the_field(calls, field):
    """Issue #47 D2: a call whose `function` is not an object was an AttributeError (a 500 in the server)."""
    history = [TOOL_HISTORY[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    for template in (
        None,
        "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}",
    ):  # fallback, native
        with pytest.raises(ChatInputError, match=field) as info:
            render_chat(FakeTokenizer(template), history)
        assert info.value.path[:3] == ("messages", 1, "tool_calls")


@pytest.mark.parametrize("name", [5, ["f"], "", "a" * 65, "f</tool_call>", "get weather", "f.g"])
def test_tool_names_follow_openais_rule(name):
    """Issue #47 D11: OpenAI's ^[a-zA-Z0-9_-]{1,64}$; a name with "</tool_call>" would end the call early."""
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    with pytest.raises(ChatInputError, match=r"tools\[0\]\.function\.name must be 1 to 64 letters") as info:
        render_chat(FakeTokenizer(), MESSAGES, tools=[tool])
    assert info.value.path == ("tools", 0, "function", "name")
    ok = {"type": "function", "function": {"name": "get_weather-2", "parameters": {"type": "object"}}}
    assert "get_weather-2" in render_chat(FakeTokenizer(), MESSAGES, tools=[ok])


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ 2.0 ** 10000 }}", "OverflowError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "RecursionError"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
        ("{% include 'other.jinja' %}", "TypeError"),
    ],
)
def test_any_template_failure_is_a_chat_template_error_naming_it(template, error):
    """Issue #47 D3: these were ZeroDivisionError, OverflowError... (500s in the server), not ValueErrors."""
    with pytest.raises(
        ChatTemplateError, match=rf"^the model's chat template \(tokenizer.chat_template\) failed: {error}"
    ):
        render_chat(FakeTokenizer(template), MESSAGES)
    with pytest.raises(ChatTemplateError, match=rf"^m.gguf's template failed: {error}"):
        render_chat(FakeTokenizer(template), MESSAGES, template_name="m.gguf's template")


NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{{ b }}{% endfor %}{% endfor %}"
SILENT_LOOPS = (
    "{% set x %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endset %}"
)


@pytest.mark.parametrize(
    "template, bound",
    [
        (SILENT_LOOPS, "rendering took more than 0.3 s of CPU"),  # 10**10 steps: it ran on for ever
        (NESTED_LOOPS, "the prompt passed 100000 characters"),
        ("{{ 'x' * 10**10 }}", r"\* would make 10000000000 characters"),  # a 10 GB string
        ("{{ 10 ** (10 ** 10) }}", "an integer power of more than"),  # ran on for ever
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "~ would make",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            r"\+ would make",
        ),
        ("{{ 'x'|center(10**10) }}", "center would make"),
        ("{{ 'x'.ljust(10000000000) }}", "ljust would make"),
        ("{{ '%*d' % (10000000000, 1) }}", "a format with a width"),
        ("{{ '{:>10000000000}'.format(1) }}", "a format with a width"),
        ("{{ [1]|batch(10000000000, 0)|list }}", "batch would make"),
        ("{{ ('x' * 90000)|sort|list }}", "sort over 90000 items"),
    ],
)
def test_templates_are_bounded_in_time_and_size(monkeypatch, template, bound):
    """Issue #47 D3: a template that would run on, or make a huge prompt or value, is stopped with an error
    naming the template and the bound, within a few seconds."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    monkeypatch.setattr(chat, "MAX_CHARS", 100_000)
    start = time.monotonic()
    with pytest.raises(
        ChatTemplateError,
        match=rf"^the model's chat template \(tokenizer.chat_template\) was stopped: {bound}",
    ):
        render_chat(FakeTokenizer(template), MESSAGES)
    assert time.monotonic() - start < 10


def test_bounds_leave_ordinary_templates_alone():
    """Loops of every kind, macros, filters and tests under the bounds render as jinja2 renders them, and
    tojson is transformers' (keys in order, no HTML escapes)."""
    template = (
        "{% macro turn(m) %}<{{ m.role|upper }}>{{ m.content ~ '!' }}{% endmacro %}"
        "{% for m in messages if m.role != 'tool' %}{{ turn(m) }}{{ loop.index }}/{{ loop.length }}{% endfor %}"
        "{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}={{ v }};{% else %}none{% endfor %}"
        "{{ messages|map(attribute='role')|join(',') }} {{ (messages|selectattr('role', 'equalto', 'user')|list)|length }}"
        "{{ {'z': '<a&b>', 'y': [1, 2]}|tojson }}{{ '%s-%d'|format('x', 3) }}{{ '{}+{}'.format(1, 2) }}"
    )
    out = render_chat(FakeTokenizer(template), MESSAGES)
    assert out == ('<SYSTEM>Be brief.!1/2<USER>Hi!2/2b=1;a=2;system,user 1{"z": "<a&b>", "y": [1, 2]}x-31+2')


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# as OpenAI clients send it: the call's arguments as JSON text, content null; ids of 9 letters and digits (Mistral's
# templates refuse others)
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "content": "18 degrees"},
]


def test_upstream_tool_calling_templates_render_a_tool_call_and_its_result():
    """Issue #44: every upstream template that renders tools also renders a conversation holding a call (arguments
    as JSON text, as the server passes them) and its result: ~20 of them (Qwen3, GLM, MiniMax, DeepSeek V3.2...)
    iterate `arguments.items()` and failed, others wrote the arguments JSON-encoded twice. As llama.cpp does, the
    arguments reach those templates as an object, and reach templates that write them as text as the text."""
    if not UPSTREAM_TEMPLATES.is_dir():
        pytest.skip(
            f"no {UPSTREAM_TEMPLATES} (../shared/anchors/build-llama-cpp.sh unpacks it; HOTCOLD_LLAMA_CPP)"
        )
    failed, tool_templates = {}, 0
    for path in sorted(UPSTREAM_TEMPLATES.glob("*.jinja")):
        tokenizer = FakeTokenizer(path.read_text())
        try:
            if "get_weather" not in render_chat(tokenizer, TOOL_CONVERSATION[:2], tools=[WEATHER]):
                continue
        except ValueError:
            continue  # it does not render tools at all
        tool_templates += 1
        try:
            out = render_chat(tokenizer, TOOL_CONVERSATION, tools=[WEATHER])
        except ValueError as exc:
            failed[path.name] = str(exc)
            continue
        if "Paris" not in out or "18 degrees" not in out:
            failed[path.name] = "the call or its result is missing"
        elif '\\"city\\"' in out or "{'city': 'Paris'}" in out:
            failed[path.name] = "the arguments are written JSON-encoded twice or as a Python dict"
    assert tool_templates > 40
    assert not failed, failed


OBJECT_ARGS = (  # as Qwen3-Coder and GLM write a call: one line per argument
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}){% endfor %}{% endfor %}{{ tools|length }}"
)
TEXT_ARGS = (  # as functionary v3.2 writes a call: the arguments' text as it is
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
    "{{ c.function.arguments }}{% endfor %}{% endfor %}{{ tools|length }}"
)


def test_tool_call_arguments_are_objects_for_templates_that_read_them_as_objects():
    """Issue #44: as llama.cpp decides (common/jinja/caps.cpp), a template that uses an argument's value from an
    object gets objects; a template that writes the arguments as they are gets the client's text (not a dict's
    Python repr)."""
    text = TOOL_CONVERSATION[2]["tool_calls"][0]["function"]["arguments"]
    assert chat.reads_object_arguments(OBJECT_ARGS) and not chat.reads_object_arguments(TEXT_ARGS)
    assert (
        render_chat(FakeTokenizer(OBJECT_ARGS), TOOL_CONVERSATION, tools=[WEATHER])
        == "get_weather(city=Paris;)1"
    )
    assert render_chat(FakeTokenizer(TEXT_ARGS), TOOL_CONVERSATION, tools=[WEATHER]) == f"get_weather{text}1"
    assert (
        TOOL_CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == text
    )  # the caller's data unchanged
    broken = [*TOOL_CONVERSATION[:2], {**TOOL_CONVERSATION[2], "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]  # fmt: skip
    with pytest.raises(
        ChatInputError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments must be JSON"
    ):
        render_chat(FakeTokenizer(OBJECT_ARGS), broken, tools=[WEATHER])
    assert render_chat(FakeTokenizer(TEXT_ARGS), broken, tools=[WEATHER]) == "get_weather{city1"


def test_templates_may_append_to_lists_but_not_change_the_callers_data():
    """Kimi K2 queues tool call ids with `list.append` / `list.pop` (llama.cpp's Jinja has both); jinja2's
    immutable sandbox refused them. The template works on a copy of the conversation."""
    template = (
        "{% set ns = namespace(ids=[]) %}{% for m in messages %}{% set _ = ns.ids.append(m.role) %}{% endfor %}"
        "{{ ns.ids.pop(0) }}{{ ns.ids|join(',') }}{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}"
    )
    msgs = [dict(m) for m in MESSAGES]
    assert render_chat(FakeTokenizer(template), msgs) == "systemuser3"
    assert msgs == MESSAGES
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat(FakeTokenizer("{% set _ = messages[0].update({'a': 1}) %}"), MESSAGES)
