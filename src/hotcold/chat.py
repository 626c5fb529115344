"""Chat prompts: the model's own `tokenizer.chat_template` (jinja2, as transformers renders it), else a
plain built-in template.

Tools (OpenAI's function definitions): a template that mentions `tools` gets them (and the history's
`tool_calls` and `tool` messages) as transformers passes them. Any other template gets the documented
fallback: a system message (`TOOLS_PROMPT`) listing the functions and asking for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen format), the history's
calls written the same way in the assistant's turns, and `tool` results as user turns
`<tool_response>...</tool_response>`. hotcold.server.tools parses calls in that format. Function names
follow OpenAI's rule (`TOOL_NAME`), so a name cannot carry a `</tool_call>` into the prompt.

Templates come from model files, so they render bounded: in jinja2's ImmutableSandboxedEnvironment (as
transformers renders them, with its `tojson`, `raise_exception` and `strftime_now`), for at most
`RENDER_SECONDS` of CPU, making no value and no prompt over `MAX_CHARS` characters and at most `MAX_MADE`
characters in all. Every `for` loop, call, filter, `~` and output passes a check (the template's syntax
tree is rewritten to route them through `_Bounds`); `+ * ** %` go through the sandbox's operator hook,
which refuses a string, list or integer that would pass a bound before making it. Any failure of a
template (its own `raise_exception` included) is a `ChatTemplateError` naming the template; a malformed
message or tool is a `ChatInputError` naming the field."""

from __future__ import annotations

import functools
import json
import re
import time
import types
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

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
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names

RENDER_SECONDS = 2.0  # CPU seconds one rendering may take (real templates take milliseconds)
MAX_CHARS = 1 << 22  # the rendered prompt, and any one string or list made on the way
MAX_MADE = 1 << 26  # characters (and list items) made in all while rendering: output, buffers, values
MAX_INT_BITS = 1 << 16  # integers made by * and ** (10 ** 10 ** 10 would never finish)
MAX_ITEMS = 1 << 16  # the input of a filter that runs Python per item (sort, map, select, wordwrap...)


class ChatInputError(ValueError):
    """A malformed message or tool; `path` names the field, e.g. ("messages", 0, "tool_calls", 0, "function")."""

    def __init__(self, path: tuple, problem: str):
        self.path = path
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])
        super().__init__(f"{path[0]}{where} {problem}")


class ChatTemplateError(ValueError):
    """A chat template failed, refused the conversation, or passed a bound; the message names the template."""


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
) -> str:
    """The prompt of a conversation. `template_name` names the template in errors (default: "the model's
    chat template (tokenizer.chat_template)", or "the built-in chat template" when the model has none)."""
    validate_messages(messages)
    if tools:
        validate_tools(tools)
    template = tokenizer.chat_template or FALLBACK_TEMPLATE
    if template_name is None:
        own = "the model's chat template (tokenizer.chat_template)"
        template_name = own if tokenizer.chat_template else "the built-in chat template"
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
    # the token texts ("<s>"): encode() turns them back into the special tokens
    bos = tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return render_template(
        template,
        template_name,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
        **extra,
    )


# ------------------------------------------------------------------------------------------------
# The bounded sandbox
# ------------------------------------------------------------------------------------------------


class _Limit(Exception):
    """A bound reached while rendering."""


class _Refusal(Exception):
    """The template's own raise_exception(message)."""


def render_template(source: str, name: str, **context) -> str:
    """`source` rendered with `context` in the bounded sandbox; ChatTemplateError naming `name` otherwise."""
    bounds = _Bounds()
    env = _Sandbox(bounds)
    try:
        tree = _Guards().visit(env.parse(source))
        compiled = env.from_string(tree.set_environment(env))
    except Exception as exc:  # a syntax error, or a parser's RecursionError on deep nesting
        raise ChatTemplateError(f"{name} does not parse: {_text(exc)}") from exc
    parts, size = [], 0
    try:
        for part in compiled.generate(**context):
            size += len(part)
            if size > MAX_CHARS:
                raise _Limit(f"the prompt passed {MAX_CHARS} characters")
            parts.append(part)
    except _Limit as exc:
        raise ChatTemplateError(f"{name} was stopped: {exc}") from exc
    except _Refusal as exc:
        raise ChatTemplateError(f"{name} refused the conversation: {_text(exc)}") from exc
    except Exception as exc:  # ZeroDivisionError, RecursionError, MemoryError, jinja2's own errors...
        raise ChatTemplateError(f"{name} failed: {type(exc).__name__}: {_text(exc)}") from exc
    return "".join(parts)


def _text(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."


class _Bounds:
    """One rendering's budget: CPU time, and characters made. `tick` runs at every loop step and call."""

    def __init__(self):
        self.deadline = time.thread_time() + RENDER_SECONDS
        self.ticks = 0
        self.made = 0

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 63 and time.thread_time() > self.deadline:
            raise _Limit(f"rendering took more than {RENDER_SECONDS:g} s of CPU")

    def value(self, x):
        """`x`, counted when it is a string or a container just made."""
        if type(x) in _MADE:
            n = len(x)
            if n > MAX_CHARS:
                raise _Limit(f"a value of {n} characters or items (more than {MAX_CHARS})")
            self.made += n
            if self.made > MAX_MADE:
                raise _Limit(f"it made more than {MAX_MADE} characters")
        return x

    def each(self, iterable):
        """What every `{% for %}` iterates: the items, a tick each."""
        for item in iterable:
            self.tick()
            yield item

    def out(self, x):
        """What every `{{ ... }}` and piece of template text writes, counted."""
        self.tick()
        self.value(x if isinstance(x, str) else str(x))
        return x

    def join(self, parts: list) -> str:
        """`a ~ b ~ c`, refused before joining when it would pass MAX_CHARS."""
        self.tick()
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        _refuse_over(sum(map(len, texts)), "~")
        return self.value("".join(texts))


_MADE = {str, list, tuple, dict}


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise _Limit(f"{what} would make {size} characters or items (more than {MAX_CHARS})")


def _guard(check: str, node: jinja2.nodes.Expr) -> jinja2.nodes.Filter:
    """`node|hotcold_<check>`: filters are direct calls in compiled templates (no sandbox lookup per call)."""
    return jinja2.nodes.Filter(node, f"hotcold_{check}", [], [], None, None, lineno=node.lineno)


class _Guards(NodeTransformer):
    """Rewrites a parsed template so every loop, output and `~` goes through `_Bounds`."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _guard("each", node.iter)
        return node

    def visit_Output(self, node):
        self.generic_visit(node)
        # template text is counted where it reaches the prompt (render_template), at no cost per piece
        node.nodes = [n if isinstance(n, jinja2.nodes.TemplateData) else _guard("out", n) for n in node.nodes]
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _guard("join", jinja2.nodes.List(node.nodes, lineno=node.lineno))


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part for training masks in transformers;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise _Refusal(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: keys in their order and no HTML escapes (jinja2's sorts and escapes)."""
    if isinstance(indent, int) and indent > 64:
        raise _Limit(f"tojson(indent={indent}) (at most 64)")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment (loop controls, {% generation %} blocks, its globals and tojson), with
    every call, filter and `+ * ** %` ticking `bounds` and refused when its result would pass a bound."""

    intercepted_binops = frozenset(("+", "*", "**", "%"))

    def __init__(self, bounds: _Bounds):
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
        )
        self.bounds = bounds
        self.filters["tojson"] = _tojson
        self.filters = {name: _guarded(bounds, name, f) for name, f in self.filters.items()}
        self.filters.update(hotcold_each=bounds.each, hotcold_out=bounds.out, hotcold_join=bounds.join)
        del self.globals["lipsum"], self.filters["pprint"]  # they loop inside, out of the bounds' reach
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),  # used by many HF templates
        )

    def call_binop(self, context, operator, left, right):
        self.bounds.tick()
        _check_binop(operator, left, right)
        return self.bounds.value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # jinja2's signature (no clash with kwargs)
        __self.bounds.tick()
        kind = type(__obj)
        if kind is types.BuiltinMethodType or kind is types.FunctionType:  # not a macro: maybe a str method
            bound = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in a function
            target = getattr(bound, "__self__", None)
            if isinstance(target, str):
                _check_call(__obj.__name__, target, args, kwargs, method=True)
        return __self.bounds.value(super().call(__context, __obj, *args, **kwargs))


def _guarded(bounds: _Bounds, name: str, f):
    passes = getattr(f, "jinja_pass_arg", None) is not None  # a context or environment comes first

    @functools.wraps(f)  # keeps jinja_pass_arg
    def guarded(*args, **kwargs):
        bounds.tick()
        value, *rest = args[1:] if passes else args
        _check_call(name, value, rest, kwargs, method=False)
        return bounds.value(f(*args, **kwargs))

    return guarded


_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d*\.)?(\*|\d{7,})")  # '%*d', '%.9999999f': widths from far off
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*(\d{7,}|\{)")  # '{:>9999999}', '{:{}}'
_WIDTHS = {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "batch"}  # an int arg sets the size
_REPEATS = {"expandtabs": "\t", "indent": "\n"}  # ...once per tab / line
_ARG_CAPS = {"slice": 1 << 16}  # do_slice loops over its count
_PER_ITEM = {"sort", "unique", "groupby", "dictsort", "map", "select", "reject", "selectattr", "rejectattr"}
_PER_ITEM |= {"sum", "min", "max", "wordwrap", "urlize"}


def _check_call(name: str, target, args, kwargs, *, method: bool) -> None:
    """Refuse, before it runs, a string method or filter whose result would pass MAX_CHARS."""
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
    if name in _PER_ITEM and not method and hasattr(target, "__len__") and len(target) > MAX_ITEMS:
        raise _Limit(f"{name} over {len(target)} items or characters (at most {MAX_ITEMS})")
    if name in _WIDTHS and ints:
        copies = target.count(_REPEATS[name]) + 1 if name in _REPEATS and isinstance(target, str) else 1
        size = len(target) if isinstance(target, str | list | tuple) else 0
        _refuse_over(size + max(ints) * copies, name)
    elif name in _ARG_CAPS and ints and max(ints) > _ARG_CAPS[name]:
        raise _Limit(f"{name}({max(ints)}) (at most {_ARG_CAPS[name]})")
    elif name == "replace" and isinstance(target, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            count = target.count(old) if old else len(target) + 1
            _refuse_over(len(target) + count * max(0, len(new) - len(old)), name)
    elif name == "join":
        sep, items = (target, args[0] if args else ()) if method else (args[0] if args else "", target)
        if isinstance(sep, str) and isinstance(items, list | tuple):
            _refuse_over(sum(len(x) for x in items if isinstance(x, str)) + len(sep) * len(items), name)
    elif name in ("format", "format_map"):
        pattern = _BRACE_WIDTH if method else _PERCENT_WIDTH
        if isinstance(target, str) and pattern.search(target):
            raise _Limit(f"a format with a width of 7 or more digits or from an argument: {_short(target)}")


def _check_binop(op: str, a, b) -> None:
    """Refuse `a op b` before computing it when it would pass MAX_CHARS or MAX_INT_BITS."""
    seq = (str, list, tuple)
    if op == "+" and isinstance(a, seq) and isinstance(b, seq):
        _refuse_over(len(a) + len(b), "+")
    elif op == "*":
        for s, n in ((a, b), (b, a)):
            if isinstance(s, seq) and isinstance(n, int):
                _refuse_over(len(s) * n, "*")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise _Limit(f"an integer product of more than {MAX_INT_BITS} bits")
    elif op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if a.bit_length() * b > MAX_INT_BITS:
            raise _Limit(f"an integer power of more than {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(a, str) and _PERCENT_WIDTH.search(a):
        raise _Limit(f"a format with a width of 7 or more digits or from an argument: {_short(a)}")
