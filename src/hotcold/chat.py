"""Chat prompts: the model's own `tokenizer.chat_template` (jinja2, as transformers renders it), else a
plain built-in template.

Tools (OpenAI's function definitions): a template that mentions `tools` gets them (and the history's
`tool_calls` and `tool` messages) as transformers passes them. Any other template gets the documented
fallback: a system message (`TOOLS_PROMPT`) listing the functions and asking for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen format), the history's
calls written the same way in the assistant's turns, and `tool` results as user turns
`<tool_response>...</tool_response>`. hotcold.server.tools parses calls in that format."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotcold.tokenizer import Tokenizer

# Used when a model has no template: simple role-prefixed turns ending with the assistant's cue.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")
TOOLS_PROMPT = (
    "You may call functions. The functions, as JSON schemas:\n{tools}\n"
    'To call one, answer with <tool_call>{{"name": <function name>, "arguments": <arguments object>}}'
    "</tool_call> and nothing else."
)


def validate_messages(messages: Sequence[dict]) -> None:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role {m['role']!r} is not one of {ROLES}")
        if not isinstance(m["content"], str) and not (m["content"] is None and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string")


def call_text(call: dict) -> str:
    """One OpenAI tool call ({"function": {"name", "arguments"}}) in the fallback's format."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>"


def _fallback_tools(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """Messages with tools, calls and results written as text (the module docstring's format)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{m['content']}</tool_response>"})
        elif m.get("tool_calls"):
            calls = "".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] or "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t)) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part for training masks in transformers;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
) -> str:
    validate_messages(messages)
    template = tokenizer.chat_template or FALLBACK_TEMPLATE
    native = "tools" in template and "tool_calls" in template  # the template renders tools itself
    extra: dict = {}
    if native:
        if tools:
            extra["tools"] = list(tools)
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        messages = [{k: m[k] for k in keep if k in m} for m in messages]
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = _fallback_tools(messages, tools)
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    # loop controls ({% break %}, {% continue %}) and {% generation %} blocks, as transformers' renderer takes them
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
    )

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # used by many HF templates
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template does not parse: {exc}") from exc
    # the token texts ("<s>"): encode() turns them back into the special tokens
    bos = tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **extra,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        raise ValueError(f"the model's chat template failed: {exc}") from exc
