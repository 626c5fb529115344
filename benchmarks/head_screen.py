"""The output head's screen (hotcold.runtime.head_screen), side by side: greedy decode with the screen and with the whole
head (--no-head-screen), on dense and `hotcold sparsify` files, against llama-bench on the dense file, in
interleaved rounds, medians and ranges.

    python benchmarks/head_screen.py --llama-bench BIN --dense F16.gguf [--sparse NAME=FILE ...] \
        [--threads 2] [--rounds 3] [--n-gen 32] [--out J]

Issue #44's target (`hotcold sparsify --sparsity 0.5` on the Qwen3-0.6B-shaped F16 file >= 1.3x hotcold dense)
is read two ways here, both reported: each sparse file against dense with the whole head, and against dense with
the screen as well (like for like: the screen is hotcold's greedy decode on either file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel_bandwidth import cpu_name  # noqa: E402
from benchmarks.quant_vs_llama import copy_gbps, emit, llama_tg, pairs  # noqa: E402


def hotcold_tg(path: str, mode: str, threads: int, n_gen: int, screen: bool) -> tuple[float, float]:
    """(tokens/s, share of the head's rows computed a token) of one `hotcold bench` tg run."""
    cmd = [sys.executable, "-m", "hotcold", "bench", "-m", path, "-p", "0", "-n", str(n_gen), "-r", "1"]
    cmd += ["-t", str(threads), "--mode", mode, "--json"] + ([] if screen else ["--no-head-screen"])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd="/tmp").stdout
    row = [r for r in json.loads(out) if r["test"].startswith("tg") and r["mode"] == mode][0]
    return float(row["tokens_per_s"]), float(row["head_rows_share"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (omitted: no llama.cpp column)")
    ap.add_argument("--dense", required=True, help="the dense file (F16)")
    ap.add_argument("--sparse", nargs="*", default=[], help="NAME=FILE `hotcold sparsify` files of it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument(
        "--full-head",
        choices=("all", "dense"),
        default="all",
        help="which files also run with the whole head (dense: only the dense file, fewer runs a round)",
    )
    ap.add_argument("--out", help="JSON file to write (default: print only)")
    args = ap.parse_args()
    dense = str(Path(args.dense).resolve())
    sparse = pairs(args.sparse)
    runs: dict[str, list[float]] = {}
    shares: dict[str, list[float]] = {}
    engines = [("dense screen", dense, "dense", True), ("dense full head", dense, "dense", False)]
    for name, path in sparse.items():
        engines.append((f"{name} screen", path, "sparse", True))
        if args.full_head == "all":
            engines.append((f"{name} full head", path, "sparse", False))
    for r in range(args.rounds):
        if args.llama_bench:
            runs.setdefault("llama.cpp dense", []).append(
                llama_tg(args.llama_bench, dense, args.threads, args.n_gen)
            )
        for key, path, mode, screen in engines:
            tps, share = hotcold_tg(path, mode, args.threads, args.n_gen, screen)
            runs.setdefault(key, []).append(tps)
            shares.setdefault(key, []).append(share)
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()),
            file=sys.stderr,
        )
    med = {k: statistics.median(v) for k, v in runs.items()}
    pairs_ = [("dense screen", "dense full head"), ("dense screen", "llama.cpp dense")]
    pairs_ += [("dense full head", "llama.cpp dense")]
    for name in sparse:
        pairs_ += [(f"{name} screen", "dense screen"), (f"{name} screen", "dense full head")]
        pairs_ += [(f"{name} full head", "dense full head"), (f"{name} screen", "llama.cpp dense")]
    ratios = {f"{a} / {b}": round(med[a] / med[b], 3) for a, b in pairs_ if a in med and b in med}
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "n_gen": args.n_gen,
        "rounds": args.rounds,
        "copy_gbps": round(copy_gbps(args.threads), 1),
        "files": {"dense": dense, **sparse},
        "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "range": {k: [round(min(v), 2), round(max(v), 2)] for k, v in runs.items()},
        "runs": runs,
        "head_rows_share": {k: round(statistics.mean(v), 6) for k, v in shares.items()},
        "ratios": ratios,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
