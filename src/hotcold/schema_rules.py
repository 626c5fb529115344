"""What hotcold checks and changes in a JSON schema before llguidance compiles it (hotcold.structured; the
grammar checks are hotcold.grammar_rules).

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
without `properties` takes any keys. The parts of an `allOf` are left as given: their keys combine."""

from __future__ import annotations

import json
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
