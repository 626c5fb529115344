"""Decode speed of a `hotcold sparsify` file: hotcold thresholded vs hotcold dense on the same file vs
hotcold dense on the dense input file vs upstream llama.cpp dense (llama-bench) on that input (the same weights;
llama.cpp refuses the extra ffn_down_t tensors), interleaved rounds, medians, JSON.

The model is a synthetic SwiGLU LLaMA (benchmarks/synth.py, random weights, --shape 1b: n_embd 2048,
n_ff 5632, 22 layers, GQA 32/4) whose gate magnitudes follow the distribution calibration finds on a
real model (--reference, a sparsified file, e.g. the SwiGLU model trained by scripts/swiglu_model/):
the synthetic's gate pre-activation of neuron i is ~N(0, sigma_i^2) (unit-RMS FFN input, gate row of
norm sigma_i), with log sigma_i ~ N(log m, v^2) fitted so that the quantiles of |silu(gate)|, relative
to their median, match the reference's quantile table (averaged over its layers). It is then
sparsified by `hotcold sparsify` at --sparsity on random token text (its vocabulary is synthetic), and
the calibrated curve is reported next to the reference's.

    python benchmarks/sparsify_speed.py --shape 1b --reference /work/swiglu_build/swiglu.f32.sparse.gguf \\
        --llama-bench ~/.cache/hotcold-anchors/llama.cpp/build/bin/llama-bench --threads 2 --rounds 3 \\
        --n-gen 32 [--quant q4_0] --work /tmp/sparsify-speed > /tmp/sparsify_speed.json

Targets (issue #19): at sparsity 0.5, >= 1.4x hotcold dense and >= 1.3x llama.cpp dense.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

if (
    not __package__
):  # run as `python benchmarks/sparsify_speed.py`: the checkout, not benchmarks/, goes first on
    sys.path[0] = str(
        Path(__file__).resolve().parents[1]
    )  # sys.path (a sibling must never shadow a dependency)
from benchmarks.quant_vs_llama import copy_gbps, hotcold_tg, llama_tg, weight_bytes  # noqa: E402
from benchmarks.synth import SHAPES, synthesize  # noqa: E402
from hotcold.gguf import names  # noqa: E402
from hotcold.gguf.io import ModelFile  # noqa: E402

LEVELS = (0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9)  # the curve compared: Q(s) / Q(0.5)


def reference_curve(path: str | None) -> np.ndarray | None:
    """Q(s)/Q(0.5) at LEVELS, the layer mean of the reference file's quantile table."""
    if path is None:
        return None
    mf = ModelFile(path)
    grid = np.asarray(mf.metadata[names.SPARSIFY_GRID], dtype=np.float64)
    table = mf.tensor(names.SPARSIFY_QUANTILES).double().numpy()  # [L, G]
    q = np.stack([np.interp(LEVELS, grid, row) / np.interp(0.5, grid, row) for row in table])
    return q.mean(0)


def synthetic_curve(median: float, spread: float, n: int = 4096, samples: int = 64) -> np.ndarray:
    """Q(s)/Q(0.5) of |silu(g)| with g_i ~ N(0, sigma_i^2), log sigma_i ~ N(log median, spread^2)."""
    gen = torch.Generator().manual_seed(0)
    sigma = median * torch.exp(spread * torch.randn(n, generator=gen, dtype=torch.float64))
    g = torch.randn(samples, n, generator=gen, dtype=torch.float64) * sigma
    s = F.silu(g).abs().flatten()
    q = torch.quantile(s[: 1 << 20], torch.tensor([*LEVELS, 0.5], dtype=torch.float64)).numpy()
    return q[:-1] / q[-1]


def fit_gate_spread(target: np.ndarray | None) -> tuple[float, float, float]:
    """(median sigma, log spread, max |curve - target|) on a small grid; (1, 0, 0) without a target."""
    if target is None:
        return 1.0, 0.0, 0.0
    best = None
    for median in (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0):
        for spread in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
            err = float(np.abs(np.log(synthetic_curve(median, spread)) - np.log(target)).max())
            if best is None or err < best[2]:
                best = (median, spread, err)
    return best


def calibration_text(n_vocab_words: int = 31000, n: int = 6000, seed: int = 0) -> str:
    """Random words of the synthetic vocabulary ("t123"), lines of 16."""
    rng = np.random.default_rng(seed)
    words = [f"t{i}" for i in rng.integers(0, n_vocab_words, size=n)]
    return "\n".join(" ".join(words[i : i + 16]) for i in range(0, n, 16))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="1b")
    ap.add_argument(
        "--reference", default=None, help="a sparsified real model whose gate distribution to copy"
    )
    ap.add_argument(
        "--gate-fit",
        default=None,
        help="MEDIAN,SPREAD: a fit recorded by an earlier run (its JSON's gate_fit), instead of --reference",
    )
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (omitted: no llama.cpp column)")
    ap.add_argument("--work", default="/tmp/sparsify-speed")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument(
        "--quant", default=None, help="hotcold quantize the dense synthetic first (q4_0, q8_0, ...)"
    )
    ap.add_argument(
        "--gate-probe",
        choices=("auto", "none", "q4_0", "inputs"),
        default="auto",
        help="see hotcold sparsify",
    )
    ap.add_argument(
        "--attention", action="store_true", help="sparsify --attention: input sparsity of q/k/v and o too"
    )
    ap.add_argument(
        "--transpose-type",
        default="auto",
        help="sparsify --transpose-type; a comma list adds a column per further type (the first is the headline)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPES[args.shape])
    target = reference_curve(args.reference)
    if args.gate_fit is not None:
        if target is not None:
            ap.error("give --reference or --gate-fit, not both")
        try:
            median, spread = (float(v) for v in args.gate_fit.split(","))
        except ValueError:
            ap.error(f"--gate-fit wants MEDIAN,SPREAD (two numbers), got {args.gate_fit!r}")
        fit_err = None  # not refitted: the recorded run's error applies
    else:
        median, spread, fit_err = fit_gate_spread(target)
    gate_scale = median * np.exp(spread * np.random.default_rng(1).standard_normal(shape["n_ff"]))
    tag = f"{args.shape}-m{median:g}-v{spread:g}"
    dense = work / f"swiglu-{tag}.f16.gguf"
    if not dense.exists():
        synthesize(dense, **shape, dense=True, activation="silu", gate_scale=gate_scale)
    if args.quant:
        from hotcold.convert.quantize import quantize_file

        quantized = work / f"swiglu-{tag}.{args.quant}.gguf"
        if not quantized.exists():
            quantize_file(dense, quantized, args.quant)
        dense = quantized
    attn = ".attn" if args.attention else ""
    corpus = work / "calib.txt"
    corpus.write_text(calibration_text())
    transposes = args.transpose_type.split(",")
    files = {}
    for t in transposes:
        files[t] = dense.with_name(dense.stem + f".sparse{args.sparsity:g}.{args.gate_probe}{attn}.{t}.gguf")
        if not files[t].exists():
            from hotcold.convert.sparsify import sparsify_file

            sparsify_file(
                dense,
                files[t],
                corpus,
                sparsity=args.sparsity,
                max_tokens=args.calib_tokens,
                threads=args.threads,
                probe=args.gate_probe,
                attention=args.attention,
                transposes=t,
            )
    sparse = files[transposes[0]]
    got = reference_curve(str(sparse))
    extra = {f"hotcold_sparse_transposes_{t}": files[t] for t in transposes[1:]}

    samples = {"hotcold_sparse": [], **{k: [] for k in extra}}
    samples.update({"hotcold_dense": [], "hotcold_dense_input": [], "llama_dense": []})
    for _ in range(args.rounds):  # interleaved: machine noise hits every column alike
        samples["hotcold_sparse"].append(hotcold_tg(str(sparse), "sparse", args.threads, args.n_gen, None))
        for k, f in extra.items():
            samples[k].append(hotcold_tg(str(f), "sparse", args.threads, args.n_gen, None))
        samples["hotcold_dense"].append(hotcold_tg(str(sparse), "dense", args.threads, args.n_gen, None))
        samples["hotcold_dense_input"].append(hotcold_tg(str(dense), "dense", args.threads, args.n_gen, None))
        if args.llama_bench:
            samples["llama_dense"].append(llama_tg(args.llama_bench, str(dense), args.threads, args.n_gen))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    bytes_dense = weight_bytes(str(dense))
    result = {
        "date": dt.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "shape": args.shape,
        **shape,
        "file": str(dense),
        "sparse_file": str(sparse),
        "transpose_types": transposes,
        "transpose_type_names": {
            t: ModelFile(files[t]).entry(names.tensor(names.FFN_DOWN_T, 0)).qtype.name for t in transposes
        },
        "sparsity": args.sparsity,
        "gate_probe": args.gate_probe,
        "attention_inputs": args.attention,
        "threads": args.threads,
        "n_gen": args.n_gen,
        "rounds": args.rounds,
        "gate_fit": {"median_sigma": median, "log_spread": spread, "max_log_error": fit_err},
        "reference_curve": None if target is None else [round(float(x), 4) for x in target],
        "synthetic_curve": [round(float(x), 4) for x in got],
        "levels": list(LEVELS),
        "tokens_per_s": med,
        "tokens_per_s_all": samples,
        "speedup_vs_hotcold_dense": med["hotcold_sparse"] / med["hotcold_dense"],
        # the same weights as the input file a user would otherwise run (no ffn_down_t, no probe)
        "speedup_vs_hotcold_dense_input": med["hotcold_sparse"] / med["hotcold_dense_input"],
        "speedup_vs_llama_dense": med["hotcold_sparse"] / med["llama_dense"]
        if "llama_dense" in med
        else None,
        # each round's columns run back to back: the median of the rounds' own ratios is the steadier figure
        "round_ratio_medians": {
            k: statistics.median(a / b for a, b in zip(samples["hotcold_sparse"], v))
            for k, v in samples.items()
            if v and k != "hotcold_sparse"
        },
        "dense_weight_gb": bytes_dense / 1e9,
        "dense_effective_gb_s": med["hotcold_dense"] * bytes_dense / 1e9,
        "copy_gb_s": copy_gbps(args.threads),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
