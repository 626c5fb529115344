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


class TimedObject:
    """A callable object (a layer's q/k/v group) whose calls are timed; attributes pass through."""

    def __init__(self, obj, timed_call):
        self._obj, self._timed_call = obj, timed_call

    def __call__(self, *args, **kwargs):
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._obj, name)


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
    output = model.output
    linear = llama.linear

    def linear_by_role(x, weight, bias=None):
        name = "output head" if weight is output else "attention output projection"
        return timers.wrap(name, linear)(x, weight, bias)

    saved = (llama.rms_norm, llama.rope_attention, llama.linear)
    llama.rms_norm = timers.wrap("rms norms", llama.rms_norm)
    llama.rope_attention = timers.wrap("rope + attention", llama.rope_attention)
    llama.linear = linear_by_role
    originals = [layer.qkv for layer in model.layers]
    for layer in model.layers:
        layer.qkv = TimedObject(layer.qkv, timers.wrap("q, k, v", layer.qkv))
    # FFNs are timed through their class (the forward picks its path by the FFN's type)
    ffn_classes = {type(layer.ffn) for layer in model.layers}
    ffn_calls = {cls: cls.__call__ for cls in ffn_classes}
    for cls in ffn_classes:
        cls.__call__ = timers.wrap("ffn (norm, predictor and FFN)", cls.__call__)
    try:
        measure(llm, "tg", 8)  # warm-up
        timers.seconds.clear()
        seconds, firing = measure(llm, "tg", args.n_gen)
    finally:
        llama.rms_norm, llama.rope_attention, llama.linear = saved
        for layer, qkv in zip(model.layers, originals, strict=True):
            layer.qkv = qkv
        for cls, call in ffn_calls.items():
            cls.__call__ = call
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
