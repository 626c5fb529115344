"""One generation path for the API, CLI, server and benchmarks: prefill, then one token per step over a
preallocated KV cache. `stream` yields text, stop strings and stats, `generate_step` the token ids of the same
loop (the per-request logic lives in generation.Generation, which the batched scheduler drives too)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import torch

from hotcold.kernels import cpu
from hotcold.ops import embed
from hotcold.runtime import decoders
from hotcold.runtime.generation import (
    PREFILL_CHUNK,
    Chunk,
    Generation,
    GenerationStats,
    NonFiniteLogits,
    common_prefix,
)
from hotcold.runtime.sampling import SamplingParams
from hotcold.runtime.state import Batch, HeadNeed, Observer, hot_masks
from hotcold.structured import Constraint
from hotcold.tokenizer.vocab import Tokenizer

__all__ = ["PREFILL_CHUNK", "Chunk", "Engine", "GenerationStats"]

log = logging.getLogger(__name__)


class Engine:
    """One sequence over a loaded model: its state (KV cache, neuron counts) is the engine's own, the model
    is shared and never written, so several engines (the server's slots, a program's threads) can run on
    one model at once. One engine runs one generation at a time."""

    def __init__(self, model, tokenizer: Tokenizer, ctx_size: int):
        self.model = model
        self.tokenizer = tokenizer
        self.ctx_size = ctx_size
        self.seq = model.new_sequence(ctx_size)
        plan = getattr(model, "plan", None)  # the families' DevicePlan (test doubles may have none)
        if plan is not None and plan.hot is not None:  # count what the hot copies compute (stats.neurons_hot)
            self.seq.hot = hot_masks([plan.hot_rows(i) for i in range(plan.n_layer)], model.config.n_ff)
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the cache, in order
        # the first `exact` of them hold the bits a forward of them in any other engine would write: rows
        # forwarded under cpu.GEMM_MIN_TOKENS at a time by the C kernels on the CPU, where a row's arithmetic
        # does not depend on the rest of its forward (hotcold.runtime.batching); another slot may copy them
        self.exact = 0
        self._rows_own_bits = bool(getattr(model, "rows_own_bits", False))  # decided at load (decoders.py)
        self.last_prefill_computed = 0

    def record(self, pos: int, ids: Sequence[int]) -> None:
        """One forward wrote the keys and values of `ids` at positions pos, pos + 1, ..."""
        self.cached_ids[pos:] = list(ids)
        own_bits = self._rows_own_bits and not (self.seq.dense or self.seq.observe)  # dense: another FFN
        if own_bits and len(ids) < cpu.GEMM_MIN_TOKENS and pos <= self.exact:
            self.exact = pos + len(ids)
        else:
            self.exact = min(self.exact, pos)

    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens."""
        self.cached_ids = self.cached_ids[:n]
        self.exact = min(self.exact, n)

    def forward(
        self, ids: Sequence[int], pos: int, *, last_only: bool, head_need: HeadNeed | None = None
    ) -> torch.Tensor:
        """The model over `ids` at positions pos, pos + 1, ... of this engine's sequence: their keys and values
        go into its cache (recorded here, the one place that says what the cache holds) and the logits come
        back, [len(ids), V] float32 (last_only: [1, V]). One token at a time goes through the decoder chosen at
        load (hotcold.runtime.decoders); prompt chunks through the family's forward. head_need: what the last logits are
        read for, where not all of them (state.HeadNeed): the head may leave rows that cannot matter at -inf."""
        tokens = torch.tensor(ids, dtype=torch.long)
        step = getattr(self.model, "static_step", None)  # a model all on the GPU: the CUDA-graph step
        seq = self.seq
        if (
            step is not None
            and len(ids) == 1
            and not (seq.dense or seq.observe or seq.keep_masks)
            and step.covers(seq.kv, pos)
        ):
            try:
                logits, fired = step.step(seq.kv, embed(self.model.token_embd, tokens)[0], pos)
            except Exception as exc:
                if step.steps:  # it has worked before: a real error, not a kernel that cannot run here
                    raise
                # the first step compiles the fused kernels and captures the graph; if this GPU or this
                # Triton cannot, the model decodes through the eager step from now on, and says why
                step.failure = f"{type(exc).__name__}: {exc}"
                decoders.fall_back(self.model, step.failure)
                return self.forward(ids, pos, last_only=last_only, head_need=head_need)
            for layer, (n, n_ff, sparse) in enumerate(zip(fired, step.n_ff, step.sparse, strict=True)):
                computed = n if sparse else n_ff
                seq.count(layer, computed, n_ff, computed if seq.hot_mask(layer, n_ff) is not None else 0)
            self.record(pos, ids)
            return logits[None]
        ctx = Batch.single(self.seq, pos, len(ids), head_need=head_need)
        logits = self.model.forward(tokens, ctx, last_only=last_only)
        self.record(pos, ids)
        return logits

    def copy_prefix(self, other: Engine, n: int) -> None:
        """Take the first n cached tokens of another engine of the same model (their keys and values, copied
        into this engine's cache): what a prefill of those tokens here would have written, bit for bit, since
        a row's arithmetic does not depend on the rest of its forward (for the first `other.exact` of them). For
        the `n` choices of one prompt, and for a prompt that shares its start with another slot's."""
        if other.model is not self.model or n > len(other.cached_ids) or n > self.ctx_size:
            raise ValueError("copy_prefix: another model's engine, or more tokens than it has cached")
        for dst, src in ((self.seq.kv.k, other.seq.kv.k), (self.seq.kv.v, other.seq.kv.v)):
            for d, s in zip(dst, src, strict=True):
                d[:n].copy_(s[:n])
        self.cached_ids = list(other.cached_ids[:n])
        self.exact = min(n, other.exact)

    def share_start(self, prompt: Sequence[int], others: Iterable[Engine]) -> None:
        """Copy in the longest start of `prompt` that one of `others` holds with exact bits (`exact`), where it
        is longer than what this engine holds: a prompt sharing a system prompt or a template with another
        sequence skips that part of its prefill, with the bits its own prefill would have written."""
        best, n = None, common_prefix(self.cached_ids, prompt)
        for other in others:
            if other is not self:
                k = min(common_prefix(other.cached_ids, prompt), other.exact, len(prompt) - 1)
                if k > n:
                    best, n = other, k
        if best is not None:
            self.copy_prefix(best, n)

    def check_length(self, n_tokens: int) -> None:
        if n_tokens > self.ctx_size:
            raise ValueError(
                f"prompt is {n_tokens} tokens, longer than the context size {self.ctx_size} (-c/--ctx-size)"
            )

    @torch.inference_mode()
    def logits(
        self, ids: Sequence[int], *, dense: bool = False, observe: Observer | None = None, after_chunk=None
    ) -> torch.Tensor:
        """Logits of every position from one full forward (no cache reuse). [len(ids), V] float32.
        dense: compute every FFN neuron (the reference); observe: see every layer's true activations
        (state.Observer; implies dense); after_chunk(seq): called after each prompt chunk's forward (its routing
        is then in seq.routing: placement/profile.py's expert counts)."""
        self.check_length(len(ids))
        if not ids:
            raise ValueError("logits() needs at least one token")
        self.truncate(0)
        seq = self.seq
        seq.dense, seq.observe = dense or observe is not None, observe
        try:
            out = []
            for s in range(0, len(ids), PREFILL_CHUNK):
                out.append(self.forward(ids[s : s + PREFILL_CHUNK], s, last_only=False))
                if after_chunk is not None:
                    after_chunk(seq)
        finally:
            seq.dense, seq.observe = False, None
        return torch.cat(out).float()

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Run the prompt, reusing the cached prefix it shares with the last sequence; last position's logits."""
        self.check_length(len(ids))
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        start = min(
            common_prefix(self.cached_ids, ids), len(ids) - 1
        )  # recompute at least the last token to get its logits
        self.truncate(start)
        self.last_prefill_computed = len(ids) - start
        logits = None
        for s in range(start, len(ids), PREFILL_CHUNK):
            logits = self.forward(ids[s : s + PREFILL_CHUNK], s, last_only=True)
        return logits[-1]

    def generate_step(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Sampled token ids, one at a time, until the context is full (the caller stops earlier): the
        Generation that `stream` runs, with no stop strings and end tokens sampled like any other."""
        gen = Generation(self, prompt_ids, max_tokens=self.ctx_size, params=params, ignore_eos=True)
        for _ in self._run(gen):
            yield gen.last_token  # (gen.tokens copies the whole history: not once a token)

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 128,
        params: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        constraint: Constraint | None = None,
    ) -> Iterator[Chunk]:
        """Text as it is generated. Text that could be the start of a stop string is held back until it
        is known not to be one; the final chunk has finish_reason and the stats. `constraint`: structured
        output (hotcold.structured)."""
        gen = Generation(
            self,
            prompt_ids,
            max_tokens=max_tokens,
            params=params,
            stop=stop,
            ignore_eos=ignore_eos,
            constraint=constraint,
        )
        yield from gen.drain()
        for _ in self._run(gen):
            yield from gen.drain()

    def _run(self, gen: Generation) -> Iterator[None]:
        """Run `gen` to its end on this engine alone: each forward it wants; yields after each sampled token."""
        if gen.stats.generated_tokens:  # its first token came with the prompt (prefilled)
            yield
        while not gen.done:
            ids, pos = gen.want()
            with torch.inference_mode():
                logits = self.forward(ids, pos, last_only=True, head_need=gen.head_need)[-1]
            try:
                gen.take(logits)
            except NonFiniteLogits as exc:
                raise NonFiniteLogits(f"{exc}; {self.locate_nonfinite(gen.tokens)}") from None
            if not gen.prefilling:
                yield

    def locate_nonfinite(self, ids: Sequence[int]) -> str:
        """Where NaN/inf first appear in a dense forward of `ids`, in words: the first layer whose FFN input or
        activations are not finite (state.Observer sees both). On the error path only: it costs a forward."""
        bad: dict[int, str] = {}  # layer -> what is not finite there (every prefill chunk visits every layer)

        def observe(layer: int, h: torch.Tensor, _p: torch.Tensor, a: torch.Tensor) -> None:
            if layer not in bad and not bool(torch.isfinite(h).all()):
                bad[layer] = "input"
            elif layer not in bad and not bool(torch.isfinite(a).all()):
                bad[layer] = "activations"

        try:
            logits = self.logits(list(ids), observe=observe)
        except Exception as exc:  # the diagnosis must never hide the error it explains
            return f"locating the first non-finite layer failed ({type(exc).__name__}: {exc})"
        if bad:
            i = min(bad)
            if bad[i] == "activations":
                return (
                    f"the first non-finite values are layer {i}'s FFN activations (blk.{i}.ffn_up / ffn_gate)"
                )
            source = f"blk.{i}'s attention" + (f" or blk.{i - 1}'s FFN" if i > 0 else "")
            return f"the first non-finite values are layer {i}'s FFN input (from {source})"
        if not bool(torch.isfinite(logits).all()):
            return (
                "every layer's FFN input and activations are finite: the last layer's FFN output, the output norm "
                "or the output head (output.weight) is not"
            )
        return "a dense forward of the same tokens is finite: the sparse path (predictors fc1 / fc2) is not"
