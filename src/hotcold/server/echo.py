"""Log-probabilities of an echoed prompt (`echo` with `logprobs` on /v1/completions, what evaluation
harnesses use to score text): one full forward over the prompt, `log_softmax` of each position's raw
logits at the next prompt token, with its k most likely alternatives; the first token has none (null
on the wire, as OpenAI and vLLM send)."""

from __future__ import annotations

import torch

from hotcold.runtime.generation import TokenLogprob


def prompt_logprobs(logits: torch.Tensor, ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [len(ids), V] of one forward over ids -> an entry per prompt token (the first: logprob None)."""
    lp = torch.log_softmax(logits.float(), -1)
    out = [TokenLogprob(ids[0], None, [])]  # type: ignore[arg-type]
    for j in range(1, len(ids)):
        row = lp[j - 1]
        top = torch.topk(row, k) if k else None
        alts = [] if top is None else [(int(t), float(v)) for v, t in zip(top.values, top.indices)]
        out.append(TokenLogprob(ids[j], float(row[ids[j]]), alts))
    return out
