"""Synthetic ReLU-LLaMA models in the PowerInfer layout, for measuring speed at realistic sparsity without
real weights.

Weights are random. Predictors are built so that neuron i of every layer fires with a chosen probability
p_i: fc1 holds a pair of opposite rows (r, -r), so relu(r.x) + relu(-r.x) = |r.x| > 0 acts as a positive
"bias" channel whose weight in fc2 sets the neuron's offset; the remaining rank gives zero-mean noise. The
offsets are calibrated on sample inputs so that P(logit_i >= 0) = p_i. The p_i follow a power law over a
random permutation of the neurons, fitted so that the mean firing rate is --firing (default 10%) and the
hottest 20% of neurons take --skew (default 80%) of all firings, as the PowerInfer paper measured.
The expected firing counts are written as activation/activation_{i}.pt, as `hotcold profile` would.

`--dense` with the same seed writes the same weights in the dense layout (ffn_down = ffn_down_t
transposed, no predictors): the sparse and the dense file are one model. `--layers N` keeps a shape's
widths with N layers (a 7B-wide model that fits a short benchmark). Weights come from one seeded
generator in file order; the predictors are calibrated once per layer, in a thread pool that runs
while the weights are written (each layer has its own generator, so threads change nothing).

    python benchmarks/synth.py --shape 1b -o /tmp/synth-1b.powerinfer.gguf
    python benchmarks/synth.py --shape 7b --layers 8 -o /tmp/synth-7b-8l.powerinfer.gguf [--dense]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from hotcold.gguf.io import TensorSpec, write_model_file

SHAPES = {
    # n_embd, n_ff, n_layer, n_head, n_head_kv, predictor rank
    "tiny": dict(n_embd=256, n_ff=1024, n_layer=4, n_head=8, n_head_kv=4, rank=64),
    "1b": dict(n_embd=2048, n_ff=5632, n_layer=22, n_head=32, n_head_kv=4, rank=256),
    "7b": dict(n_embd=4096, n_ff=11008, n_layer=32, n_head=32, n_head_kv=32, rank=1024),
    "13b": dict(n_embd=5120, n_ff=13824, n_layer=40, n_head=40, n_head_kv=40, rank=1024),
}
N_VOCAB = 32000


def firing_probabilities(n: int, mean: float, skew: float, *, hot_share: float = 0.2) -> np.ndarray:
    """p over n neurons (sorted hottest first): power law p_r = a (r+1)^-alpha, clipped at 0.95, such that
    mean(p) = mean and the hottest hot_share of neurons hold `skew` of sum(p)."""
    ranks = np.arange(1, n + 1, dtype=np.float64)
    n_hot = int(round(hot_share * n))

    def fit(alpha: float) -> np.ndarray:
        base = ranks**-alpha
        lo, hi = 0.0, 1e6
        for _ in range(100):  # scale so the clipped mean hits the target
            a = (lo + hi) / 2
            if np.minimum(a * base, 0.95).mean() < mean:
                lo = a
            else:
                hi = a
        return np.minimum(lo * base, 0.95)

    lo, hi = 0.0, 4.0
    for _ in range(60):
        alpha = (lo + hi) / 2
        p = fit(alpha)
        if p[:n_hot].sum() / p.sum() < skew:
            lo = alpha
        else:
            hi = alpha
    return fit((lo + hi) / 2)


def make_predictor(
    n_embd: int, n_ff: int, rank: int, probs: np.ndarray, gen: torch.Generator, n_samples: int = 4096
):
    """fc1 [rank, D], fc2 [F, rank] whose logits fire neuron i with probability probs[i] on random inputs."""
    fc1 = torch.randn(rank, n_embd, generator=gen) / math.sqrt(n_embd)
    fc1[1] = -fc1[0]  # relu(z0) + relu(-z0) = |z0|: an always-positive channel
    fc2 = torch.randn(n_ff, rank, generator=gen) / math.sqrt(rank)
    fc2[:, 2:] -= fc2[:, 2:].mean(dim=1, keepdim=True)  # zero-mean noise over the positive relu outputs
    fc2[:, 0] = 0.0
    fc2[:, 1] = 0.0
    x = torch.randn(n_samples, n_embd, generator=gen)
    h = torch.relu(x @ fc1.T)  # [S, R]
    noise = h @ fc2.T  # [S, F]
    bias_channel = h[:, 0] + h[:, 1]  # |z0| [S]
    # neuron fires iff b * |z0| + noise >= 0  <=>  b >= -noise / |z0|: b is that ratio's p-quantile
    # (sorted per neuron along contiguous rows: numpy's SIMD sort, which releases the GIL for the threads)
    ratio = np.sort((-noise / bias_channel[:, None]).T.contiguous().numpy(), axis=1)  # [F, S]
    rows = np.clip(np.round(probs * (n_samples - 1)), 0, n_samples - 1).astype(np.int64)
    offsets = ratio[np.arange(n_ff), rows].astype(np.float32)
    fc2[:, 0] = torch.from_numpy(offsets)
    fc2[:, 1] = torch.from_numpy(offsets)
    return fc1, fc2


def vocab_metadata(n_vocab: int = N_VOCAB) -> list[tuple]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    return [
        ("tokenizer.ggml.model", "llama", V.STRING),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY),
        ("tokenizer.ggml.scores", [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)], V.ARRAY),
        ("tokenizer.ggml.token_type", types, V.ARRAY),
        ("tokenizer.ggml.bos_token_id", 1, V.UINT32),
        ("tokenizer.ggml.eos_token_id", 2, V.UINT32),
        ("tokenizer.ggml.unknown_token_id", 0, V.UINT32),
    ]


def synthesize(
    out: Path,
    *,
    n_embd: int,
    n_ff: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    rank: int,
    firing: float = 0.10,
    skew: float = 0.80,
    outtype: str = "f16",
    seed: int = 0,
    dense: bool = False,
    activation: str = "relu",
    gate_scale: np.ndarray | None = None,
    workers: int | None = None,
    n_vocab: int = N_VOCAB,
) -> dict:
    """activation "silu" (dense only): an ordinary SwiGLU file (no hotcold.ffn_activation key), for
    `hotcold sparsify`; gate_scale [F]: each neuron's gate row multiplied by it (the spread of gate
    magnitudes, benchmarks/sparsify_speed.py). dense: the same weights as the sparse file of the same
    seed, in the dense layout. workers: threads calibrating predictors (default: one per 8 cores). n_vocab:
    fewer tokens make a file that opens fast (the gguf reader parses the vocabulary in Python)."""
    if n_vocab < 259:
        raise ValueError(f"n_vocab must be >= 259 (3 special + 256 byte tokens), got {n_vocab}")
    if activation not in ("relu", "silu") or (activation == "silu" and not dense):
        raise ValueError("activation is relu, or silu for a dense file")
    qtype = {"f32": Q.F32, "f16": Q.F16}[outtype]
    dtype = {"f32": np.float32, "f16": np.float16}[outtype]
    gen = torch.Generator().manual_seed(seed)
    head_dim = n_embd // n_head
    kv = n_head_kv * head_dim
    probs_sorted = firing_probabilities(n_ff, firing, skew)

    def cast(t: torch.Tensor, *, transpose: bool = False) -> np.ndarray:
        # torch's float16 cast and transpose: numpy's bits, on every core
        t = t.to(torch.float16) if dtype is np.float16 else t.to(torch.float32)
        return (t.T.contiguous() if transpose else t).numpy()

    # The weights are drawn into buffers reused per shape: the writer copies each array to the file before
    # it asks for the next, and fresh 100-500 MB allocations cost page faults (half the time, measured).
    buffers: dict[tuple, torch.Tensor] = {}

    def buffer(shape, dt) -> torch.Tensor:
        if (shape, dt) not in buffers:
            buffers[shape, dt] = torch.empty(shape, dtype=dt)
        return buffers[shape, dt]

    def rand(shape, fan_in, *, transpose=False):
        def make():
            w = torch.randn(*shape, generator=gen, out=buffer(shape, torch.float32)).div_(math.sqrt(fan_in))
            if dtype is not np.float16:
                return (w.T.contiguous() if transpose else w).numpy()
            if transpose:
                return buffer(shape[::-1], torch.float16).copy_(w.T).numpy()
            return buffer(shape, torch.float16).copy_(w).numpy()

        return make

    def ones(n):
        return lambda: np.ones(n, dtype=np.float32)

    def scaled_gate():
        make = rand((n_ff, n_embd), n_embd)
        if gate_scale is None:
            return make
        return lambda: (make().astype(np.float32) * gate_scale[:, None].astype(np.float32)).astype(dtype)

    specs = [TensorSpec("token_embd.weight", (n_vocab, n_embd), qtype, rand((n_vocab, n_embd), 1))]
    predictors, activations = [], []
    for i in range(n_layer):
        p = f"blk.{i}."
        specs += [
            TensorSpec(p + "attn_norm.weight", (n_embd,), Q.F32, ones(n_embd)),
            TensorSpec(p + "attn_q.weight", (n_embd, n_embd), qtype, rand((n_embd, n_embd), n_embd)),
            TensorSpec(p + "attn_k.weight", (kv, n_embd), qtype, rand((kv, n_embd), n_embd)),
            TensorSpec(p + "attn_v.weight", (kv, n_embd), qtype, rand((kv, n_embd), n_embd)),
            TensorSpec(p + "attn_output.weight", (n_embd, n_embd), qtype, rand((n_embd, n_embd), n_embd)),
            TensorSpec(p + "ffn_norm.weight", (n_embd,), Q.F32, ones(n_embd)),
            TensorSpec(p + "ffn_gate.weight", (n_ff, n_embd), qtype, scaled_gate()),
            TensorSpec(p + "ffn_up.weight", (n_ff, n_embd), qtype, rand((n_ff, n_embd), n_embd)),
        ]
        # the dense file draws the same numbers in the same order: ffn_down is ffn_down_t transposed
        down = rand((n_ff, n_embd), n_ff, transpose=dense)
        if dense:
            specs.append(TensorSpec(p + "ffn_down.weight", (n_embd, n_ff), qtype, down))
        else:
            specs.append(TensorSpec(p + "ffn_down_t.weight", (n_ff, n_embd), qtype, down))
        probs = np.empty(n_ff)
        probs[torch.randperm(n_ff, generator=gen).numpy()] = probs_sorted  # hot neurons scattered
        if not dense:
            activations.append(probs)
            predictors.append((i, probs))
    specs += [
        TensorSpec("output_norm.weight", (n_embd,), Q.F32, ones(n_embd)),
        TensorSpec("output.weight", (n_vocab, n_embd), qtype, rand((n_vocab, n_embd), n_embd)),
    ]
    # predictors last, as PowerInfer's convert.py writes them; calibrated once per layer, in threads that
    # run while the weights before them are written (each layer has its own generator: same bits)
    # each worker's torch ops run on an OpenMP team of all cores: one worker per 8 cores is plenty
    n_workers = max(1, min(workers or (os.cpu_count() or 1) // 8, len(predictors)))
    pool = ThreadPoolExecutor(n_workers) if predictors else None
    futures = {
        i: pool.submit(
            make_predictor, n_embd, n_ff, rank, probs, torch.Generator().manual_seed(seed * 1000 + i)
        )
        for i, probs in predictors
    }

    def predictor(i: int, which: int):
        def make():
            fc = futures[i].result()[which]
            if which == 1:
                del futures[i]  # both halves taken: free the layer's calibration
            return cast(fc)

        return make

    for i, _ in predictors:
        specs.append(TensorSpec(f"blk.{i}.fc1.weight", (rank, n_embd), qtype, predictor(i, 0)))
        specs.append(TensorSpec(f"blk.{i}.fc2.weight", (n_ff, rank), qtype, predictor(i, 1)))

    arch = "llama"
    meta = [
        ("general.name", f"synthetic-{activation}-llama-{n_embd}x{n_layer}", V.STRING),
        (f"{arch}.context_length", 4096, V.UINT32),
        (f"{arch}.embedding_length", n_embd, V.UINT32),
        (f"{arch}.block_count", n_layer, V.UINT32),
        (f"{arch}.feed_forward_length", n_ff, V.UINT32),
        (f"{arch}.rope.dimension_count", head_dim, V.UINT32),
        (f"{arch}.attention.head_count", n_head, V.UINT32),
        (f"{arch}.attention.head_count_kv", n_head_kv, V.UINT32),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("general.file_type", {"f32": 0, "f16": 1}[outtype], V.UINT32),
        *vocab_metadata(n_vocab),
    ]
    if dense and activation == "relu":
        meta.append(("hotcold.ffn_activation", "relu", V.STRING))
    try:
        write_model_file(out, arch, meta, specs, sparse=not dense)
    finally:
        if pool is not None:
            for f in futures.values():
                f.cancel()
            pool.shutdown(wait=True)
    if activations:
        act_dir = out.parent / "activation"
        act_dir.mkdir(exist_ok=True)
        for i, probs in enumerate(activations):  # expected firing counts over 10,000 tokens
            torch.save(
                torch.from_numpy(np.round(probs * 10000).astype(np.int64)), act_dir / f"activation_{i}.pt"
            )
    hot = int(0.2 * n_ff)
    return {
        "file": str(out),
        "bytes": out.stat().st_size,
        "firing_target": firing,
        "hot20_share": float(probs_sorted[:hot].sum() / probs_sorted.sum()),
        "mean_p": float(probs_sorted.mean()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="1b")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--firing", type=float, default=0.10, help="mean share of neurons that fire per token")
    ap.add_argument(
        "--skew", type=float, default=0.80, help="share of firings taken by the hottest 20%% of neurons"
    )
    ap.add_argument("--outtype", choices=("f16", "f32"), default="f16")
    ap.add_argument("--rank", type=int, default=None, help="predictor rank (default per shape)")
    ap.add_argument("--dense", action="store_true", help="write a dense GGUF (ffn_down, no predictors)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vocab", type=int, default=N_VOCAB, help="vocabulary size (fewer: a file that opens fast)"
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="number of layers (default per shape; widths unchanged)"
    )
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.rank:
        shape["rank"] = args.rank
    if args.layers is not None:
        if args.layers < 1:
            ap.error(f"--layers must be >= 1, got {args.layers}")
        shape["n_layer"] = args.layers
    if args.vocab < 259:
        ap.error(f"--vocab must be >= 259, got {args.vocab}")
    info = synthesize(
        Path(args.out),
        **shape,
        firing=args.firing,
        skew=args.skew,
        outtype=args.outtype,
        seed=args.seed,
        dense=args.dense,
        n_vocab=args.vocab,
    )
    json.dump({"shape": args.shape, **shape, **info}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
