"""Prompt processing, side by side: hotcold dense pp (the packed GEMM, and the packed GEMV it replaced) against
upstream llama.cpp's llama-bench on the same file and threads, in interleaved rounds; medians and ranges.

Issue #49's target: pp512 on llama-quantize's Q4_K_M file at least 1.5x llama-bench's. Each timing run is wrapped
in `flock LOCK` (other engineers benchmark on the same machine); the machine may still be shared with other work,
so read the ranges as well as the medians.

    python benchmarks/prefill.py --llama-bench BIN -m FILE [-m FILE ...] [--threads 2] [--rounds 5] \
        [--prompts 512,128] [--before-src OLD/src] [--gemv] [--out benchmarks/results/prefill.json]

--before-src: an older checkout's src folder (e.g. `git archive COMMIT src | tar -x -C OLD`), run in the same
rounds with its own kernel build ("hotcold_before"). --gemv: this checkout with HOTCOLD_PACKED_GEMM=0 too (the
packed GEMV for prompt chunks, same bits: the GEMM's share of the gain).
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
from pathlib import Path

LOCK = "/tmp/hotcold-bench.lock"


def run(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> str:
    out = subprocess.run(
        ["flock", LOCK, *cmd], capture_output=True, text=True, env=env, timeout=1800, cwd=cwd
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def hotcold_pp(path: str, n: int, threads: int, gemm: bool, src: str | None = None) -> float:
    env = dict(os.environ, HOTCOLD_PACKED_GEMM="1" if gemm else "0")
    if src:  # an older checkout, with its own kernels build
        env["PYTHONPATH"] = src
        env["HOTCOLD_CACHE_DIR"] = str(Path(src).parent / ".kcache")
    cmd = [sys.executable, "-m", "hotcold", "bench", "-m", str(Path(path).resolve()), "-p", str(n), "-n", "0"]
    cmd += ["-t", str(threads), "-r", "1", "--mode", "dense", "--json"]
    rows = json.loads(run(cmd, env, cwd="/tmp" if src else None))
    return float(rows[0]["tokens_per_s"])


def llama_pp(binary: str, path: str, n: int, threads: int) -> float:
    cmd = [binary, "-m", path, "-p", str(n), "-n", "0", "-t", str(threads), "-r", "1", "-o", "json"]
    return float(json.loads(run(cmd))[0]["avg_ts"])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", default="512,128")
    ap.add_argument("--before-src", help="an older checkout's src folder, measured in the same rounds")
    ap.add_argument("--gemv", action="store_true", help="also this checkout with HOTCOLD_PACKED_GEMM=0")
    ap.add_argument("--out", default="benchmarks/results/prefill.json")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    engines = ["llama.cpp", "hotcold"] + (["hotcold_before"] if args.before_src else [])
    engines += ["hotcold_gemv"] if args.gemv else []
    times: dict = {m: {n: {e: [] for e in engines} for n in prompts} for m in args.model}
    for r in range(args.rounds):  # interleaved: every engine once per round, in a rotating order
        for m in args.model:
            for n in prompts:
                for e in engines[r % len(engines) :] + engines[: r % len(engines)]:
                    if e == "llama.cpp":
                        tps = llama_pp(args.llama_bench, m, n, args.threads)
                    elif e == "hotcold_before":
                        tps = hotcold_pp(m, n, args.threads, gemm=True, src=args.before_src)
                    else:
                        tps = hotcold_pp(m, n, args.threads, gemm=e == "hotcold")
                    times[m][n][e].append(tps)
                    print(f"round {r + 1} {Path(m).name} pp{n} {e}: {tps:.1f} tokens/s", flush=True)
    results = []
    for m in args.model:
        for n in prompts:
            row = {"model": Path(m).name, "test": f"pp{n}", "threads": args.threads}
            row.update({e: summary(times[m][n][e]) for e in engines})
            llama = row["llama.cpp"]["median"]
            row["ratio_vs_llama"] = row["hotcold"]["median"] / llama
            for e in engines[2:]:
                row[f"{e}_ratio_vs_llama"] = row[e]["median"] / llama
                row[f"speedup_vs_{e}"] = row["hotcold"]["median"] / row[e]["median"]
            results.append(row)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "rounds": args.rounds,
        "before_src": args.before_src,
        "note": f"interleaved rounds under flock {LOCK}; the machine was shared with other engineers' work",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
