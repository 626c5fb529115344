"""The bounded sandbox chat templates render in: templates come from model files, so they render in jinja2's
ImmutableSandboxedEnvironment (as transformers renders them, with its `tojson`, `raise_exception` and
`strftime_now`), for at most `seconds` of CPU, making no value and no prompt over `max_chars` characters and at
most `MAX_MADE` characters in all. Every `for` loop, call, filter, `~` and output passes a check (the template's
syntax tree is rewritten to route them through `_Bounds`); `+ * ** %` go through the sandbox's operator hook,
which refuses a string, list or integer that would pass a bound before making it. Lists allow `append` and `pop`
(as llama.cpp's Jinja does: Kimi K2 queues tool call ids that way); the context is a deep copy, so a template
cannot change its caller's data. Any failure of a template (its own `raise_exception` included) is a
`ChatTemplateError` naming the template.

`render_watched` also says whether the template used a `Watched` string of the context (wrote it, read it as a
member, passed it to a filter, method or operator, or wrote a structure holding it with `tojson`): llama.cpp's
"used" statistic, by which it probes what a template does with each field."""

from __future__ import annotations

import copy
import functools
import json
import re
import time
import types
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_MADE = 1 << 26  # characters (and list items) made in all while rendering: output, buffers, values
MAX_INT_BITS = 1 << 16  # integers made by * and ** (10 ** 10 ** 10 would never finish)
MAX_ITEMS = 1 << 16  # the input of a filter that runs Python per item (sort, map, select, wordwrap...)


class ChatTemplateError(ValueError):
    """A chat template failed, refused the conversation, or passed a bound; the message names the template."""


class Watched(str):
    """A string of the context whose use by the template `render_watched` reports."""


class _Limit(Exception):
    """A bound reached while rendering."""


class _Refusal(Exception):
    """The template's own raise_exception(message)."""


def render_template(source: str, name: str, *, seconds: float, max_chars: int, **context) -> str:
    """`source` rendered with `context` in the bounded sandbox; ChatTemplateError naming `name` otherwise."""
    return _render(source, name, _Bounds(seconds, max_chars), context)


def render_watched(source: str, name: str, *, seconds: float, max_chars: int, **context) -> tuple[str, bool]:
    """`render_template`, and whether the template used a `Watched` string of `context`."""
    bounds = _Bounds(seconds, max_chars)
    bounds.watching = True
    return _render(source, name, bounds, context), bounds.used


def _render(source: str, name: str, bounds: _Bounds, context: dict) -> str:
    env = _Sandbox(bounds)
    try:
        tree = _Guards().visit(env.parse(source))
        compiled = env.from_string(tree.set_environment(env))
    except Exception as exc:  # a syntax error, or a parser's RecursionError on deep nesting
        raise ChatTemplateError(f"{name} does not parse: {_text(exc)}") from exc
    parts, size = [], 0
    try:
        for part in compiled.generate(**copy.deepcopy(context)):  # lists may be appended to
            size += len(part)
            if size > bounds.max_chars:
                raise _Limit(f"the prompt passed {bounds.max_chars} characters")
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


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


class _Bounds:
    """One rendering's budget (CPU time, and characters made) and its checks. `tick` runs at every loop step
    and call. With `watching`, `used` records the use of a `Watched` string."""

    def __init__(self, seconds: float, max_chars: int):
        self.seconds, self.max_chars = seconds, max_chars
        self.deadline = time.thread_time() + seconds
        self.ticks = 0
        self.made = 0
        self.watching = self.used = False

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 63 and time.thread_time() > self.deadline:
            raise _Limit(f"rendering took more than {self.seconds:g} s of CPU")

    def watch(self, *values, deep: bool = False) -> None:
        """Records the use of any of `values` that is (or, `deep`, holds) a `Watched` string."""
        if self.watching and not self.used:
            self.used = any(_holds_watched(v) if deep else type(v) is Watched for v in values)

    def value(self, x):
        """`x`, counted when it is a string or a container just made."""
        if type(x) in _MADE:
            n = len(x)
            if n > self.max_chars:
                raise _Limit(f"a value of {n} characters or items (more than {self.max_chars})")
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
        self.watch(x)
        self.value(x if isinstance(x, str) else str(x))
        return x

    def join(self, parts: list) -> str:
        """`a ~ b ~ c`, refused before joining when it would pass max_chars."""
        self.tick()
        self.watch(*parts)
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        self.refuse_over(sum(map(len, texts)), "~")
        return self.value("".join(texts))

    def refuse_over(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _Limit(f"{what} would make {size} characters or items (more than {self.max_chars})")

    def check_call(self, name: str, target, args, kwargs, *, method: bool) -> None:
        """Refuse, before it runs, a string method or filter whose result would pass max_chars."""
        ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
        if name in _PER_ITEM and not method and hasattr(target, "__len__") and len(target) > MAX_ITEMS:
            raise _Limit(f"{name} over {len(target)} items or characters (at most {MAX_ITEMS})")
        if name in _WIDTHS and ints:
            copies = target.count(_REPEATS[name]) + 1 if name in _REPEATS and isinstance(target, str) else 1
            size = len(target) if isinstance(target, str | list | tuple) else 0
            self.refuse_over(size + max(ints) * copies, name)
        elif name in _ARG_CAPS and ints and max(ints) > _ARG_CAPS[name]:
            raise _Limit(f"{name}({max(ints)}) (at most {_ARG_CAPS[name]})")
        elif name == "replace" and isinstance(target, str) and len(args) >= 2:
            old, new = args[0], args[1]
            if isinstance(old, str) and isinstance(new, str):
                count = target.count(old) if old else len(target) + 1
                self.refuse_over(len(target) + count * max(0, len(new) - len(old)), name)
        elif name == "join":
            sep, items = (target, args[0] if args else ()) if method else (args[0] if args else "", target)
            if isinstance(sep, str) and isinstance(items, list | tuple):
                self.refuse_over(
                    sum(len(x) for x in items if isinstance(x, str)) + len(sep) * len(items), name
                )
        elif name in ("format", "format_map"):
            pattern = _BRACE_WIDTH if method else _PERCENT_WIDTH
            if isinstance(target, str) and pattern.search(target):
                raise _Limit(
                    f"a format with a width of 7 or more digits or from an argument: {_short(target)}"
                )

    def check_binop(self, op: str, a, b) -> None:
        """Refuse `a op b` before computing it when it would pass max_chars or MAX_INT_BITS."""
        seq = (str, list, tuple)
        if op == "+" and isinstance(a, seq) and isinstance(b, seq):
            self.refuse_over(len(a) + len(b), "+")
        elif op == "*":
            for s, n in ((a, b), (b, a)):
                if isinstance(s, seq) and isinstance(n, int):
                    self.refuse_over(len(s) * n, "*")
            if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
                raise _Limit(f"an integer product of more than {MAX_INT_BITS} bits")
        elif op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
            if a.bit_length() * b > MAX_INT_BITS:
                raise _Limit(f"an integer power of more than {MAX_INT_BITS} bits")
        elif op == "%" and isinstance(a, str) and _PERCENT_WIDTH.search(a):
            raise _Limit(f"a format with a width of 7 or more digits or from an argument: {_short(a)}")


_MADE = {str, list, tuple, dict}


def _holds_watched(x) -> bool:
    if type(x) is Watched:
        return True
    if isinstance(x, dict):
        return any(_holds_watched(k) or _holds_watched(v) for k, v in x.items())
    return isinstance(x, list | tuple) and any(_holds_watched(v) for v in x)


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
        # template text is counted where it reaches the prompt (_render), at no cost per piece
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


_LIST_CHANGES = frozenset(("append", "pop"))  # one item each: llama.cpp's Jinja has them, Kimi K2 uses them


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

    def is_safe_attribute(self, obj, attr, value):
        if type(obj) is list and attr in _LIST_CHANGES:
            return super(ImmutableSandboxedEnvironment, self).is_safe_attribute(obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def getitem(self, obj, argument):
        value = super().getitem(obj, argument)
        self.bounds.watch(obj, value)
        return value

    def getattr(self, obj, attribute):
        value = super().getattr(obj, attribute)
        self.bounds.watch(obj, value)
        return value

    def call_binop(self, context, operator, left, right):
        self.bounds.tick()
        self.bounds.watch(left, right)
        self.bounds.check_binop(operator, left, right)
        return self.bounds.value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # jinja2's signature (no clash with kwargs)
        __self.bounds.tick()
        __self.bounds.watch(*args, *kwargs.values())
        kind = type(__obj)
        if kind is types.BuiltinMethodType or kind is types.FunctionType:  # not a macro: maybe a str method
            bound = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in a function
            target = getattr(bound, "__self__", None)
            if isinstance(target, str):
                __self.bounds.check_call(__obj.__name__, target, args, kwargs, method=True)
        return __self.bounds.value(super().call(__context, __obj, *args, **kwargs))


def _guarded(bounds: _Bounds, name: str, f):
    passes = getattr(f, "jinja_pass_arg", None) is not None  # a context or environment comes first
    deep = name in ("tojson", "string")  # they write the whole structure

    @functools.wraps(f)  # keeps jinja_pass_arg
    def guarded(*args, **kwargs):
        bounds.tick()
        value, *rest = args[1:] if passes else args
        bounds.watch(value, deep=deep)
        bounds.watch(*rest, *kwargs.values())
        bounds.check_call(name, value, rest, kwargs, method=False)
        return bounds.value(f(*args, **kwargs))

    return guarded


_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d*\.)?(\*|\d{7,})")  # '%*d', '%.9999999f': widths from far off
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*(\d{7,}|\{)")  # '{:>9999999}', '{:{}}'
_WIDTHS = {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "batch"}  # an int arg sets the size
_REPEATS = {"expandtabs": "\t", "indent": "\n"}  # ...once per tab / line
_ARG_CAPS = {"slice": 1 << 16}  # do_slice loops over its count
_PER_ITEM = {"sort", "unique", "groupby", "dictsort", "map", "select", "reject", "selectattr", "rejectattr"}
_PER_ITEM |= {"sum", "min", "max", "wordwrap", "urlize"}
