"""What hotcold checks in a grammar before llguidance compiles it (hotcold.structured): every rule reachable from
the start has a finite derivation (hotcold.schema_rules says why termination is checked at admission), and
the `%json` schemas inside pass the schema checks.

The grammar check reads llguidance's Lark (GBNF arrives converted by llguidance's own gbnf_to_lark):
rules, alternatives, groups, `?`/`*`/`+`/`{m,n}`/`~m..n`, strings, regexes, special tokens, `%json`
schemas (checked as schemas), `@` sub-grammars. Terminals (UPPERCASE) cannot recurse in Lark and are
taken as productive. A grammar the reader cannot follow is left to llguidance (the check never refuses
what it does not understand)."""

from __future__ import annotations

import json
import re

from hotcold.schema_rules import closed_objects, infinite_subschemas

# ------------------------------------------------------------------------------------------------
# Lark grammars (llguidance's dialect)
# ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
     (?P<nl>\n)
    |(?P<ws>[ \t\r\f]+)
    |(?P<comment>(?://|\#)[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?)
    |(?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
    |(?P<special><[^<>\n]+>)
    |(?P<directive>%[A-Za-z_]+)
    |(?P<sub>@[A-Za-z0-9_\-]+)
    |(?P<arrow>->)
    |(?P<name>[A-Za-z_](?:[A-Za-z0-9_]|-(?!>))*)
    |(?P<number>-?\d+(?:\.\d+)?)
    |(?P<bounds>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
    |(?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
    |(?P<priority>\.-?\d+)
    |(?P<dots>\.\.)
    |(?P<punct>[:|()\[\]?*+!&~=,])
    """,
    re.X,
)


class _Unreadable(Exception):
    """A construct the reader does not follow: the grammar is left to llguidance."""


def _tokens(text: str) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    pos, decoder = 0, json.JSONDecoder()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unreadable(f"unexpected {text[pos : pos + 10]!r}")
        kind, pos = m.lastgroup, m.end()
        if kind in ("ws", "comment"):
            continue
        if kind == "directive":
            word = m.group()
            if word in ("%json", "%regex", "%llguidance"):
                start = len(text) - len(text[pos:].lstrip())
                value, pos = decoder.raw_decode(text, start)
                if word != "%llguidance":
                    out.append(("json" if word == "%json" else "atom", value))
                continue
            end = text.find("\n", pos)  # %ignore, %import, ...: the rest of the line
            pos = len(text) if end < 0 else end
            out.append(("directive", word))
            continue
        out.append((kind, m.group()))
    return out


def _is_terminal(name: str) -> bool:
    bare = name.lstrip("_")
    return bool(bare) and bare[0].isupper()


def _definitions(tokens) -> dict[str, list]:
    """rule name -> its body tokens (several definitions of one name: alternatives of one rule);
    terminal definitions and directives are dropped."""
    rules: dict[str, list] = {}
    current: list | None = None
    i = 0
    while i < len(tokens):
        at_line_start = i == 0 or tokens[i - 1][0] == "nl"
        head = _definition_head(tokens, i) if at_line_start else None
        if head is not None:
            name, i = head
            if _is_terminal(name):
                current = None
            else:
                current = rules.setdefault(name, [])
                if current:
                    current.append(("punct", "|"))
            continue
        kind = tokens[i][0]
        if kind == "directive":
            current = None
        elif current is not None and kind != "nl":
            current.append(tokens[i])
        i += 1
    return rules


def _definition_head(tokens, i: int):
    """(name, index after its ':') when a definition starts at tokens[i], else None."""
    if i < len(tokens) and tokens[i] in (("punct", "?"), ("punct", "!")):
        i += 1
    if i >= len(tokens) or tokens[i][0] != "name":
        return None
    name, i = tokens[i][1], i + 1
    if i < len(tokens) and tokens[i] == ("punct", "["):  # name[capture, stop="..."]:
        depth = 0
        while i < len(tokens):
            depth += {("punct", "["): 1, ("punct", "]"): -1}.get(tokens[i], 0)
            i += 1
            if depth == 0:
                break
    if i < len(tokens) and tokens[i][0] == "priority":
        i += 1
    if i < len(tokens) and tokens[i] == ("punct", ":"):
        return name, i + 1
    return None


class _Parser:
    """A rule body -> a tree of ("alt", [..]) / ("seq", [..]) / ("opt", x) / ("rule", name) / ("atom",)."""

    def __init__(self, tokens):
        self.t, self.i = tokens, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else ("end", None)

    def parse(self):
        tree = self.alternatives()
        if self.i != len(self.t):
            raise _Unreadable(f"unexpected {self.peek()[1]!r}")
        return tree

    def alternatives(self):
        alts = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.i += 1
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self):
        items = []
        while True:
            kind, text = self.peek()
            if kind == "arrow":  # -> alias
                self.i += 2
                continue
            if kind == "end" or (kind == "punct" and text in "|)]"):
                return ("seq", items)
            items.append(self.repeated())

    def repeated(self):
        atom = self.atom()
        while True:
            kind, text = self.peek()
            if kind == "punct" and text in "?*":
                self.i, atom = self.i + 1, ("opt", atom)
            elif kind == "punct" and text == "+":
                self.i += 1
            elif kind in ("bounds", "range"):
                self.i += 1
                low = re.search(r"\d+", text)
                if kind == "bounds" and not re.match(r"\{\s*\d", text) or low and int(low.group()) == 0:
                    atom = ("opt", atom)
            else:
                return atom

    def atom(self):
        kind, text = self.peek()
        self.i += 1
        if (kind, text) == ("punct", "("):
            tree = self.alternatives()
            self.expect(")")
            return tree
        if (kind, text) == ("punct", "["):
            tree = self.alternatives()
            self.expect("]")
            return ("opt", tree)
        if kind == "string":
            if self.peek()[0] == "dots":  # "a".."z"
                self.i += 2
            return ("atom",)
        if kind in ("regex", "special", "sub", "atom"):
            return ("atom",)
        if kind == "json":
            return ("json", text)
        if kind == "name":
            return ("atom",) if _is_terminal(text) else ("rule", text)
        raise _Unreadable(f"unexpected {text!r}")

    def expect(self, closing: str) -> None:
        if self.peek() != ("punct", closing):
            raise _Unreadable(f"expected {closing!r}")
        self.i += 1


def _productive(tree, prod: dict[str, bool]) -> bool:
    kind = tree[0]
    if kind == "alt":
        return any(_productive(t, prod) for t in tree[1])
    if kind == "seq":
        return all(_productive(t, prod) for t in tree[1])
    if kind == "rule":
        return prod.get(tree[1], True)  # an undefined rule: llguidance reports it
    return True  # terminals, optional parts, schemas (checked on their own)


def _references(tree, out: set[str], schemas: list) -> None:
    kind = tree[0]
    if kind in ("alt", "seq"):
        for t in tree[1]:
            _references(t, out, schemas)
    elif kind == "opt":
        _references(tree[1], out, schemas)
    elif kind == "rule":
        out.add(tree[1])
    elif kind == "json":
        schemas.append(tree[1])


def endless_rules(lark: str, start: str = "start") -> tuple[list[str], list[str]]:
    """(rules reachable from `start` that have no finite derivation, JSON pointers of `%json` subschemas with
    no finite instance). ([], []) also when the reader cannot follow the grammar."""
    try:
        rules = {name: _Parser(body).parse() for name, body in _definitions(_tokens(lark)).items()}
    except (_Unreadable, ValueError, IndexError):
        return [], []
    prod = dict.fromkeys(rules, False)
    changed = True
    while changed:
        changed = False
        for name, tree in rules.items():
            if not prod[name] and _productive(tree, prod):
                prod[name], changed = True, True
    reached, schemas, pending = [], [], [start] if start in rules else []
    seen = set(pending)
    while pending:
        name = pending.pop(0)
        reached.append(name)
        refs: set[str] = set()
        _references(rules[name], refs, schemas)
        for ref in sorted(refs - seen):
            if ref in rules:
                seen.add(ref)
                pending.append(ref)
    bad_schemas = [p for s in schemas for p in infinite_subschemas(s)]
    return [name for name in reached if not prod[name]], bad_schemas


def close_inline_schemas(lark: str) -> str:
    """`lark` with each `%json {...}` schema passed through closed_objects (tool arguments arrive so)."""
    out, pos, decoder = [], 0, json.JSONDecoder()
    for m in re.finditer(r"%json\b", lark):
        if m.start() < pos:
            continue
        start = len(lark) - len(lark[m.end() :].lstrip())
        try:
            value, end = decoder.raw_decode(lark, start)
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        out.append(lark[pos:start] + json.dumps(closed_objects(value)))
        pos = end
    return "".join(out) + lark[pos:]
