"""hotcold perplexity -m MODEL -f text.txt [--dense] [-c CTX] [--json]

Windows: the text's tokens are cut into non-overlapping windows of CTX tokens, each BOS + the next CTX-1
text tokens (every text token is in exactly one window). As llama.cpp's perplexity tool does, only the
second half of each window is scored: the predictions at positions CTX/2 .. CTX-2 of the tokens that
follow them, so every scored token has at least CTX/2 tokens of context. A shorter last window is dropped,
unless it is the only one (then its own length plays CTX).

Sparse mode (a PowerInfer file without --dense) runs every window twice: once densely, where an observer
compares each layer's predictor mask with the true firing mask on the same inputs (recall, precision,
selected / truly firing), and once sparsely, which gives the sparse perplexity and the firing rate
actually computed. The dense pass's perplexity is reported beside it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence

import torch

from hotcold.cli import add_model_args, load_from_args


def add_args(p) -> None:
    add_model_args(p)
    p.add_argument("-f", "--file", required=True, help="text to score (UTF-8)")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many text tokens")
    p.add_argument("--json", action="store_true", help="print JSON")


def scoring_windows(ids: Sequence[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    from hotcold.placement.profile import token_windows

    windows = token_windows(ids, ctx, bos_id)
    if len(windows) > 1 and len(windows[-1]) < ctx:
        windows = windows[:-1]
    if len(windows[0]) < 3:
        raise ValueError(f"the text has {len(ids)} token(s): too few to score (need at least 2 after BOS)")
    return windows


def window_nll(logits: torch.Tensor, window: Sequence[int]) -> tuple[float, int]:
    """Sum of -log p(token j+1 | tokens ..j) for j in n/2 .. n-2, and how many tokens that is."""
    n = len(window)
    first = n // 2
    targets = torch.tensor(window[first + 1 :], dtype=torch.long)
    logp = torch.log_softmax(logits[first : n - 1].double(), dim=-1)
    return float(-logp.gather(1, targets[:, None]).sum()), len(targets)


class MaskAgreement:
    """Per layer: truly firing, selected, and both, summed over the dense pass's tokens."""

    def __init__(self, predictors):
        n_layer = len(predictors)
        self.predictors = predictors
        self.firing = [0] * n_layer
        self.selected = [0] * n_layer
        self.hits = [0] * n_layer
        self.entries = [0] * n_layer

    def observe(self, i: int, _x: torch.Tensor, p: torch.Tensor, a: torch.Tensor) -> None:
        """A state.Observer: the layer's predictor mask on the same input against the true firing mask."""
        truth = (a != 0).cpu()
        chosen = self.predictors[i](p).cpu()
        self.firing[i] += int(truth.sum())
        self.selected[i] += int(chosen.sum())
        self.hits[i] += int((truth & chosen).sum())
        self.entries[i] += truth.numel()

    def layer(self, i: int) -> dict:
        return {
            "layer": i,
            "true_firing_rate": self.firing[i] / self.entries[i],
            "selected_rate": self.selected[i] / self.entries[i],
            "recall": self.hits[i] / self.firing[i] if self.firing[i] else 1.0,
            "precision": self.hits[i] / self.selected[i] if self.selected[i] else 1.0,
            "selection_ratio": self.selected[i] / self.firing[i] if self.firing[i] else 0.0,
        }


def perplexity(llm, ids: Sequence[int], *, ctx: int | None = None, progress: bool = False) -> dict:
    """Perplexity of `ids` (text tokens without BOS) under `llm`; in sparse mode also the dense pass's
    perplexity and the predictors' agreement with the true masks (see the module docstring)."""
    from tqdm import tqdm

    from hotcold.placement.profile import window_ctx

    ctx = window_ctx(ctx, llm.config.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"window of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    windows = scoring_windows(ids, ctx, llm.tokenizer.bos_id)
    layers = getattr(llm.loaded.model, "layers", [])
    sparse = not llm.loaded.dense
    if sparse and not all(getattr(layer.ffn, "predictor", None) for layer in layers):
        raise ValueError(f"{llm.path}: sparse perplexity needs a predictor in every layer's FFN (not MoE)")
    agreement = MaskAgreement([layer.ffn.predictor for layer in layers] if sparse else [])
    counts = llm.engine.seq.counts  # this model's own sequence: per-layer neurons computed / total

    def snapshot() -> list[tuple[int, int]]:
        return [(c.computed, c.total) for c in counts]

    before = snapshot()
    nll = dense_nll = 0.0
    count = 0
    start = time.perf_counter()
    for window in tqdm(windows, desc="perplexity", unit="window", disable=not progress):
        if sparse:
            c0 = snapshot()  # the dense pass is not part of the computed rate
            dense_nll += window_nll(llm.engine.logits(window, observe=agreement.observe), window)[0]
            before = [(b[0] + c[0] - z[0], b[1] + c[1] - z[1]) for b, z, c in zip(before, c0, snapshot())]
        total, n = window_nll(llm.logits(window), window)
        nll += total
        count += n
    result = {
        "model": str(llm.path),
        "mode": "sparse" if sparse else "dense",
        "ctx": len(windows[0]),
        "windows": len(windows),
        "tokens_scored": count,
        "scoring": "second half of each window (llama.cpp style)",
        "perplexity": math.exp(nll / count),
        "seconds": time.perf_counter() - start,
    }
    if sparse:
        after = snapshot()
        per_layer = []
        for i in range(len(layers)):
            stats = agreement.layer(i)
            computed, total = after[i][0] - before[i][0], after[i][1] - before[i][1]
            stats["computed_rate"] = computed / total if total else 0.0
            per_layer.append(stats)
        result.update(
            dense_perplexity=math.exp(dense_nll / count),
            firing_rate=sum(a[0] - b[0] for a, b in zip(after, before))
            / max(1, sum(a[1] - b[1] for a, b in zip(after, before))),
            true_firing_rate=sum(agreement.firing) / sum(agreement.entries),
            recall_mean=sum(s["recall"] for s in per_layer) / len(per_layer),
            precision_mean=sum(s["precision"] for s in per_layer) / len(per_layer),
            selection_ratio=sum(agreement.selected) / max(1, sum(agreement.firing)),
            layers=per_layer,
        )
        result["perplexity_increase"] = result["perplexity"] / result["dense_perplexity"] - 1
    return result


def run(args) -> int:
    from hotcold.placement.profile import corpus_tokens, read_corpus

    text = read_corpus(args.file)
    llm = load_from_args(args)
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=args.max_tokens, source=args.file)
    result = perplexity(llm, ids, ctx=args.ctx_size, progress=not args.json)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['mode']} perplexity {result['perplexity']:.4f} over {result['tokens_scored']} tokens "
        f"({result['windows']} windows of {result['ctx']}, second half scored; {result['seconds']:.1f} s)"
    )
    if result["mode"] == "sparse":
        print(
            f"dense perplexity {result['dense_perplexity']:.4f} (sparse {100 * result['perplexity_increase']:+.2f}%)"
        )
        print(
            f"FFN neurons computed {100 * result['firing_rate']:.1f}%, truly firing {100 * result['true_firing_rate']:.1f}%"
            f"; predictor recall {result['recall_mean']:.4f}, precision {result['precision_mean']:.4f} "
            f"(layer means), selected {result['selection_ratio']:.2f}x the firing neurons"
        )
        print("layer  firing%  computed%  recall  precision  selected/firing")
        for s in result["layers"]:
            print(
                f"{s['layer']:5d}  {100 * s['true_firing_rate']:7.2f}  {100 * s['computed_rate']:9.2f}"
                f"  {s['recall']:.4f}  {s['precision']:9.4f}  {s['selection_ratio']:15.3f}"
            )
    return 0
