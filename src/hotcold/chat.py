"""Chat prompts: the model's own `tokenizer.chat_template` (jinja2, as transformers renders it), else a
plain built-in template.

Tools (OpenAI's function definitions): a template that mentions `tools` gets them (and the history's
`tool_calls` and `tool` messages) as transformers passes them. Any other template gets the documented
fallback: a system message (`TOOLS_PROMPT`) listing the functions and asking for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen format), the history's
calls written the same way in the assistant's turns, and `tool` results as user turns
`<tool_response>...</tool_response>`. hotcold.server.tools parses calls in that format. Function names
follow OpenAI's rule (`TOOL_NAME`), so a name cannot carry a `</tool_call>` into the prompt.

Templates come from model files, so they render bounded (hotcold.chat_sandbox): for at most `RENDER_SECONDS`
of CPU, making no value and no prompt over `MAX_CHARS` characters. Any failure of a template (its own
`raise_exception` included) is a `ChatTemplateError` naming the template; a malformed message or tool is a
`ChatInputError` naming the field.

Tool calls reach a template as llama.cpp (common/chat.cpp) passes them: content null becomes "", and a
call's `arguments` (JSON text in OpenAI's protocol) is parsed into an object for a template that reads the
arguments as an object (`arguments.items()`, `arguments | tojson`, `arguments.city`: Qwen3, GLM, MiniMax...).
Like llama.cpp (common/jinja/caps.cpp), hotcold finds those templates by rendering a probe conversation whose
call has object arguments and seeing whether the template used the argument's value; templates that write
the arguments as text keep the text."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

from hotcold.chat_sandbox import ChatTemplateError, Watched, render_template, render_watched
from hotcold.tokenizer.vocab import Tokenizer

__all__ = ["ChatInputError", "ChatTemplateError", "render_chat"]

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
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names

RENDER_SECONDS = 2.0  # CPU seconds one rendering may take (real templates take milliseconds)
MAX_CHARS = 1 << 22  # the rendered prompt, and any one string or list made on the way


class ChatInputError(ValueError):
    """A malformed message or tool; `path` names the field, e.g. ("messages", 0, "tool_calls", 0, "function")."""

    def __init__(self, path: tuple, problem: str):
        self.path = path
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])
        super().__init__(f"{path[0]}{where} {problem}")


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_messages(messages: Sequence[dict]) -> None:
    if not messages:
        raise ChatInputError(("messages",), "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatInputError(("messages", i), "must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatInputError(("messages", i, "role"), f"{_short(m['role'])} is not one of {ROLES}")
        calls = m.get("tool_calls")
        if calls is not None:
            _validate_calls(calls, ("messages", i, "tool_calls"))
        if not isinstance(m["content"], str) and not (m["content"] is None and calls):
            raise ChatInputError(("messages", i, "content"), "must be a string")


def _validate_calls(calls, path: tuple) -> None:
    """An assistant's `tool_calls`: [{"function": {"name": str, "arguments": JSON text or object}}, ...]
    (a call may also be the bare {"name", "arguments"})."""
    if not isinstance(calls, list | tuple):
        raise ChatInputError(path, f"must be a list of calls, got {_short(calls)}")
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ChatInputError((*path, j), f"must be an object, got {_short(call)}")
        where = (*path, j, "function") if "function" in call else (*path, j)
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise ChatInputError(where, f"must be an object with 'name' and 'arguments', got {_short(fn)}")
        if not isinstance(fn.get("name"), str):
            raise ChatInputError((*where, "name"), f"must be a string, got {_short(fn.get('name'))}")
        if not isinstance(fn.get("arguments", {}), str | dict):
            raise ChatInputError(
                (*where, "arguments"), f"must be JSON text or an object, got {_short(fn['arguments'])}"
            )


def check_tool_name(name, path: tuple) -> str:
    """`name` when it follows OpenAI's rule for function names, else ChatInputError naming `path`."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ChatInputError(
            path,
            "must be 1 to 64 letters, digits, '_' or '-' (^[a-zA-Z0-9_-]{1,64}$, as OpenAI requires), "
            f"got {_short(name)}",
        )
    return name


def validate_tools(tools: Sequence[dict]) -> None:
    """OpenAI `tools` ({"type": "function", "function": {"name", ...}}, or the bare function)."""
    for i, t in enumerate(tools):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise ChatInputError(("tools", i), "must be {'type': 'function', 'function': {'name': ...}}")
        where = ("tools", i, "function") if "function" in t else ("tools", i)
        check_tool_name(fn.get("name"), (*where, "name"))


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


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
    template_name: str | None = None,
    builtin: bool = False,
) -> str:
    """The prompt of a conversation. `template_name` names the template in errors (default: "the model's
    chat template (tokenizer.chat_template)", or "the built-in chat template" when the model has none).
    builtin: the built-in plain-text template even where the model has its own (a fallback once it failed)."""
    validate_messages(messages)
    if tools:
        validate_tools(tools)
    own = tokenizer.chat_template if not builtin else None
    template = own or FALLBACK_TEMPLATE
    if template_name is None:
        template_name = (
            "the model's chat template (tokenizer.chat_template)" if own else "the built-in chat template"
        )
    native = "tools" in template and "tool_calls" in template  # the template renders tools itself
    extra: dict = {}
    if native:
        if tools:
            extra["tools"] = list(tools)
        objects = reads_object_arguments(template)
        messages = [_native_message(m, i, objects=objects) for i, m in enumerate(messages)]
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = _fallback_tools(messages, tools)
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    # the token texts ("<s>"): encode() turns them back into the special tokens
    bos = tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return render_template(
        template,
        template_name,
        seconds=RENDER_SECONDS,
        max_chars=MAX_CHARS,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
        **extra,
    )


def _native_message(m: dict, i: int, *, objects: bool) -> dict:
    """Message `i` as llama.cpp hands it to a template that renders tools: content "" for null, and with
    `objects` each call's arguments parsed from JSON text into an object."""
    out = {k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name") if k in m}
    if out["content"] is None:
        out["content"] = ""
    if objects and m.get("tool_calls"):
        out["tool_calls"] = [
            _object_arguments(c, ("messages", i, "tool_calls", j)) for j, c in enumerate(m["tool_calls"])
        ]
    return out


def _object_arguments(call: dict, path: tuple) -> dict:
    """`call` with its arguments parsed from JSON text (an error naming the field when they do not parse, as
    llama.cpp's func_args_not_string refuses them)."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    if not isinstance(args, str):
        return call
    where = (*path, "function", "arguments") if "function" in call else (*path, "arguments")
    try:
        fn = {**fn, "arguments": json.loads(args)}
    except ValueError as exc:
        raise ChatInputError(
            where, f"must be JSON text (the chat template reads it as an object): {exc}"
        ) from exc
    return {**call, "function": fn} if "function" in call else fn


# llama.cpp's probe (common/jinja/caps.cpp, "single tool with object arguments"): a call with object arguments,
# its result, and a last user turn
_PROBE_TOOLS = [
    {
        "name": "tool",
        "type": "function",
        "function": {
            "name": "tool1",
            "description": "Tool description",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "Arg description"}},
                "required": ["arg"],
            },
        },
    }
]


@functools.lru_cache(maxsize=16)
def reads_object_arguments(template: str) -> bool:
    """Whether `template` reads a tool call's arguments as an object: it renders llama.cpp's probe
    conversation and uses the value of the argument (llama.cpp's supports_object_arguments)."""
    call = {"name": "tool1", "arguments": {"arg": Watched("value")}}
    messages = [
        {"role": "user", "content": "User message"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call00001", "type": "function", "function": call}],
        },
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]
    try:
        _, used = render_watched(
            template,
            "the probe",
            seconds=RENDER_SECONDS,
            max_chars=MAX_CHARS,
            messages=messages,
            tools=_PROBE_TOOLS,
            bos_token="",
            eos_token="",
            add_generation_prompt=True,
        )
    except ChatTemplateError:
        return False  # llama.cpp: "nothing can be inferred"
    return used
