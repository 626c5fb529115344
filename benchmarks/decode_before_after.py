"""Decode speed of this tree against an older checkout, on one model, in one run: `hotcold bench` (tg, sparse and
dense, batch 1 and 8) of each, in interleaved rounds so machine noise hits both alike; medians and after/before
ratios. For refactors that must keep speed within noise (the load-time decoder choice, say).

    git worktree add /tmp/before <commit>
    python benchmarks/decode_before_after.py --before-src /tmp/before/src -m synth-1b.powerinfer.gguf [--rounds 5]
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

if (
    not __package__
):  # run as `python benchmarks/decode_before_after.py`: the checkout, not benchmarks/, goes first
    sys.path[0] = str(
        Path(__file__).resolve().parents[1]
    )  # on sys.path (a sibling must never shadow a dependency)
from benchmarks.kernel_bandwidth import cpu_name  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def bench(src: Path, model: str, args) -> list[dict]:
    """`hotcold bench --json` rows from the checkout whose package is under `src`."""
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "hotcold", "bench", "-m", model, "-p", "0", "-n", str(args.n_gen),
           "-b", args.batch, "-r", str(args.repetitions), "-t", str(args.threads), "--json"]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"error: bench from {src} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=True, help="the older checkout's src/ folder")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-b", "--batch", default="1,8")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    before = Path(args.before_src).resolve()
    if not (before / "hotcold" / "__init__.py").is_file():
        raise SystemExit(
            f"error: {before} holds no hotcold package (--before-src is an older checkout's src/)"
        )
    samples: dict[tuple[str, str, str], list[float]] = {}
    decoders: dict[tuple[str, str, str], str] = {}
    load = os.getloadavg()
    for _ in range(args.rounds):
        for side, src in (("before", before), ("after", SRC)):
            for row in bench(src, args.model, args):
                key = (side, row["mode"], row["test"])
                samples.setdefault(key, []).append(row["tokens_per_s"])
                decoders[key] = row.get("decoder", "-")
    rows = []
    for (side, mode, test), values in sorted(samples.items()):
        if side != "after":
            continue
        b, a = statistics.median(samples["before", mode, test]), statistics.median(values)
        rows.append({"mode": mode, "test": test, "before_tps": b, "after_tps": a, "after_over_before": a / b,
                     "decoder_after": decoders["after", mode, test], "before_all": samples["before", mode, test],
                     "after_all": values})  # fmt: skip
    out = {
        "date": dt.datetime.now().isoformat(timespec="minutes"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "model": Path(args.model).name,
        "threads": args.threads,
        "rounds": args.rounds,
        "load_average_before_after": [list(load), list(os.getloadavg())],
        "rows": rows,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
