"""Continuous batching: one forward for every running generation.

Each step runs every decoding generation's next token in one forward (the weights are read once for
all of them; in the sparse FFN the rows fired by any of the tokens are read once), plus the next chunk
of the first prefilling generation (chunked prefill: a long prompt holds the others up for one chunk
at a time, never for its whole prefill), plus the next chunks of the prefilling generations after it
that still fit in the forward (a burst of short prompts prefills in one step, not one step each). A prompt
not yet begun whose start an earlier prompt of the batch is still to compute (at least SHARE_WAIT_MIN tokens
past what its own cache holds) waits for it and then copies those keys and values (`share_starts`): requests
from one template or with one system prompt that arrive together compute their common start once.

Output does not depend on the batch. Below `cpu.GEMM_MIN_TOKENS` rows every CPU kernel computes each
row with the same arithmetic whatever the other rows are (the C kernels' contract), attention runs per
sequence over its own cache, and sampling uses each generation's own generator; so decode rows go in
groups under that size, and a prefill chunk joins them only when the whole forward stays under it (a
larger chunk runs alone, as it would without other requests). The GPU paths do not promise this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hotcold.kernels import cpu
from hotcold.runtime.generation import Generation, common_prefix
from hotcold.runtime.state import Batch, HeadNeed

MAX_ROWS = cpu.GEMM_MIN_TOKENS - 1  # rows per forward for which every row's bits are its own
# Tokens of a start that an earlier prompt will compute, from which a prompt waits to copy them: computing 8
# prompt rows costs about what the waiting prompt's first token loses by starting a step later.
SHARE_WAIT_MIN = 8


def waits_for_shared_start(gen: Generation, earlier: Sequence[Generation]) -> bool:
    """Whether `gen`, its prompt not begun, should skip this step: one of the `earlier` generations (earlier in
    the batch, so the first one never waits) is still prefilling a prompt that shares at least SHARE_WAIT_MIN
    tokens of start with gen's beyond what gen's cache already holds; once computed, gen copies them."""
    if not gen.prefill_not_begun:
        return False
    have = gen.want()[1]
    return any(h.prefilling and common_prefix(h.prompt, gen.prompt) - have >= SHARE_WAIT_MIN for h in earlier)


def step(model, generations: Sequence[Generation]) -> None:
    """Advance every generation that is not done by one forward's worth: decoders by one token, the
    first prefilling one by one chunk, later prefilling ones by one chunk where it fits in a forward and
    they are not waiting for an earlier one's shared start. Chunks pile up in each generation (`drain()`)."""
    live = [g for g in generations if not g.done]
    decoding = [g for g in live if not g.prefilling]
    groups = [decoding[i : i + MAX_ROWS] for i in range(0, len(decoding), MAX_ROWS)]
    rows = [len(group) for group in groups]
    prefilling = [g for g in live if g.prefilling]
    for j, gen in enumerate(prefilling):
        if waits_for_shared_start(gen, prefilling[:j]):
            continue
        n = len(gen.want()[0])
        if groups and rows[-1] + n <= MAX_ROWS:
            groups[-1].append(gen)
            rows[-1] += n
        elif j == 0:  # the first prefill always advances: alone if it does not fit, as with no other request
            groups.append([gen])
            rows.append(n)
    for group in groups:
        run(model, group)


@torch.inference_mode()
def run(model, group: Sequence[Generation]) -> None:
    """One forward over the generations' next inputs; each takes its own last row's logits."""
    wants = [g.want() for g in group]
    if len(group) == 1:  # one generation: its engine's own path (on a GPU, the fixed-shape decode step)
        ids, pos = wants[0]
        group[0].take(group[0].engine.forward(ids, pos, last_only=True, head_need=group[0].head_need)[-1])
        return
    tokens = torch.tensor([t for ids, _ in wants for t in ids], dtype=torch.long)
    ctx = Batch(
        [g.engine.seq for g in group],
        [pos for _, pos in wants],
        [len(ids) for ids, _ in wants],
        head_need=HeadNeed.of_rows([g.head_need for g in group]),
    )
    logits = model.forward(tokens, ctx, last_only=True)  # [len(group), V]
    for j, g in enumerate(group):
        g.take(logits[j])


def share_starts(generations: Sequence[Generation], others: Sequence = ()) -> None:
    """Before a step: each generation whose prompt has not begun copies the longest start of it that another
    one's engine, or one of the engines `others` (a server's free slots), holds with exact bits
    (Engine.share_start), and prefills only the rest: prompts sharing a system prompt or a template, prefilled
    in different steps, compute it once."""
    engines = [g.engine for g in generations] + list(others)
    for g in generations:
        if g.prefill_not_begun:
            g.engine.share_start(g.prompt, engines)
            g.take_cached()
