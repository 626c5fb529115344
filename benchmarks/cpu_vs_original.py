"""CPU decode against the original PowerInfer and upstream llama.cpp, same files, same threads, one run: hotcold
sparse (the PowerInfer file) and dense (the dense file), greedy, with the head screen, and sparse with the whole
head as the others compute it, the
original's llama-bench on the PowerInfer file (sparse) and on the dense file, llama.cpp's llama-bench on the dense
file; interleaved rounds, medians and ranges, ratios. Issue #49's targets: F16 dense >= 1.0x the original's dense
and llama.cpp's; F16 sparse >= 1.5x the original's sparse; Q4_0 sparse >= 2x the original's sparse.

    ../shared/anchors/build-powerinfer-cpu.sh   # the original's tools, once (~8 minutes on 2 cores)
    python benchmarks/cpu_vs_original.py --original-bench PI/build/bin/llama-bench \
        --llama-bench LLAMA/build/bin/llama-bench --case F16=synth-1b.powerinfer.gguf,synth-1b.dense.gguf \
        [--case Q4_0=...q4_0.powerinfer.gguf,...dense.q4_0.gguf] [--threads 2] [--rounds 5] [--n-gen 32] [--out J]

Files: `benchmarks/synth.py --shape 1b` (the PowerInfer file) and `--dense` (the same weights in llama.cpp's dense
layout); Q4_0 copies by `hotcold quantize` (PowerInfer file) and `llama-quantize` (dense file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.head_screen import hotcold_tg  # noqa: E402
from benchmarks.kernel_bandwidth import cpu_name  # noqa: E402
from benchmarks.quant_vs_llama import copy_gbps, emit, llama_tg  # noqa: E402


def cases(items: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for item in items:
        name, _, files = item.partition("=")
        sparse, _, dense = files.partition(",")
        if not (Path(sparse).is_file() and Path(dense).is_file()):
            raise SystemExit(f"expected NAME=POWERINFER_FILE,DENSE_FILE with existing files, got {item!r}")
        out[name] = (str(Path(sparse).resolve()), str(Path(dense).resolve()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--original-bench", required=True, help="the original PowerInfer's llama-bench")
    ap.add_argument("--llama-bench", required=True, help="upstream llama.cpp's llama-bench")
    ap.add_argument("--case", nargs="+", required=True, help="NAME=POWERINFER_FILE,DENSE_FILE")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--out", help="JSON file to write (default: print only)")
    args = ap.parse_args()
    runs: dict[str, list[float]] = {}
    t, n = args.threads, args.n_gen
    for r in range(args.rounds):
        for name, (sparse, dense) in cases(args.case).items():
            engines = {  # (llama-bench binary, file) or (hotcold mode, head screen) on the PowerInfer file
                f"original sparse {name}": (args.original_bench, sparse),
                f"original dense {name}": (args.original_bench, dense),
                f"llama.cpp dense {name}": (args.llama_bench, dense),
                f"hotcold sparse {name}": ("sparse", True),
                f"hotcold sparse full head {name}": ("sparse", False),
                f"hotcold dense {name}": ("dense", True),  # on the dense file, as llama.cpp
            }
            for key, (a, b) in engines.items():
                try:
                    if key.startswith("hotcold"):
                        tps = hotcold_tg(dense if a == "dense" else sparse, a, t, n, b)[0]
                    else:  # the original's llama-bench loads a CPU-only build's files only with -ngl 0
                        tps = llama_tg(a, b, t, n, extra=("-ngl", "0") if key.startswith("original") else ())
                    runs.setdefault(key, []).append(tps)
                except (subprocess.CalledProcessError, KeyError, IndexError, ValueError) as e:
                    print(f"{key}: failed ({e}) {(getattr(e, 'stderr', '') or '')[-300:]}", file=sys.stderr)
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()),
            file=sys.stderr,
        )
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    ratios = {}
    for name in cases(args.case):
        for a, b in [
            ("hotcold sparse", "original sparse"),
            ("hotcold sparse full head", "original sparse"),
            ("hotcold dense", "original dense"),
            ("hotcold dense", "llama.cpp dense"),
            ("hotcold sparse", "llama.cpp dense"),
        ]:
            ka, kb = f"{a} {name}", f"{b} {name}"
            if ka in med and kb in med:
                ratios[f"{ka} / {kb}"] = round(med[ka] / med[kb], 3)
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "threads": t,
        "n_gen": n,
        "rounds": args.rounds,
        "copy_gbps": round(copy_gbps(t), 1),
        "cases": cases(args.case),
        "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "range": {k: [round(min(v), 2), round(max(v), 2)] for k, v in runs.items() if v},
        "runs": runs,
        "ratios": ratios,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
