"""Perplexity of `hotcold sparsify` files on held-out text, by sparsity, method and weight type: JSON.

For each weight type (the dense input, or `hotcold quantize` of it) and each method (cats, wina) the
model is sparsified once at --target on --calib; every sparsity in --sparsities is then that file loaded
with `sparsity=` (the thresholds derived from the stored quantile table, 0 = dense). Two protocols:

- "chunked": llama.cpp's (`hotcold perplexity`): chunks of --ctx tokens in one forward each, second half
  scored. Forwards of >= cpu.GEMM_MIN_TOKENS rows (96) compute the masked FFN with the dense GEMM path and the
  file's ffn_down.
- "stepwise" (--stepwise): the same chunks fed --piece tokens at a time through the KV cache, so every
  FFN runs the decode kernels (row gathers, the axpy over ffn_down_t): what generation computes, and
  where the type of the copies the decode reads (--transpose-types) shows.

    python benchmarks/sparsify_ppl.py --model /work/swiglu_build/swiglu.f32.gguf \\
        --calib /work/swiglu_build/corpus/train.txt --heldout /work/swiglu_build/corpus/heldout.txt \\
        --types source,q8_0,q4_0 --methods cats,wina [--probes none,q4_0] [--stepwise] -t 1 > /tmp/ppl.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import hotcold
from hotcold.cli.perplexity import chunk_nll, perplexity, scoring_chunks
from hotcold.convert.quantize import quantize_file
from hotcold.convert.sparsify import sparsify_file
from hotcold.placement.profile import corpus_tokens, read_corpus
from hotcold.runtime.engine import Engine


def stepwise_ppl(llm, ids, ctx: int, piece: int) -> float:
    """llama.cpp's chunks and scoring, each chunk fed `piece` tokens at a time (the decode kernels)."""
    tok = llm.tokenizer
    nll, n = 0.0, 0
    engine = Engine(llm.loaded.model, tok, ctx)
    for chunk in scoring_chunks(ids, ctx, tok.bos_id if tok.add_bos else None):
        with torch.inference_mode():
            logits = torch.cat(
                [
                    engine.forward(chunk[s : s + piece], s, last_only=False)
                    for s in range(0, len(chunk), piece)
                ]
            )
        total, count = chunk_nll(logits.float(), chunk)
        nll, n = nll + total, n + count
    return math.exp(nll / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="dense SwiGLU GGUF")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--work", default="/tmp/sparsify_ppl", help="folder for the quantized / sparsified files")
    ap.add_argument("--types", default="source", help="comma-separated: source, f16, q8_0, q4_0, q4_k_m, ...")
    ap.add_argument("--methods", default="cats,wina")
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--sparsities", default="0,0.3,0.4,0.5,0.6")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--heldout-tokens", type=int, default=16384)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stepwise", action="store_true", help="also the decode-kernel protocol")
    ap.add_argument(
        "--piece",
        type=int,
        default=3,
        help="tokens per forward in the stepwise protocol (under thresholded.PROMPT_DENSE_ROWS = 4, so the row kernels)",
    )
    ap.add_argument(
        "--transpose-types",
        "--down-types",
        dest="transpose_types",
        default="auto",
        help="types of the transposed copies to compare (sparsify --transpose-type), e.g. same,q8_0",
    )
    ap.add_argument("--probes", default="none", help="gate probes to compare, e.g. none,q4_0")
    ap.add_argument(
        "--attention", default="off", help="input sparsity of q/k/v and o too (sparsify --attention): off,on"
    )
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    levels = [float(s) for s in args.sparsities.split(",")]
    rows = []
    for qtype in args.types.split(","):
        dense = Path(args.model)
        if qtype != "source":
            dense = work / f"dense.{qtype}.gguf"
            if not dense.exists():
                quantize_file(args.model, dense, qtype)
        first = hotcold.load(dense, threads=args.threads)
        ids = corpus_tokens(first.tokenizer, read_corpus(args.heldout), max_tokens=args.heldout_tokens)
        del first
        for method in args.methods.split(","):
            variants = [
                (t, p, a == "on")
                for t in args.transpose_types.split(",")
                for p in args.probes.split(",")
                for a in args.attention.split(",")
            ]
            for transposes, probe, attention in variants:
                out = (
                    work / f"sparse.{qtype}.{method}.{transposes}.{probe}{'.attn' if attention else ''}.gguf"
                )
                t0 = time.perf_counter()
                cal = sparsify_file(
                    dense,
                    out,
                    args.calib,
                    sparsity=args.target,
                    method=method,
                    max_tokens=args.calib_tokens,
                    threads=args.threads,
                    transposes=transposes,
                    probe=probe,
                    attention=attention,
                )
                seconds = time.perf_counter() - t0
                for s in levels:
                    llm = hotcold.load(out, threads=args.threads, sparsity=s, ctx_size=args.ctx)
                    r = perplexity(llm, ids, ctx=args.ctx)
                    row = {
                        "type": qtype,
                        "method": method,
                        "ffn_down_t": cal["ffn_down_t_type"],
                        "down_choice": transposes,
                        "gate_probe": probe,
                        "attention_inputs": attention,
                        "sparsity": s,
                        "perplexity": r["perplexity"],
                        "computed_rate": r.get("firing_rate", 1.0),
                        "tokens_scored": r["tokens_scored"],
                        "calibration_seconds": seconds,
                    }
                    if args.stepwise:
                        row["stepwise_perplexity"] = stepwise_ppl(llm, ids, args.ctx, args.piece)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    for r in rows:  # relative to the same type's dense figure
        base = next(
            b for b in rows if b["type"] == r["type"] and b["method"] == r["method"] and b["sparsity"] == 0
        )
        r["increase"] = r["perplexity"] / base["perplexity"] - 1
        if "stepwise_perplexity" in r:
            r["stepwise_increase"] = r["stepwise_perplexity"] / base["stepwise_perplexity"] - 1
    json.dump({"model": args.model, "ctx": args.ctx, "rows": rows}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
