"""Structured output fields of a request -> one hotcold.structured.Constraint, or a 400 naming the field.

- OpenAI `response_format`: {"type": "json_object"} (any object; llama.cpp's {"type": "json_object",
  "schema": {...}} too) and {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (no
  schema: any object); "text" is no constraint. On chat and completions.
- `grammar`: GBNF (llama.cpp) or Lark, on every route; `json_schema` on llama.cpp's `/completion`.

At most one per request. Compiling runs off the event loop and is bounded: `COMPILE_TIMEOUT_S` (then
400) on top of llguidance's own limits (hotcold.structured)."""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from hotcold import structured
from hotcold.server.protocol import ApiError

COMPILE_TIMEOUT_S = 10.0


def _fields(body) -> list[tuple[str, dict]]:
    """(field, compile_constraint's arguments) for every constraint the request gives."""
    out: list[tuple[str, dict]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        if rf.schema_ is not None:
            out.append(("response_format.schema", {"json_schema": rf.schema_}))
        else:
            out.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(
                400,
                'response_format: type "json_schema" needs a json_schema object',
                param="response_format.json_schema",
            )
        schema = rf.json_schema.schema_
        if schema is None:
            out.append(("response_format.json_schema", {"json_object": True}))
        else:
            out.append(("response_format.json_schema.schema", {"json_schema": schema}))
    if getattr(body, "json_schema", None) is not None:
        out.append(("json_schema", {"json_schema": body.json_schema}))
    if body.grammar is not None:
        out.append(("grammar", {"grammar": body.grammar}))
    return out


async def constraint(body, tokenizer) -> structured.Constraint | None:
    """The request's constraint, compiled and its matcher built (a bad one: ApiError 400)."""
    given = _fields(body)
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise ApiError(400, f"give one structured output constraint, not {names}", param=given[1][0])
    field, kwargs = given[0]
    return await compile_field(field, tokenizer, **kwargs)


async def compile_field(field: str, tokenizer, **kwargs) -> structured.Constraint:
    """compile_constraint(**kwargs) off the event loop, bounded in time; its matcher built."""

    def build() -> structured.Constraint:
        c = structured.compile_constraint(field=field, **kwargs)
        structured.prepare(tokenizer, c)
        return c

    try:
        return await asyncio.wait_for(run_in_threadpool(build), COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError as exc:
        raise ApiError(
            400, f"{field}: took more than {COMPILE_TIMEOUT_S:g} s to compile", param=field
        ) from exc
    except ValueError as exc:
        raise ApiError(400, str(exc), param=field) from exc
