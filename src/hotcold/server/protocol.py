"""Wire formats: request models (pydantic, strict types) and the JSON each route answers with, for the
OpenAI routes (`/v1/completions`, `/v1/chat/completions`) and llama.cpp's `/completion`.

Pure data in, data out: the app turns requests into a `GenerationRequest` and feeds chunks of text to
a `Format`, which says what goes on the wire."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from hotcold.engine import GenerationStats

StopWord = Annotated[str, StringConstraints(max_length=1024)]
StopList = Annotated[list[StopWord], Field(max_length=16)]


class ApiError(Exception):
    """An error the client caused (or a busy server): answered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


# ------------------------------------------------------------------------------------------------
# Requests. strict: "5" is not a number and 1.5 is not a token count; unknown fields are ignored.
# ------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _OpenAISampling(_Request):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: StopWord | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # only 1 is served: checked with a clear message
    # extensions, named as vLLM / llama.cpp name them
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None  # not supported: a non-null value is refused
    suffix: str | None = None  # not supported: a non-empty value is refused


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=0)  # None: until the context (or the server's ceiling) ends
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens


class LlamaCompletionRequest(_Request):
    """llama.cpp's native `/completion` (its defaults)."""

    prompt: str | list[int]
    n_predict: int = Field(-1, ge=-1)  # -1: until the context (or the server's ceiling) ends
    stream: bool = False
    temperature: float = Field(0.8, ge=0.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    seed: int = -1  # -1: random
    stop: StopList = []
    ignore_eos: bool = False


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False  # llama.cpp's default: no BOS


class DetokenizeRequest(_Request):
    tokens: list[int]


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
                        param=f"messages.{i}.content",
                    )
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system role
        out.append({"role": role, "content": content})
    return out


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


class Format:
    """What one route sends: `chunk` per piece of streamed text, `end` after the last, `whole` when
    not streaming. `done` is the closing SSE line (OpenAI's `[DONE]`; llama.cpp sends none)."""

    done: str | None = "[DONE]"

    def __init__(self, model: str, *, include_usage: bool = False, prefix: str = "cmpl"):
        self.model = model
        self.include_usage = include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def start(self) -> list[dict]:
        return []

    def chunk(self, text: str) -> dict:
        raise NotImplementedError

    def end(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        raise NotImplementedError

    def whole(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        raise NotImplementedError

    def _usage_chunk(self, stats: GenerationStats, obj: str) -> list[dict]:
        if not self.include_usage:
            return []
        return [self._head(obj) | {"choices": [], "usage": usage(stats)}]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class CompletionFormat(Format):
    def __init__(self, model: str, *, include_usage: bool = False, echo: str = ""):
        super().__init__(model, include_usage=include_usage, prefix="cmpl")
        self.echo = echo

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> list[dict]:
        return [self.chunk(self.echo)] if self.echo else []

    def chunk(self, text: str) -> dict:
        return self._head("text_completion") | {"choices": [self._choice(text, None)]}

    def end(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        last = self._head("text_completion") | {"choices": [self._choice("", finish_reason)]}
        return [last, *self._usage_chunk(stats, "text_completion")]

    def whole(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        return self._head("text_completion") | {
            "choices": [self._choice(self.echo + text, finish_reason)],
            "usage": usage(stats),
        }


class ChatFormat(Format):
    def __init__(self, model: str, *, include_usage: bool = False):
        super().__init__(model, include_usage=include_usage, prefix="chatcmpl")

    def _delta(self, delta: dict, finish_reason: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._head("chat.completion.chunk") | {"choices": [choice]}

    def start(self) -> list[dict]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def chunk(self, text: str) -> dict:
        return self._delta({"content": text}, None)

    def end(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        return [self._delta({}, finish_reason), *self._usage_chunk(stats, "chat.completion.chunk")]

    def whole(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._head("chat.completion") | {"choices": [choice], "usage": usage(stats)}


class LlamaFormat(Format):
    """llama.cpp's `/completion`: {"content", "stop", ...}; the last object carries the timings."""

    done = None

    def chunk(self, text: str) -> dict:
        return {"content": text, "stop": False}

    def _final(self, content: str, finish_reason: str, stats: GenerationStats) -> dict:
        return {
            "content": content,
            "stop": True,
            "model": self.model,
            "tokens_predicted": stats.generated_tokens,
            "tokens_evaluated": stats.prompt_tokens,
            "stopped_limit": finish_reason == "length",  # else an end-of-generation token or a stop word
            "timings": {
                "prompt_n": stats.prompt_tokens,
                "prompt_ms": stats.prompt_seconds * 1000,
                "prompt_per_second": stats.prompt_tps,
                "predicted_n": stats.generated_tokens,
                "predicted_ms": stats.generate_seconds * 1000,
                "predicted_per_second": stats.generate_tps,
            },
        }

    def end(self, finish_reason: str, stats: GenerationStats) -> list[dict]:
        return [self._final("", finish_reason, stats)]

    def whole(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        return self._final(text, finish_reason, stats)


def model_list(model_id: str, created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "hotcold"}],
    }
