"""One request's generation as a state machine: the caller runs the forwards, so one forward can serve
many generations (continuous batching, hotcold.runtime.batching) or just this one (Engine.stream).

    gen = Generation(engine, prompt_ids, max_tokens=..., params=..., stop=...)
    while not gen.done:
        ids, pos = gen.want()            # the next prefill chunk, or the last sampled token
        gen.take(logits of the last of those rows)
        for chunk in gen.drain(): ...    # text, held back while it may be the start of a stop string

Each generation samples with its own generator (its seed) from its own logits, so its tokens do not
depend on what else ran in the same forward.

Log-probabilities (`logprobs=k`, None: none computed, the hot path does no extra work): every sampled
token but an end-of-generation one gets a `TokenLogprob`, from `log_softmax` of the model's raw logits
(before the repeat penalty, temperature and the top-k/p and min-p filters: what OpenAI and vLLM report
by default), with the k most likely tokens of that distribution. Entries are per token, text is per
chunk: a chunk carries the entries of the tokens sampled since the previous chunk, whose text may still
be partly held back (a possible stop string, an unfinished UTF-8 character) for a later chunk. Tokens
that complete a stop string keep their entries though their text is cut.

Structured output (`constraint`, hotcold.structured): the generation keeps its own matcher, and every
sampled token comes from the logits with the tokens its grammar does not allow at -inf (log-probabilities
stay those of the raw logits). The next mask is computed on a worker thread as soon as a token is taken,
so it overlaps the next forward. The generation ends ("stop") when the grammar is complete or an end
token is sampled (with a constraint, whatever `ignore_eos` says: the grammar decides when it may end).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hotcold.runtime.sampling import GREEDY_TEMPERATURE, SamplingParams, make_generator, sample
from hotcold.runtime.state import HeadNeed
from hotcold.structured import Constraint, Matcher
from hotcold.tokenizer.vocab import StreamingDetokenizer

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds the activation memory of long prompts


class NonFiniteLogits(RuntimeError):
    """The model computed NaN or infinite logits: weights that hold NaN/inf, or values past the range of the
    type they are computed in. Sampling over them would pick token 0 ("⁇") for ever; a RuntimeError, since the
    model, not the request, is at fault (Engine.stream adds where the values first go bad)."""


def check_finite(logits: torch.Tensor, at: str, *, screened: bool = False) -> None:
    """NonFiniteLogits when `logits` hold NaN or inf; one pass over [V] values, negligible beside a forward.
    screened: a step whose head computed only the rows that can matter (-inf elsewhere): the head checked those
    rows already (it computes the whole head where one is not finite), so nothing is left to check."""
    if screened or bool(torch.isfinite(logits).all()):
        return
    kind = "NaN" if bool(torch.isnan(logits).any()) else "infinite"
    raise NonFiniteLogits(
        f"the model's logits are {kind} {at}: its weights hold NaN/inf values or its computation overflows"
    )


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    prompt_computed: int = 0  # prompt tokens actually run (the rest came from the prefix cache)
    generate_seconds: float = 0.0
    neurons_computed: int = 0  # FFN neurons computed for this request (its prefill and decode), all layers
    neurons_total: int = 0  # the FFN neurons of those forwards, computed or not
    neurons_hot: int = 0  # of neurons_computed: by hot copies on the fast device (hybrid layers; else 0)
    mask_wait_seconds: float = 0.0  # structured output: time sampling waited for grammar masks
    # under a RAM budget: storage.rows.StorageStats counts over this request's time (the model's: a concurrent
    # request's reads are in them too); None without one
    storage: dict | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_computed / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        # the first generated token comes from the prefill logits, so decode time covers the rest
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.generate_seconds if self.generate_seconds > 0 else 0.0

    @property
    def firing_rate(self) -> float:
        return self.neurons_computed / self.neurons_total if self.neurons_total else 1.0

    @property
    def hot_share(self) -> float:
        """Share of the computed neurons that ran on the fast device (the GPU)."""
        return self.neurons_hot / self.neurons_computed if self.neurons_computed else 0.0


@dataclass
class TokenLogprob:
    """One sampled token's log-probability under the model's raw logits, and the `k` most likely tokens
    of that distribution (most likely first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Chunk:
    text: str
    token: int | None = None
    finish_reason: str | None = None  # "stop" (eos or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # with `logprobs` asked for: the tokens since the last chunk


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Generation:
    """A generation on one engine (its sequence state and KV cache); see the module docstring."""

    def __init__(
        self,
        engine,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 128,
        params: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        prefilled: torch.Tensor | None = None,
    ):
        """prefilled: the logits [V] of the prompt's last token when the engine's cache already holds the
        whole prompt (copied from a sibling that ran it: Engine.copy_prefix); the first token is sampled
        from them at once and the prompt is not run again."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        engine.check_length(len(prompt_ids))
        self.engine = engine
        self.prompt = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        self.stop = [s for s in stop if s]
        self.ignore_eos = ignore_eos
        self.stats = GenerationStats()
        self.done = False
        self.finish_reason: str | None = None
        self._out: list[Chunk] = []
        self._pending = ""  # text not yet emitted (may hold the start of a stop string)
        self.logprobs = logprobs
        self._lp: list[TokenLogprob] = []  # entries not yet handed out in a chunk
        self._matcher: Matcher | None = None
        if constraint is not None and max_tokens > 0:  # ValueError for a grammar llguidance refuses
            self._matcher = Matcher(engine.tokenizer, constraint)
            self._matcher.start()  # the first mask, while the prompt runs
        if max_tokens == 0:
            self._finish("length", flush=False)
            return
        if not self.prompt:
            raise ValueError("the prompt is empty (no tokens)")
        self._detok = StreamingDetokenizer(engine.tokenizer, prompt_ids=self.prompt)  # keeps the first space
        self._history = list(self.prompt)
        self._generator = make_generator(params.seed)
        self._before = engine.seq.neuron_totals()  # this sequence's own counts: nobody else adds to them
        self._hot_before = engine.seq.hot_total()
        storage = getattr(engine.model, "storage_stats", None)
        self._storage_before = None if storage is None else storage.snapshot()
        # reuse the cached prefix this prompt shares with the engine's last sequence; recompute at least the
        # last prompt token to get its logits
        self.prompt_logits: torch.Tensor | None = None  # the prompt's last logits, once prefilled
        whole = prefilled is not None and engine.cached_ids[: len(self.prompt)] == self.prompt
        if prefilled is not None and not whole:
            raise ValueError("prefilled logits need the whole prompt in the engine's cache")
        start = (
            len(self.prompt)
            if whole
            else min(common_prefix(engine.cached_ids, self.prompt), len(self.prompt) - 1)
        )
        self.stats.prompt_tokens = len(self.prompt)
        self._start_at(start)
        self._t0 = time.perf_counter()
        self._decode_t0 = 0.0
        if whole:
            self._first_token(prefilled, self._t0)

    @property
    def prefill_not_begun(self) -> bool:
        """Its prompt still to prefill, no forward of it run yet."""
        return not self.done and self.prefilling and self._next == self._first

    def take_cached(self) -> None:
        """Before its first prefill forward: start after what its engine's cache now holds of the prompt (keys
        and values another slot's copy brought in since)."""
        if not self.prefill_not_begun:
            return
        start = min(common_prefix(self.engine.cached_ids, self.prompt), len(self.prompt) - 1)
        if start > self._next:
            self._start_at(start)

    def _start_at(self, start: int) -> None:
        """The prompt's prefill begins at `start`: the engine keeps that much of its cache."""
        self.engine.truncate(start)
        self.engine.last_prefill_computed = self.stats.prompt_computed = len(self.prompt) - start
        self._next = self._first = start  # next prompt position to prefill; the first

    @property
    def prefilling(self) -> bool:
        return self._next < len(self.prompt)

    @property
    def head_need(self) -> HeadNeed | None:
        """What the next forward's logits are read for (state.HeadNeed), or None where every one of them: a decode
        step (the prompt's last logits may be shared with other requests) sampled greedily (its top 1) or with
        top-k (its top k), the repeat penalty's window set aside; logprobs, a grammar, or sampling without top-k
        read every logit."""
        p = self.params
        if self.prefilling or self.logprobs is not None or self._matcher is not None:
            return None
        top = 1 if p.temperature < GREEDY_TEMPERATURE else p.top_k or 0
        if top <= 0:
            return None
        keep = ()
        if p.repeat_penalty != 1.0:  # sample()'s window, sliced the same way
            keep = tuple(sorted(set(self._history[-p.repeat_last_n :])))
        return HeadNeed(top, (keep,))

    def want(self) -> tuple[list[int], int]:
        """(token ids, first position) of the next forward this generation needs."""
        if self.done:
            raise RuntimeError("the generation is finished")
        if self.prefilling:
            s = self._next
            return self.prompt[s : s + PREFILL_CHUNK], s
        return [self.last_token], len(self._history) - 1

    def take(self, logits: torch.Tensor) -> None:
        """The logits [V] of the last row of what `want()` asked for, once that forward has run."""
        ids, pos = self.want()
        self.engine.record(pos, ids)
        now = time.perf_counter()
        if self.prefilling:
            self._next = pos + len(ids)
            if not self.prefilling:
                self._first_token(logits, now)
            return
        self.stats.generate_seconds = now - self._decode_t0
        self._sample(logits)

    def _first_token(self, logits: torch.Tensor, now: float) -> None:
        """The prompt is in the cache and `logits` are its last token's: sample the first token."""
        self.prompt_logits = logits
        self.stats.prompt_seconds = now - self._t0
        self._decode_t0 = now
        self._sample(logits)

    @property
    def last_token(self) -> int:
        """The token the next decode forward runs: the last one sampled (no copy of the history)."""
        return self._history[-1]

    @property
    def tokens(self) -> list[int]:
        """The prompt and the tokens sampled so far (the input of the next forward)."""
        return list(getattr(self, "_history", self.prompt))

    def _sample(self, logits: torch.Tensor) -> None:
        at = f"at generated token {self.stats.generated_tokens + 1}"
        check_finite(logits, at, screened=self.engine.seq.head_screened)
        masked = logits
        if self._matcher is not None:
            masked = self._matcher.apply(logits)
            self.stats.mask_wait_seconds = self._matcher.mask_seconds
        self._accept(sample(masked, self.params, self._history, self._generator), logits)

    def drain(self) -> list[Chunk]:
        """The chunks produced since the last drain; the last one of a finished generation has its
        finish_reason and stats."""
        out, self._out = self._out, []
        return out

    def _accept(self, token: int, logits: torch.Tensor) -> None:
        s = self.stats
        self._history.append(token)
        s.generated_tokens += 1
        m = self._matcher
        if (not self.ignore_eos or m is not None) and self.engine.tokenizer.is_eog(token):
            return self._finish("stop", flush=False)
        if m is not None:
            m.consume(token)  # and starts the next mask, which the next forward hides
        if self.logprobs is not None:
            self._lp.append(self._logprob(logits, token))
        self._pending += self._detok.add(token)
        hit = _find_stop(self._pending, self.stop)
        if hit is not None:
            self._pending = self._pending[:hit]
            return self._finish("stop", flush=False)
        safe = len(self._pending) - _stop_prefix_len(self._pending, self.stop)
        if safe > 0:
            self._out.append(Chunk(self._pending[:safe], token, None, s, self._take_logprobs()))
            self._pending = self._pending[safe:]
        if m is not None and m.stopped:  # the grammar is complete: nothing but an end token may follow
            self._finish("stop", flush=True)
        elif (
            s.generated_tokens >= self.max_tokens
            or len(self.prompt) + s.generated_tokens >= self.engine.ctx_size
        ):
            self._finish("length", flush=True)

    def _finish(self, reason: str, *, flush: bool) -> None:
        if flush:
            self._pending += self._detok.flush()
            hit = _find_stop(self._pending, self.stop)
            if hit is not None:
                self._pending, reason = self._pending[:hit], "stop"
        if self.max_tokens > 0:
            after = self.engine.seq.neuron_totals()
            self.stats.neurons_computed = after[0] - self._before[0]
            self.stats.neurons_total = after[1] - self._before[1]
            self.stats.neurons_hot = self.engine.seq.hot_total() - self._hot_before
            if self._storage_before is not None:
                now = self.engine.model.storage_stats.snapshot()
                self.stats.storage = {k: now[k] - self._storage_before[k] for k in now}
        self.done, self.finish_reason = True, reason
        self._out.append(Chunk(self._pending, None, reason, self.stats, self._take_logprobs()))
        self._pending = ""

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        lp = torch.log_softmax(logits.float(), -1)
        top: list[tuple[int, float]] = []
        if self.logprobs:
            values, ids = torch.topk(lp, min(self.logprobs, lp.shape[-1]))
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token, float(lp[token]), top)

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        out, self._lp = self._lp, []
        return out


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stop if s in text]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
