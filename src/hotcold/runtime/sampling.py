"""Sampling as small pure functions over one logits vector [V] (float32)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hotcold import validate

GREEDY_TEMPERATURE = 1e-6  # below it sampling is greedy (0 is; tiny temperatures would overflow the softmax)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy, deterministic
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        # the shared rules (hotcold.validate), so the CLI, the API and the server refuse the same values
        for name in ("temperature", "repeat_penalty", "repeat_last_n"):
            validate.check(name, getattr(self, name))
        for name in ("top_k", "top_p", "min_p", "seed"):
            validate.check_optional(name, getattr(self, name))


def apply_repeat_penalty(logits: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """llama.cpp's rule: divide positive logits of recently seen tokens by the penalty, multiply negative ones."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    out = logits.clone()
    seen = out[ids]
    out[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[torch.topk(logits, k).indices] = True  # exactly k, as llama.cpp keeps, even with ties
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
    drop_sorted = (
        cumulative - torch.softmax(sorted_logits, -1) >= p
    )  # mass before this token already reaches p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, -1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    recent: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    logits = apply_repeat_penalty(
        logits.float(), recent[-params.repeat_last_n :] if recent else (), params.repeat_penalty
    )
    if params.temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p:
        logits = min_p_filter(logits, params.min_p)
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator:
    """A generator seeded with `seed` (an integer in [0, 2**64); ValueError otherwise), or randomly for None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(validate.check("seed", seed))
    return gen
