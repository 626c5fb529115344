"""Wire formats: request models (pydantic, strict types) and the JSON each route answers with, for the
OpenAI routes (`/v1/completions`, `/v1/chat/completions`) and llama.cpp's `/completion`.

Pure data in, data out: the app turns requests into `GenerationRequest`s and feeds chunks of text to
a `Format`, which says what goes on the wire.

`n` choices (1..8, at most --parallel) run as n sequences of one batch. Choice i samples with seed
`seed + i` (mod 2**64) when the request has a seed, so choice i equals a request with n=1 and seed
`seed + i`; without a seed each choice gets its own random generator; at temperature 0 every choice
is the greedy answer. Usage counts the prompt once and the completion tokens of every choice.

Logprobs (completions `logprobs: k`, chat `logprobs: true` + `top_logprobs: k`, k in 0..20) are
`log_softmax` of the model's raw logits, before the repeat penalty, temperature and top-k/p/min-p (what
OpenAI and vLLM report by default), one entry per sampled token except an end-of-generation token;
tokens that complete a stop string keep their entries though their text is cut. Streamed, a chunk
carries the entries of the tokens sampled since the previous chunk (their text may come in a later
chunk when it is held back as a possible stop string or an unfinished UTF-8 character). See
hotcold.runtime.generation.

Every route reports speed and sparsity in a `timings` object (llama.cpp's, plus the FFN figures; see
hotcold.server.figures): in the non-streamed response, and streamed in the chunk that finishes the last
choice (and, with `stream_options.include_usage`, in the usage chunk after it). The OpenAI clients keep
unknown fields (`response.timings` in the Python client)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from hotcold.runtime.engine import GenerationStats
from hotcold.runtime.generation import TokenLogprob
from hotcold.server.figures import timings

StopWord = Annotated[str, StringConstraints(max_length=1024)]
StopList = Annotated[list[StopWord], Field(max_length=16)]
MAX_CHOICES = 8  # `n` at most (and at most the server's --parallel slots)
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI allows


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


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: "text", "json_object" or "json_schema" (hotcold.server.constraints)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's spelling of json_object's


class _OpenAISampling(_Request):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: StopWord | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # and at most --parallel (the app says so)
    # extensions, named as vLLM / llama.cpp name them
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama.cpp's / vLLM's guided grammar (GBNF or Lark)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (legacy format)
    suffix: str | None = None  # not supported: a non-empty value is refused


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (hotcold.server.tools)
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=0)  # None: until the context (or the server's ceiling) ends
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or a function
    parallel_tool_calls: bool | None = None  # accepted; calls are parsed however many there are


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
    grammar: str | None = None  # GBNF (or Lark)
    json_schema: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False  # llama.cpp's default: no BOS


class DetokenizeRequest(_Request):
    tokens: list[int]


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice's whole answer, gathered from its chunks."""

    text: str = ""
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None


def usage(stats: Sequence[GenerationStats]) -> dict:
    """The prompt counted once, the completion tokens of every choice summed; as OpenAI's API, the prompt
    tokens whose keys and values came from a cache (this slot's earlier requests or another slot's) in
    prompt_tokens_details.cached_tokens."""
    prompt = stats[0].prompt_tokens if stats else 0
    cached = stats[0].prompt_tokens - stats[0].prompt_computed if stats else 0
    completion = sum(s.generated_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _join(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else [*(a or []), *(b or [])]


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -Infinity (vLLM's floor too)


class Format:
    """What one route sends for its choices (index 0..n-1): `start` first, `chunk` per piece of streamed
    text (with the logprob entries of the tokens sampled since the last one), `end` when a choice
    finishes, `tail` after the last; `whole` when not streaming. `done` is the closing SSE line
    (OpenAI's `[DONE]`; llama.cpp sends none). `hybrid`: the model has hot neurons on a GPU (the timings
    then say how many of the computed neurons ran there). `token_bytes(id)`: a token's bytes in the text (the
    tokenizer's), for the token strings of logprobs; they are decoded as UTF-8, a byte of an unfinished
    character as U+FFFD, as the text is (chat's `bytes` field keeps the raw bytes)."""

    done: str | None = "[DONE]"

    def __init__(
        self,
        model: str,
        *,
        include_usage: bool = False,
        prefix: str = "cmpl",
        token_bytes: Callable[[int], bytes] = lambda token: b"",
        hybrid: bool = False,
    ):
        self.model = model
        self.include_usage = include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.token_bytes = token_bytes
        self.hybrid = hybrid
        self._n = 1
        self._ended: dict[int, GenerationStats] = {}

    def start(self, n: int) -> list[dict]:
        """The objects before the first text; subclasses call this first (it counts the choices)."""
        self._n, self._ended = n, {}
        return []

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict:
        raise NotImplementedError

    def end(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        raise NotImplementedError

    def tail(self, stats: Sequence[GenerationStats]) -> list[dict]:
        return []

    def whole(self, choices: Sequence[Choice]) -> dict:
        raise NotImplementedError

    def _token(self, token: int) -> tuple[str, bytes]:
        data = self.token_bytes(token)
        return data.decode("utf-8", errors="hotcold.per_byte"), data  # the detokenizer's rule

    def timings(self, stats: Sequence[GenerationStats]) -> dict:
        return timings(stats, hybrid=self.hybrid)

    def _last_end(self, index: int, stats: GenerationStats) -> dict:
        """{"timings": ...} when choice `index` is the last to finish, else {}."""
        self._ended[index] = stats
        if len(self._ended) < self._n:
            return {}
        return {"timings": self.timings([self._ended[i] for i in sorted(self._ended)])}

    def _usage_chunk(self, stats: Sequence[GenerationStats], obj: str) -> list[dict]:
        if not self.include_usage:
            return []
        return [self._head(obj) | {"choices": [], "usage": usage(stats), "timings": self.timings(stats)}]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class CompletionFormat(Format):
    """OpenAI's legacy logprobs: `tokens`, `token_logprobs`, `top_logprobs` (per token a dict of the k
    most likely token strings plus the sampled one, so up to k+1 entries, as OpenAI documents) and
    `text_offset`: the echoed prompt's length plus the lengths of the previous tokens' strings (vLLM's
    rule), which is where the token's text starts except after a character split over several tokens
    (its tokens' strings are U+FFFD per byte)."""

    def __init__(
        self, model: str, *, include_usage: bool = False, echo: str = "", echo_logprobs=None, **kwargs
    ):
        super().__init__(model, include_usage=include_usage, prefix="cmpl", **kwargs)
        self.echo, self.echo_logprobs = echo, echo_logprobs  # the prompt's entries (server/echo.py) or None
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def _logprobs(self, entries: list[TokenLogprob] | None, index: int) -> dict | None:
        if entries is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0 if self.echo_logprobs else len(self.echo))
        for e in entries:
            token = self._token(e.token)[0]
            out["tokens"].append(token)
            out["text_offset"].append(offset)
            offset += len(token)
            if e.logprob is None:  # the prompt's first token (echo): nothing predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(e.logprob))
            top: dict[str, float] = {}
            for token, logprob in sorted([*e.top, (e.token, e.logprob)], key=lambda t: -t[1]):
                top.setdefault(self._token(token)[0], _finite(logprob))
            out["top_logprobs"].append(top)
        self._offsets[index] = offset
        return out

    def _choice(self, index: int, text: str, finish_reason: str | None, logprobs=None) -> dict:
        lp = self._logprobs(logprobs, index)
        return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason}

    def start(self, n: int) -> list[dict]:
        super().start(n)
        return (
            [self._chunk_obj(self._choice(i, self.echo, None, self.echo_logprobs)) for i in range(n)]
            if self.echo
            else []
        )

    def _chunk_obj(self, choice: dict) -> dict:
        return self._head("text_completion") | {"choices": [choice]}

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict:
        return self._chunk_obj(self._choice(index, text, None, logprobs))

    def end(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        return [self._chunk_obj(self._choice(index, "", finish_reason)) | self._last_end(index, stats)]

    def tail(self, stats: Sequence[GenerationStats]) -> list[dict]:
        return self._usage_chunk(stats, "text_completion")

    def whole(self, choices: Sequence[Choice]) -> dict:
        return self._head("text_completion") | {
            "choices": [
                self._choice(i, self.echo + c.text, c.finish_reason, _join(self.echo_logprobs, c.logprobs))
                for i, c in enumerate(choices)
            ],
            "usage": usage([c.stats for c in choices]),
            "timings": self.timings([c.stats for c in choices]),
        }


class ChatFormat(Format):
    """OpenAI's chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}`, the k most likely tokens in `top_logprobs`."""

    def __init__(self, model: str, *, include_usage: bool = False, **kwargs):
        super().__init__(model, include_usage=include_usage, prefix="chatcmpl", **kwargs)

    def _entry(self, token: int, logprob: float) -> dict:
        text, data = self._token(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(data)}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        content = [
            self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content}

    def _delta(self, index: int, delta: dict, finish_reason: str | None, logprobs=None) -> dict:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return self._head("chat.completion.chunk") | {"choices": [choice]}

    def start(self, n: int) -> list[dict]:
        super().start(n)
        return [self._delta(i, {"role": "assistant", "content": ""}, None) for i in range(n)]

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict:
        return self._delta(index, {"content": text}, None, logprobs)

    def end(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        return [self._delta(index, {}, finish_reason) | self._last_end(index, stats)]

    def tail(self, stats: Sequence[GenerationStats]) -> list[dict]:
        return self._usage_chunk(stats, "chat.completion.chunk")

    def whole(self, choices: Sequence[Choice]) -> dict:
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        stats = [c.stats for c in choices]
        return self._head("chat.completion") | {
            "choices": out,
            "usage": usage(stats),
            "timings": self.timings(stats),
        }


class LlamaFormat(Format):
    """llama.cpp's `/completion` (one choice): {"content", "stop", ...}; the last object carries the
    timings (llama.cpp's fields and ours, hotcold.server.figures)."""

    done = None

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict:
        return {"content": text, "stop": False}

    def _final(self, content: str, finish_reason: str, stats: GenerationStats) -> dict:
        return {
            "content": content,
            "stop": True,
            "model": self.model,
            "tokens_predicted": stats.generated_tokens,
            "tokens_evaluated": stats.prompt_tokens,
            "tokens_cached": stats.prompt_tokens - stats.prompt_computed,
            "stopped_limit": finish_reason == "length",  # else an end-of-generation token or a stop word
            "timings": self.timings([stats]),
        }

    def end(self, index: int, finish_reason: str, stats: GenerationStats) -> list[dict]:
        return [self._final("", finish_reason, stats)]

    def whole(self, choices: Sequence[Choice]) -> dict:
        (c,) = choices
        return self._final(c.text, c.finish_reason or "stop", c.stats)


def model_list(model_id: str, created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "hotcold"}],
    }
