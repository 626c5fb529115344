"""Tool calling in chat: OpenAI's `tools` / `tool_choice` -> the constraint that forces a call, and the
model's answer -> `tool_calls`.

Calls are written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (hotcold.chat's format,
Hermes / Qwen's); an answer that is one bare JSON object with "name" and "arguments" (or "parameters")
counts too. `tool_choice`: "none" (no tools offered, text only), "auto" (the default: the model decides;
calls found in the text are returned), "required" or {"type": "function", "function": {"name": ...}}
(the output is grammar-constrained to one call of those functions, so it always parses)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hotcold.chat import ChatInputError, check_tool_name
from hotcold.server.messages import chat_error
from hotcold.server.protocol import ApiError, ChatFormat
from hotcold.structured import JSON_OPTIONS

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def wire(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index} | out


def functions(tools: list[dict]) -> list[dict]:
    """The function definitions (400 for anything else, or a name OpenAI would refuse)."""
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise ApiError(
                400,
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools.{i}",
            )
        try:  # OpenAI's rule: a name cannot carry "</tool_call>" (or anything else) into the prompt
            check_tool_name(fn.get("name"), ("tools", i, "function", "name"))
        except ChatInputError as exc:
            raise chat_error(exc) from exc
        out.append(fn)
    return out


def choice(tools: list[dict] | None, tool_choice) -> tuple[list[dict] | None, str | None]:
    """(the tools to offer, or None; the Lark grammar that forces a call, or None)."""
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    fns = functions(tools)
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "required":
        forced = fns
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        forced = [f for f in fns if f["name"] == name]
        if not forced:
            raise ApiError(400, f"tool_choice: no tool named {name!r}", param="tool_choice")
    else:
        raise ApiError(
            400,
            f"tool_choice: expected none, auto, required or a function, got {tool_choice!r}",
            param="tool_choice",
        )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in forced
    ]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": JSON_OPTIONS}
    return tools, 'start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(schema)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the text around the calls, the calls) of a model's answer; no calls: (text, [])."""
    found = [_call(m.group(1)) for m in _CALL.finditer(text)]
    if found and all(found):
        return _CALL.sub("", text).strip(), found
    bare = _call(text.strip())
    return ("", [bare]) if bare else (text, [])


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict | str):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text, f"call_{uuid.uuid4().hex[:24]}")


class ToolChatFormat(ChatFormat):
    """Chat responses when tools are offered. Streamed, text goes out as content as it comes, except
    from a `<tool_call>` on (and any text that may be its start, or an answer that starts with "{": a
    possible bare call), which waits for the choice's end; then the calls go out as `tool_calls` deltas
    (each call's whole arguments in one piece, which OpenAI's clients reassemble), with finish_reason
    "tool_calls". Text after the last call is dropped."""

    TAG = "<tool_call>"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # characters of the text already sent as content

    def _safe(self, text: str) -> int:
        """How much of `text` is content for sure (not a call, nor the start of one)."""
        if not text.strip() or text.lstrip().startswith("{"):
            return 0
        at = text.find(self.TAG)
        if at >= 0:
            return at
        keep = next(
            (n for n in range(min(len(self.TAG) - 1, len(text)), 0, -1) if text.endswith(self.TAG[:n])), 0
        )
        return len(text) - keep

    def chunk(self, index: int, text: str, logprobs):
        full = self._text[index] = self._text.get(index, "") + text
        sent, safe = self._sent.get(index, 0), self._safe(full)
        if safe <= sent:
            return self._delta(index, {}, None, logprobs) if logprobs else None
        self._sent[index] = safe
        return self._delta(index, {"content": full[sent:safe]}, None, logprobs)

    def end(self, index: int, finish_reason: str, stats) -> list[dict]:
        full, sent = self._text.pop(index, ""), self._sent.pop(index, 0)
        content, calls = parse(full)
        out = []
        rest = full[sent:]
        if calls:
            at = full.find(self.TAG)
            rest = full[sent:at] if at >= sent else ""
            rest = rest if rest.strip() else ""
        if rest:
            out.append(self._delta(index, {"content": rest}, None))
        if calls:
            out.append(self._delta(index, {"tool_calls": [c.wire(i) for i, c in enumerate(calls)]}, None))
        return out + super().end(index, "tool_calls" if calls else finish_reason, stats)

    def whole(self, choices) -> dict:
        body = super().whole(choices)
        for c, out in zip(choices, body["choices"]):
            content, calls = parse(c.text)
            if calls:
                out["message"] = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [t.wire() for t in calls],
                }
                out["finish_reason"] = "tool_calls"
        return body
