"""The sparse row kernels of an older checkout against this tree's, in one process: bits and speed.

Compiles the older checkout's `_cpu_kernels.c` with this tree's flags, loads both libraries, and for each
weight type (a 1B FFN matrix, 5632 x 2048, random values or random blocks):
- bits: gathers and axpys of 1, 3 and 8 tokens, 10% and all rows, 1 and 2 threads, must be equal between the
  two libraries (a kernel change that keeps the arithmetic keeps every bit);
- speed: one token over 10% of the rows (a sparse decode step's gate / up gather and down axpy) and, with
  `--tokens 8`, eight tokens with their own masks (a batched step), best of `--rounds` interleaved rounds of
  `--calls` calls, old and new alternating, so the host's drift falls on both alike. Times include the
  Python call (~20-30 us).

    python benchmarks/kernels_before_after.py --before-src OLD/src [--formats q4_0,q4_k] [--tokens 1,8]
        [--threads 2] [--rounds 7] [--calls 20] [--out J]

Prints JSON (and writes it to --out). An old checkout is a `git worktree add DIR COMMIT`.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if (
    not __package__
):  # run as `python benchmarks/kernels_before_after.py`: the checkout, not benchmarks/, goes first on
    sys.path[0] = str(
        Path(__file__).resolve().parents[1]
    )  # sys.path (a sibling must never shadow a dependency)
from benchmarks.kernel_bandwidth import FORMATS, make_weights  # noqa: E402
from hotcold.kernels import build, cabi, cpu  # noqa: E402

F, D = 5632, 2048


def compile_before(src: Path) -> ctypes.CDLL:
    """The older checkout's kernels, built with the flags this tree's loader chose."""
    c_file = src / "hotcold" / "kernels" / "_cpu_kernels.c"
    if not c_file.is_file():
        raise SystemExit(f"error: {c_file} not found (--before-src is an older checkout's src/ folder)")
    cc = (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    )  # as hotcold.kernels.build picks it
    if cc is None:
        raise SystemExit("error: no C compiler (cc / gcc) to build the older kernels")
    out = Path(tempfile.mkdtemp(prefix="hotcold-before-")) / "before.so"
    for flags in build._FLAG_SETS:
        res = subprocess.run(
            [cc, *flags, *build._BASE_FLAGS, "-o", str(out), str(c_file)], capture_output=True
        )
        if res.returncode == 0:
            lib = ctypes.CDLL(str(out))
            header = c_file.parent / "c" / "hotcold.h"  # older checkouts bound by hand: today's signatures
            cabi.bind(lib, header.read_text() if header.is_file() else None)
            return lib
    raise SystemExit(f"error: {c_file} does not compile: {res.stderr.decode()[-2000:]}")


def use(lib: ctypes.CDLL) -> None:
    build._lib = lib


def same_bits(old, new, w, gen: torch.Generator) -> tuple[int, int]:
    equal = total = 0
    for t in (1, 3, 8):
        x = torch.randn(t, D, generator=gen)
        a = torch.randn(t, F, generator=gen)
        for density in (0.1, 1.0):
            m = torch.rand(t, F, generator=gen) < density
            for threads in (1, 2):
                got = []
                for lib in (old, new):
                    use(lib)
                    got.append(
                        (
                            cpu.gather_matvec(w, x, m, threads=threads),
                            cpu.sparse_axpy(w, a * m, m, threads=threads),
                        )
                    )
                for o, n in zip(*got):
                    total += 1
                    equal += torch.equal(o.view(torch.int32), n.view(torch.int32))
    return equal, total


def timed(old, new, calls: dict, rounds: int, n: int) -> dict:
    best: dict = {}
    for _ in range(rounds):
        for name, lib in (("before", old), ("after", new)):
            use(lib)
            for op, fn in calls.items():
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best[(name, op)] = min(best.get((name, op), float("inf")), (time.perf_counter() - start) / n)
    return {
        op: {
            "before_us": round(best[("before", op)] * 1e6, 1),
            "after_us": round(best[("after", op)] * 1e6, 1),
            "speedup": round(best[("before", op)] / best[("after", op)], 3),
        }
        for op in calls
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=True, type=Path, help="an older checkout's src/ folder")
    ap.add_argument(
        "--formats", default="q4_0,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,f16", help=f"subset of {','.join(FORMATS)}"
    )
    ap.add_argument(
        "--tokens", default="1,8", help="token counts to time (1: 10%% of rows; T > 1: a mask each)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"unknown format {f!r} (choose from {', '.join(FORMATS)})")
    tokens = [int(t) for t in args.tokens.split(",")]
    old, new = compile_before(args.before_src), build.get_lib()
    if new is None:
        raise SystemExit("error: this tree's C kernels are not built (no compiler?)")
    gen = torch.Generator().manual_seed(0)
    rows = torch.zeros(F, dtype=torch.bool)
    rows[torch.randperm(F, generator=gen)[: F // 10]] = True
    results = {}
    for fmt in formats:
        (w,), row_bytes = make_weights(fmt, F, D, 1)
        equal, total = same_bits(old, new, w, gen)
        entry = {"bits_equal": f"{equal}/{total}"}
        for t in tokens:
            x = torch.randn(t, D, generator=gen) if t > 1 else torch.randn(D, generator=gen)
            m = torch.rand(t, F, generator=gen) < 0.1 if t > 1 else rows
            a = torch.randn(m.shape, generator=gen) * m
            calls = {
                "gather": lambda w=w, x=x, m=m: cpu.gather_matvec(w, x, m, threads=args.threads),
                "axpy": lambda w=w, a=a, m=m: cpu.sparse_axpy(w, a, m, threads=args.threads),
            }
            entry[f"T={t}"] = timed(old, new, calls, args.rounds, args.calls)
        results[fmt] = entry
        print(f"# {fmt}: {json.dumps(entry)}", file=sys.stderr)
    use(new)
    res = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "machine": platform.machine(),
        "simd": build.simd(),
        "before_src": str(args.before_src),
        "threads": args.threads,
        "shape": [F, D],
        "kernels": results,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()
