"""hotcold perplexity -m MODEL -f text.txt [--dense] [-c CTX] [--json]

llama.cpp's protocol (its `perplexity` tool, which PowerInfer's is), so the figures compare:
- the text is tokenized once, with BOS first when the vocabulary adds one (`tokenizer.ggml.add_bos_token`),
  control-token spellings in the text staying plain text;
- that token stream is cut into chunks of exactly CTX tokens (chunk i is tokens i*CTX .. i*CTX+CTX-1);
  the tokens after the last whole chunk are dropped; a text shorter than one chunk is refused;
- when the vocabulary adds BOS, each chunk's first token is replaced by BOS (the replaced token is not
  scored anywhere);
- each chunk is evaluated from an empty cache, and the predictions at positions CTX/2 .. CTX-2 are scored
  (of the chunk's tokens CTX/2+1 .. CTX-1): every scored token has at least CTX/2 tokens of context.
llama.cpp refuses a text of fewer than 2*CTX tokens; here one whole chunk is enough.

Sparse mode (a PowerInfer file without --dense) runs every chunk twice: once densely, where an observer
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
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="use at most this many text tokens (then cut into chunks)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def scoring_chunks(ids: Sequence[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """llama.cpp's chunks (see the module docstring): `ids` are the text's tokens without BOS; bos_id the
    BOS to put first and in each chunk's first place, None when the vocabulary adds none."""
    if ctx < 3:
        raise ValueError(f"the context size (-c/--ctx-size) must be >= 3 tokens to score any, got {ctx}")
    stream = ([bos_id] if bos_id is not None else []) + list(ids)
    n_chunks = len(stream) // ctx
    if n_chunks == 0:
        raise ValueError(
            f"the text has {len(ids)} token(s): too few to score, a chunk is {ctx} tokens"
            f"{' with BOS' if bos_id is not None else ''} (use a longer text or a smaller -c)"
        )
    chunks = [stream[i * ctx : (i + 1) * ctx] for i in range(n_chunks)]
    if bos_id is not None:
        for chunk in chunks:
            chunk[0] = bos_id
    return chunks


def chunk_nll(logits: torch.Tensor, chunk: Sequence[int]) -> tuple[float, int]:
    """Sum of -log p(token j+1 | tokens ..j) for j in n/2 .. n-2, and how many tokens that is."""
    n = len(chunk)
    first = n // 2
    targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
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
    """Perplexity of `ids` (text tokens without BOS) under `llm` by llama.cpp's protocol; in sparse mode
    also the dense pass's perplexity and the predictors' agreement with the true masks (module docstring)."""
    from tqdm import tqdm

    from hotcold.placement.profile import window_ctx

    ctx = window_ctx(ctx, llm.config.n_ctx_train)
    if ctx > llm.ctx_size:
        raise ValueError(f"chunk of {ctx} tokens is longer than the model's context size {llm.ctx_size}")
    tok = llm.tokenizer
    chunks = scoring_chunks(ids, ctx, tok.bos_id if tok.add_bos else None)
    layers = getattr(llm.loaded.model, "layers", [])
    sparse = not llm.loaded.dense
    # a `hotcold sparsify` file: thresholds instead of predictors, so no predictor agreement to report
    thresholded = sparse and all(getattr(layer.ffn, "threshold", None) is not None for layer in layers)
    if sparse and not thresholded and not all(getattr(layer.ffn, "predictor", None) for layer in layers):
        raise ValueError(f"{llm.path}: sparse perplexity needs a predictor in every layer's FFN (not MoE)")
    agreement = MaskAgreement([layer.ffn.predictor for layer in layers] if sparse and not thresholded else [])
    counts = llm.engine.seq.counts  # this model's own sequence: per-layer neurons computed / total

    def snapshot() -> list[tuple[int, int]]:
        return [(c.computed, c.total) for c in counts]

    before = snapshot()
    nll = dense_nll = 0.0
    count = 0
    start = time.perf_counter()
    for chunk in tqdm(chunks, desc="perplexity", unit="chunk", disable=not progress):
        if sparse:
            c0 = snapshot()  # the dense pass is not part of the computed rate
            observe = None if thresholded else agreement.observe
            dense_nll += chunk_nll(llm.engine.logits(chunk, dense=True, observe=observe), chunk)[0]
            before = [(b[0] + c[0] - z[0], b[1] + c[1] - z[1]) for b, z, c in zip(before, c0, snapshot())]
        total, n = chunk_nll(llm.logits(chunk), chunk)
        nll += total
        count += n
    result = {
        "model": str(llm.path),
        "mode": "sparse" if sparse else "dense",
        "ctx": ctx,
        "chunks": len(chunks),
        "tokens_scored": count,
        "scoring": "llama.cpp: chunks of ctx tokens, first token BOS, positions ctx/2 .. ctx-2 scored",
        "perplexity": math.exp(nll / count),
        "seconds": time.perf_counter() - start,
    }
    if thresholded:
        after = snapshot()
        computed = sum(a[0] - b[0] for a, b in zip(after, before))
        result.update(
            dense_perplexity=math.exp(dense_nll / count),
            firing_rate=computed / max(1, sum(a[1] - b[1] for a, b in zip(after, before))),
        )
        result["perplexity_increase"] = result["perplexity"] / result["dense_perplexity"] - 1
    elif sparse:
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
        f"({result['chunks']} chunks of {result['ctx']}, second half scored; {result['seconds']:.1f} s)"
    )
    if result["mode"] == "sparse":
        print(
            f"dense perplexity {result['dense_perplexity']:.4f} (sparse {100 * result['perplexity_increase']:+.2f}%)"
        )
        if "layers" not in result:  # thresholded (hotcold sparsify): no predictors to grade
            print(f"FFN neurons computed {100 * result['firing_rate']:.1f}%")
            return 0
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
