"""Quantized decode, side by side: hotcold (dense and sparse) against upstream llama.cpp's llama-bench on
the same files, in interleaved rounds, medians; optionally an older hotcold checkout in the same rounds.

Issue #13's targets: hotcold dense Q4_0 and Q4_K_M at least 1.0x llama-bench on the same files, hotcold
sparse Q4_0 at least 2x llama.cpp dense Q4_0. Effective GB/s = the file's weight bytes read per token
(every tensor except the embedding) x tokens/s, against the machine's copy bandwidth (read + write).

    python benchmarks/quant_vs_llama.py --llama-bench BIN --dense NAME=FILE [NAME=FILE ...] \
        [--sparse NAME=FILE ...] [--before-src OLD/src] [--threads 2] [--rounds 3] [--n-gen 32] [--depth 0] [--out J]

--depth D times the decode after D tokens of context (llama-bench -d, hotcold bench -d): attention then
reads the KV cache of D positions every token, on top of the weights (effective GB/s counts the weights only).

Files: dense GGUFs made by `llama-quantize` from `benchmarks/synth.py --dense`; sparse: PowerInfer files
made by `hotcold quantize` from the same synthetic model's PowerInfer file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def copy_gbps(threads: int, rounds: int = 5) -> float:
    """Large-tensor copy, bytes read + written per second (the machine's bandwidth ceiling)."""
    torch.set_num_threads(threads)
    src = torch.ones(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes(path: str) -> int:
    """Bytes a decode step reads: every tensor but the embedding (one row of it is read)."""
    from hotcold.gguf.io import ModelFile

    mf = ModelFile(path)
    tied = "output.weight" not in mf.tensors  # then the embedding is the head, read whole
    return sum(e.n_bytes for name, e in mf.tensors.items() if name != "token_embd.weight" or tied)


def hotcold_tg(path: str, mode: str, threads: int, n_gen: int, src: str | None, depth: int = 0) -> float:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
        env["HOTCOLD_CACHE_DIR"] = str(Path(src).parent / ".kcache")  # its own kernels build
    cmd = [sys.executable, "-m", "hotcold", "bench", "-m", path, "-p", "0", "-n", str(n_gen), "-r", "1"]
    cmd += ["-t", str(threads), "--mode", mode, "--json"] + (["-d", str(depth)] if depth else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd="/tmp").stdout
    tg = [r for r in json.loads(out) if r["test"].startswith("tg") and r["mode"] == mode]
    return float(tg[0]["tokens_per_s"])


def llama_tg(binary: str, path: str, threads: int, n_gen: int, depth: int = 0, extra: tuple = ()) -> float:
    cmd = [binary, "-m", path, *f"-p 0 -n {n_gen} -r 1 -t {threads} -o json".split(), *extra]
    cmd += ["-d", str(depth)] if depth else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"expected NAME=FILE with an existing file, got {item!r}")
        out[name] = str(Path(path).resolve())  # hotcold runs with cwd=/tmp
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, help="llama-bench binary")
    ap.add_argument(
        "--dense", nargs="+", default=[], help="NAME=FILE dense GGUFs (llama-bench reads them too)"
    )
    ap.add_argument("--sparse", nargs="*", default=[], help="NAME=FILE PowerInfer files (hotcold sparse)")
    ap.add_argument("--before-src", help="an older hotcold checkout's src/ to measure in the same rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--depth", type=int, default=0, help="context tokens before the timed decode (-d)")
    ap.add_argument("--out", help="JSON file to write (default: print only)")
    args = ap.parse_args()
    dense, sparse = pairs(args.dense), pairs(args.sparse)
    runs: dict[str, list[float]] = {}

    def record(key: str, fn) -> None:
        try:
            runs.setdefault(key, []).append(fn())
        except (subprocess.CalledProcessError, KeyError, IndexError, ValueError) as e:
            stderr = (getattr(e, "stderr", None) or "").strip().splitlines()[-1:]
            print(f"{key}: failed ({e}) {' '.join(stderr)}", file=sys.stderr)

    for r in range(args.rounds):
        for name, path in dense.items():
            record(
                f"llama.cpp dense {name}",
                lambda p=path: llama_tg(args.llama_bench, p, args.threads, args.n_gen, args.depth),
            )
            record(
                f"hotcold dense {name}",
                lambda p=path: hotcold_tg(p, "dense", args.threads, args.n_gen, None, args.depth),
            )
            if args.before_src:
                record(
                    f"before dense {name}",
                    lambda p=path: hotcold_tg(
                        p, "dense", args.threads, args.n_gen, args.before_src, args.depth
                    ),
                )
        for name, path in sparse.items():
            record(
                f"hotcold sparse {name}",
                lambda p=path: hotcold_tg(p, "sparse", args.threads, args.n_gen, None, args.depth),
            )
            if args.before_src:
                record(
                    f"before sparse {name}",
                    lambda p=path: hotcold_tg(
                        p, "sparse", args.threads, args.n_gen, args.before_src, args.depth
                    ),
                )
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v),
            file=sys.stderr,
        )
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    bw = copy_gbps(args.threads)
    gbytes = {name: weight_bytes(p) / 1e9 for name, p in {**dense, **sparse}.items()}
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "n_gen": args.n_gen,
        "depth": args.depth,
        "rounds": args.rounds,
        "copy_gbps": round(bw, 1),
        "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "runs": runs,
        "ratios": {},
        "dense_effective_gbps": {},
    }
    for name in dense:
        base = med.get(f"llama.cpp dense {name}")
        for who in ("hotcold dense", "before dense"):
            if base and f"{who} {name}" in med:
                result["ratios"][f"{who} {name} / llama.cpp dense {name}"] = round(
                    med[f"{who} {name}"] / base, 3
                )
        for who in ("llama.cpp dense", "hotcold dense"):
            if f"{who} {name}" in med:
                result["dense_effective_gbps"][f"{who} {name}"] = round(
                    med[f"{who} {name}"] * gbytes[name], 1
                )
    for name in sparse:
        for dname in dense:
            base = med.get(f"llama.cpp dense {dname}")
            if base and f"hotcold sparse {name}" in med:
                result["ratios"][f"hotcold sparse {name} / llama.cpp dense {dname}"] = round(
                    med[f"hotcold sparse {name}"] / base, 3
                )
    emit(result, args.out)


def emit(result: dict, out: str | None) -> None:
    """The benchmark's JSON on stdout, and in `out` where given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
