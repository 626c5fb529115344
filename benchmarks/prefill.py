"""Prompt processing, side by side: hotcold dense pp (the packed GEMM, and the packed GEMV it replaced) against
upstream llama.cpp's llama-bench on the same file and threads, in interleaved rounds; medians and ranges.

Issue #49's target: pp512 on llama-quantize's Q4_K_M file at least 1.5x llama-bench's. Each timing run is wrapped
in `flock LOCK` (other engineers benchmark on the same machine); the machine may still be shared with other work,
so read the ranges as well as the medians.

    python benchmarks/prefill.py --llama-bench BIN -m FILE [-m FILE ...] [--threads 2] [--rounds 5] \
        [--prompts 512,128] [--no-before] [--out benchmarks/results/prefill.json]

"before" is the same checkout with HOTCOLD_PACKED_GEMM=0 (the GEMV for prompt chunks; same bits).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

LOCK = "/tmp/hotcold-bench.lock"


def run(cmd: list[str], env: dict | None = None) -> str:
    out = subprocess.run(["flock", LOCK, *cmd], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def hotcold_pp(path: str, n: int, threads: int, gemm: bool) -> float:
    env = dict(os.environ, HOTCOLD_PACKED_GEMM="1" if gemm else "0")
    cmd = ["hotcold", "bench", "-m", path, "-p", str(n), "-n", "0", "-t", str(threads), "-r", "1"]
    rows = json.loads(run([*cmd, "--mode", "dense", "--json"], env))
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
    ap.add_argument("--no-before", action="store_true", help="skip the GEMV (HOTCOLD_PACKED_GEMM=0) runs")
    ap.add_argument("--out", default="benchmarks/results/prefill.json")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    engines = ["llama.cpp", "hotcold"] + ([] if args.no_before else ["hotcold_gemv"])
    times: dict = {m: {n: {e: [] for e in engines} for n in prompts} for m in args.model}
    for r in range(args.rounds):  # interleaved: every engine once per round, in a rotating order
        for m in args.model:
            for n in prompts:
                for e in engines[r % len(engines) :] + engines[: r % len(engines)]:
                    if e == "llama.cpp":
                        tps = llama_pp(args.llama_bench, m, n, args.threads)
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
            if "hotcold_gemv" in row:
                row["gemv_ratio_vs_llama"] = row["hotcold_gemv"]["median"] / llama
                row["speedup_vs_gemv"] = row["hotcold"]["median"] / row["hotcold_gemv"]["median"]
            results.append(row)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "rounds": args.rounds,
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
