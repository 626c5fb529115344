"""OpenAI chat messages -> the {"role", "content"} dicts the chat templates take, and hotcold.chat's errors
-> 400s naming the field (`param` in the server's dotted form: "messages.1.tool_calls.0.function")."""

from __future__ import annotations

from hotcold.chat import ChatInputError, ChatTemplateError
from hotcold.server.protocol import ApiError, ChatMessage


def chat_error(exc: ValueError) -> ApiError:
    """The 400 for a conversation hotcold.chat refused: a malformed message or tool (its field), or the
    chat template failed, refused it or passed a bound (code "chat_template_error")."""
    if isinstance(exc, ChatInputError):
        return ApiError(400, str(exc), param=".".join(map(str, exc.path)))
    code = "chat_template_error" if isinstance(exc, ChatTemplateError) else None
    return ApiError(400, str(exc), param="messages", code=code)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the {"role", "content"} dicts chat templates take (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        400,
                        f"messages[{i}].content[{j}]: only text parts are supported, got type {part.type!r}",
                        param=f"messages.{i}.content.{j}",
                    )
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system role
        extra = {k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id)) if v}
        out.append({"role": role, "content": None if m.content is None and m.tool_calls else content} | extra)
    return out
