"""Decode speed at the default thread count vs fixed -t, on an idle machine and with busy processes.

Runs `hotcold bench --json` (tg, sparse) as a child for -t 1 .. -t <cores> and for the default (no -t,
which leaves cores that other processes keep busy to them), first on the machine as it is, then with
--busy N processes (not niced) spinning beside it. Prints JSON; --results appends a dated section to
benchmarks/RESULTS_LOG.md. Run it on an otherwise quiet machine.

    python benchmarks/busy_threads.py [-m MODEL] [-n 128] [--busy 1] [-r 3] [--results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

SPIN = "import time\nwhile True: pass"


def bench(model: str | None, n: int, reps: int, threads: int | None) -> float:
    cmd = [
        sys.executable,
        "-m",
        "hotcold",
        "bench",
        "-p",
        "0",
        "-n",
        str(n),
        "-r",
        str(reps),
        "--mode",
        "sparse",
    ]
    cmd += ["--json"] + (["-m", model] if model else []) + (["-t", str(threads)] if threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    return float(json.loads(out)[0]["tokens_per_s"])


def measure(model, n, reps, cores) -> dict:
    fixed = {t: bench(model, n, reps, t) for t in range(1, cores + 1)}
    default = bench(model, n, reps, None)
    best = max(fixed.values())
    return {"fixed": fixed, "default": default, "default_vs_best": default / best}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model file (default: the bundled demo model)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens per run")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="spinning processes for the busy case")
    ap.add_argument("--results", action="store_true", help="append to benchmarks/RESULTS_LOG.md")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    res = {"date": dt.date.today().isoformat(), "cores": cores, "model": args.model or "demo", "n": args.n}
    res["idle"] = measure(args.model, args.n, args.repetitions, cores)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    try:
        res[f"busy_{args.busy}"] = measure(args.model, args.n, args.repetitions, cores)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(json.dumps(res, indent=2))
    if args.results:
        lines = [
            f"\n## Default threads on a busy machine ({res['date']})\n",
            f"`{' '.join(['python'] + sys.argv)}`, ",
        ]
        lines.append(
            f"{cores} cores, model {res['model']}, tg{args.n}, sparse, tokens/s (best of {args.repetitions}):\n\n"
        )
        lines.append(
            "| load | "
            + " | ".join(f"-t {t}" for t in range(1, cores + 1))
            + " | default | default / best |\n"
        )
        lines.append("|---" * (cores + 3) + "|\n")
        for key in ("idle", f"busy_{args.busy}"):
            m = res[key]
            row = " | ".join(f"{m['fixed'][t]:.1f}" for t in range(1, cores + 1))
            lines.append(f"| {key} | {row} | {m['default']:.1f} | {m['default_vs_best']:.2f} |\n")
        with open(Path(__file__).with_name("RESULTS_LOG.md"), "a") as f:
            f.write("".join(lines))
    return res


if __name__ == "__main__":
    main()
