"""Peak resident memory of loading a model and running one forward, against the file size.

Weights are memory-mapped and used in place, so peak RSS should be about one file size (the mapped pages
count once they are touched) plus activations and the KV cache, never two copies of the weights.

    python benchmarks/load_rss.py --shape 1b [--model PATH] [--dense]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
import hotcold
start = time.perf_counter()
llm = hotcold.load(sys.argv[1], device="cpu", dense=sys.argv[2] == "1", ctx_size=256)
load_s = time.perf_counter() - start
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
llm.logits(list(range(1, 33)))
forward_s = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_seconds": load_s, "forward32_seconds": forward_s, "rss_after_load": after_load, "peak_rss": peak}))
"""


def baseline_rss() -> int:
    """RSS of a process that imported torch and hotcold but loaded nothing."""
    code = "import resource, hotcold, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model file (default: synthesize one)")
    ap.add_argument("--shape", default="1b", help="synth shape when no --model")
    ap.add_argument("--workdir", default="/tmp/hotcold-bench")
    ap.add_argument("--dense", action="store_true", help="load with dense=True")
    args = ap.parse_args(argv)
    if args.model:
        path = Path(args.model)
    else:
        path = Path(args.workdir) / f"synth-{args.shape}.powerinfer.gguf"
        if not path.exists():
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).parent / "synth.py"),
                    "--shape",
                    args.shape,
                    "-o",
                    str(path),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "1" if args.dense else "0"], capture_output=True, text=True
    )
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    child = json.loads(out.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    base = baseline_rss()
    result = {
        "benchmark": "load_rss",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "model": str(path),
        "file_bytes": size,
        "baseline_rss_bytes": base,
        **child,
        "peak_rss_over_file": child["peak_rss"] / size,
        "peak_rss_minus_baseline_over_file": (child["peak_rss"] - base) / size,
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
