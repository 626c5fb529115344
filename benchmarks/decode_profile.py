"""Where a decode token's time goes on the CPU, step by step, for a LLaMA-family model.

Wraps the steps of the llama forward (the q/k/v call with its norm, RoPE + attention, the output
projection, the FFN with its norm, the output head, any RMS norm left outside them) with timers, decodes N tokens greedily from random ids, and prints JSON with
ms/token per step and what is left (embedding, residual adds, the interpreter). The timers cost a few
microseconds per step, so the total runs slightly slower than `hotcold bench`.

    python benchmarks/decode_profile.py [-m MODEL] [-t THREADS] [-n 64]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import hotcold
from hotcold.cli.bench import measure
from hotcold.models import llama
from hotcold.models.base import Head
from hotcold.ops import LinearGroup


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model file; omitted: the bundled demo model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    args = ap.parse_args(argv)
    llm = hotcold.load(args.model, threads=args.threads, ctx_size=args.n_gen + 16)
    model = llm.loaded.model
    if not isinstance(model, llama.Llama):
        ap.error(f"this profile follows the llama forward; {type(model).__name__} is not one")
    timers = Timers()
    # model objects are immutable: time the steps through the classes and module functions they call
    ffn_class, tail_class = type(model.layers[0].ffn), type(model.tails[0])  # tail: NoneType where op by op
    patches = [
        # a CPU decode token: q/k/v + RoPE + attention in one C call, then o + residual + FFN + residual in one
        (llama, "decode_attention", "q, k, v + rope + attention (one C call)"),
        (tail_class, "__call__", "o projection + ffn (one C call)"),
        # the op-by-op path, where a layer takes it (prefill, or FFNs without a fused tail)
        (llama, "rope_attention_segments", "rope + attention (op by op)"),
        (llama, "linear", "attention output projection (op by op)"),
        (LinearGroup, "__call__", "q, k, v (op by op)"),
        (ffn_class, "__call__", "ffn (op by op)"),
        (Head, "__call__", "output norm + head"),
        (llama, "embed", "embedding"),
    ]
    patches = [p for p in patches if hasattr(p[0], p[1])]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, timers.wrap(label, getattr(owner, name)))
    try:
        measure(llm, "tg", 8)  # warm-up
        timers.seconds.clear()
        seconds, firing, _ = measure(llm, "tg", args.n_gen)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    per_token = {k: round(v / args.n_gen * 1e3, 3) for k, v in timers.seconds.items()}
    per_token["other"] = round(seconds / args.n_gen * 1e3 - sum(per_token.values()), 3)
    res = {
        "model": str(llm.loaded.file.path),
        "threads": args.threads,
        "tokens_per_s": round(args.n_gen / seconds, 2),
        "ms_per_token": round(seconds / args.n_gen * 1e3, 3),
        "firing": round(firing, 4),
        "steps_ms_per_token": per_token,
    }
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
