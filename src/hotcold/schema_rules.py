"""What hotcold checks and changes in a grammar or JSON schema before llguidance compiles it (hotcold.structured).

Termination: every rule of a grammar, and every subschema of a JSON schema, must have a finite output.
`root ::= "a" root` or a schema whose required property refers back to it compiles in llguidance and fails
only once generation is inside it (its forced-token search runs out of items), so hotcold refuses them at
admission. A rule is productive when one of its alternatives uses only productive parts (terminals,
optional or repeated-zero-times parts, productive rules): the least fixed point over the rules. A subschema
with no finite instance is one that is unsatisfiable once recursion is cut (least fixed point) but
satisfiable when recursion is assumed to end (greatest fixed point): what differs is recursion only, so an
unsatisfiable schema that llguidance itself reports is left to llguidance.

Closed objects: as llama.cpp's json-schema-to-grammar converter reads a schema, an object that lists
`properties` and says nothing of `additionalProperties` has no other keys (`closed_objects`); an object
without `properties` takes any keys. The parts of an `allOf` are left as given: their keys combine.

The grammar check reads llguidance's Lark (GBNF arrives converted by llguidance's own gbnf_to_lark):
rules, alternatives, groups, `?`/`*`/`+`/`{m,n}`/`~m..n`, strings, regexes, special tokens, `%json`
schemas (checked as schemas), `@` sub-grammars. Terminals (UPPERCASE) cannot recurse in Lark and are
taken as productive. A grammar the reader cannot follow is left to llguidance (the check never refuses
what it does not understand)."""

from __future__ import annotations

import json
import re
from collections import deque

# ------------------------------------------------------------------------------------------------
# JSON schemas
# ------------------------------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains")


def _subschemas(node) -> list[tuple[str, object]]:
    """(pointer suffix, subschema) for each schema-valued keyword of a schema object."""
    if not isinstance(node, dict):
        return []
    out: list[tuple[str, object]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(f"/{key}/{_escape(k)}", v) for k, v in node[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(f"/{key}/{i}", v) for i, v in enumerate(node[key])]
    for key in _SCHEMA_ONE:
        if isinstance(node.get(key), dict | bool):
            out.append((f"/{key}", node[key]))
        elif key == "items" and isinstance(node.get(key), list):  # draft-4 tuples
            out += [(f"/items/{i}", v) for i, v in enumerate(node[key])]
    return [(p, v) for p, v in out if isinstance(v, dict | bool)]


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _resolve(root, ref):
    """The subschema a local `$ref` ("#", "#/$defs/x", any JSON pointer) names; None for others."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None


def closed_objects(schema):
    """A copy of `schema` where every object schema that gives `properties` without `additionalProperties`
    has `"additionalProperties": false` (llama.cpp's reading; JSON Schema's own default allows any key). An
    `allOf`, its parts and what they refer to stay open: closing one part would forbid the other parts' keys."""
    schema = json.loads(json.dumps(schema))
    open_ids: set[int] = set()
    pending = deque([schema])
    while pending:  # the allOf parts, and through $ref what they are made of
        node = pending.popleft()
        for _, sub in _subschemas(node):
            pending.append(sub)
        if isinstance(node, dict) and isinstance(node.get("allOf"), list):
            stack = [p for p in node["allOf"] if isinstance(p, dict)]
            while stack:
                part = stack.pop()
                if id(part) in open_ids:
                    continue
                open_ids.add(id(part))
                target = _resolve(schema, part.get("$ref"))
                if isinstance(target, dict):
                    stack.append(target)
    seen: set[int] = set()
    pending = deque([schema])
    while pending:
        node = pending.popleft()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        closable = id(node) not in open_ids and "allOf" not in node
        if closable and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        pending.extend(sub for _, sub in _subschemas(node))
    return schema


def infinite_subschemas(schema) -> list[str]:
    """JSON pointers ("#", "#/$defs/node", ...) of the subschemas reachable from the root that have no finite
    instance because of recursion (a required property, or an item that minItems requires, that leads back
    to them through `$ref`), shallowest first."""
    nodes: dict[int, object] = {}
    where: dict[int, str] = {}
    order: list[int] = []
    pending = deque([("#", schema)])
    while pending:  # breadth first: each node named by its shortest path
        path, node = pending.popleft()
        if id(node) in nodes or isinstance(node, bool):
            continue
        nodes[id(node)], where[id(node)] = node, path
        order.append(id(node))
        pending.extend((path + p, sub) for p, sub in _subschemas(node))
        if isinstance(node, dict) and "$ref" in node:
            target = _resolve(schema, node["$ref"])
            if target is not None:
                pending.append((node["$ref"], target))

    def fixed_point(start: bool) -> dict[int, bool]:
        value = dict.fromkeys(nodes, start)
        changed = True
        while changed:
            changed = False
            for key in order:
                v = _satisfiable(nodes[key], schema, value)
                if v != value[key]:
                    value[key], changed = v, True
        return value

    least, greatest = fixed_point(False), fixed_point(True)
    return [where[k] for k in order if greatest[k] and not least[k]]


def _satisfiable(node, root, value: dict[int, bool]) -> bool:
    """Whether `node` has an instance, given `value` for its subschemas (one step of the fixed point)."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True

    def sat(sub) -> bool:
        return sub if isinstance(sub, bool) else value.get(id(sub), True)

    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not None and not sat(target):
            return False
    if isinstance(node.get("allOf"), list) and not all(sat(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(sat(s) for s in node[key]):
            return False
    kind = node.get("type")
    if isinstance(kind, str):
        kinds = {kind}
    elif isinstance(kind, list) and kind:
        kinds = {k for k in kind if isinstance(k, str)}
    elif any(k in node for k in ("properties", "required", "additionalProperties")):
        kinds = {"object"}  # as llguidance and llama.cpp read a schema without a type
    elif any(k in node for k in ("items", "prefixItems", "minItems")):
        kinds = {"array"}
    else:
        return True
    return any(_kind_satisfiable(k, node, sat) for k in kinds)


def _kind_satisfiable(kind: str, node: dict, sat) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        for name in node.get("required") or []:
            sub = props.get(name, extra) if isinstance(name, str) else True
            if isinstance(sub, dict | bool) and not sat(sub):
                return False
        return True
    if kind == "array":
        need = node.get("minItems", 0)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True)
        if isinstance(items, list):  # draft-4 tuples
            prefix, items = items, node.get("additionalItems", True)
        if not isinstance(need, int) or need <= 0:
            return True
        for i in range(min(need, len(prefix) + 1)):
            sub = prefix[i] if i < len(prefix) else items
            if isinstance(sub, dict | bool) and not sat(sub):
                return False
        return True
    return True


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
