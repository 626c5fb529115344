"""CPU kernel bandwidth: sparse row-gather GEMV and sparse axpy per weight type, against the machine.

Prints JSON and appends a dated section to benchmarks/RESULTS_LOG.md. Shapes are FFN matrices of a 1B
model (22 of 5632 x 2048, one per layer, so nothing stays in cache between calls) and of a 7B model
(6 of 11008 x 4096: a call reads 4x the bytes, so fixed per-call costs weigh less); rows are drawn at
random for every call. Effective GB/s = bytes of the rows a call had to read / its time. Everything
is measured side by side in one run, in interleaved rounds, and the median is reported; "dense GEMV"
is the gather kernel over all rows in order, the fastest dense matrix-vector product measured here.
`ffn_step` times the decode path's single C call for a whole sparse FFN (SparseFFNPlan with a mask).

    python benchmarks/kernel_bandwidth.py [--quick] [--threads 1,2] [--shapes 1b,7b] [--no-results]
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

import gguf
import torch
from gguf import GGMLQuantizationType as Q

from hotcold.gguf.quants import QuantTensor, row_bytes
from hotcold.kernels import cpu, ffn_calls

SHAPES = {"1b": (5632, 2048, 22), "7b": (11008, 4096, 6)}  # rows, columns, matrices
F, D, LAYERS = SHAPES["1b"]  # machine_bandwidth's torch mv reference
FORMATS = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
FORMATS |= {name: Q[name.upper()] for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")}
FORMATS |= {name: Q[name.upper()] for name in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")}
DEFAULT_FORMATS = ["f16", "bf16", "f32", "q8_0", "q4_0", "q4_k", "q6_k"]  # --formats all: every one
DENSITIES = [0.05, 0.10, 0.25, 0.50, 1.00]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def median_gbps(fn, nbytes, rounds: int, clock=time.perf_counter) -> float:
    fn()  # warm up (and page in)
    times = []
    for _ in range(rounds):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return nbytes / statistics.median(times) / 1e9


def machine_bandwidth(threads: list[int], rounds: int) -> dict:
    """Large-tensor copy (bytes read + written) and torch's dense mv, fp32 and fp16."""
    src = torch.ones(64 * 1024 * 1024)  # 256 MiB
    dst = torch.empty_like(src)
    w32 = [torch.randn(F, D) for _ in range(4)]
    w16 = [torch.randn(F, D).half() for _ in range(LAYERS // 2)]
    x32, x16 = torch.randn(D), torch.randn(D).half()
    res: dict = {"copy_gbps": {}, "torch_mv_f32_gbps": {}, "torch_mv_f16_gbps": {}}
    saved = torch.get_num_threads()
    for th in threads:
        torch.set_num_threads(th)
        res["copy_gbps"][th] = median_gbps(lambda: dst.copy_(src), 2 * src.numel() * 4, rounds)
        res["torch_mv_f32_gbps"][th] = median_gbps(
            lambda: [torch.mv(w, x32) for w in w32], 4 * F * D * 4, rounds
        )
        res["torch_mv_f16_gbps"][th] = median_gbps(
            lambda: [torch.mv(w, x16) for w in w16], len(w16) * F * D * 2, rounds
        )
        if th == 1:  # CPU-time figures, comparable with the kernels' *_cpu_time rows
            res["torch_mv_f32_cpu_time_gbps"] = median_gbps(
                lambda: [torch.mv(w, x32) for w in w32], 4 * F * D * 4, rounds, time.thread_time
            )
            res["torch_mv_f16_cpu_time_gbps"] = median_gbps(
                lambda: [torch.mv(w, x16) for w in w16], len(w16) * F * D * 2, rounds, time.thread_time
            )
    torch.set_num_threads(saved)
    return res


def make_weights(fmt: str, f: int, d: int, layers: int) -> tuple[list, int]:
    """`layers` distinct matrices (copies of one random matrix) and the bytes of one row."""
    base = torch.randn(f, d) * 0.02
    kind = FORMATS[fmt]
    if isinstance(kind, torch.dtype):
        w = base.to(kind)
        return [w.clone() for _ in range(layers)], d * w.element_size()
    try:
        qt = QuantTensor.from_float(base, kind)
    except ValueError:  # no quantizer for the type: random blocks with small scales (speed is the same)
        import numpy as np

        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = np.random.default_rng(0).integers(0, 256, size=(f * d // block, size), dtype=np.uint8)
        raw[:, :2] = np.array([0.001], dtype=np.float16).view(
            np.uint8
        )  # most types keep a scale there; others' is moot
        qt = QuantTensor(torch.from_numpy(raw.reshape(f, -1)), kind, (f, d))
    return [QuantTensor(qt.data.clone(), kind, qt.shape) for _ in range(layers)], row_bytes(kind, d)


def bench_format(fmt: str, shape: str, threads: list[int], densities: list[float], rounds: int) -> dict:
    """{kernel: {threads: {density% or "dense": GB/s}}}, interleaving all cases in every round."""
    F, D, LAYERS = SHAPES[shape]  # noqa: N806 (the module's names for the shape)
    weights, rb = make_weights(fmt, F, D, LAYERS)
    x = torch.randn(1, D)
    a = [torch.randn(1, F).abs() + 0.1 for _ in range(LAYERS)]  # no exact zeros: density = mask density
    # ffn_step: the decode path's one C call (SparseFFNPlan with a given mask) over gate = matrix i, up = i+1,
    # down_t = i+2: gate rows where the mask is set, up and down rows only where relu(gate) != 0
    plans = [
        ffn_calls.SparseFFNPlan(weights[(i + 1) % LAYERS], weights[i], weights[(i + 2) % LAYERS])
        for i in range(LAYERS)
    ]
    kernels = ("gather", "axpy", "ffn_step")
    cases = [(k, th, dens) for k in kernels for th in threads for dens in [*densities, None]]
    times: dict = {c: [] for c in cases}
    cpu_times: dict = {c: [] for c in cases}  # thread CPU time: meaningful for 1 thread on a busy machine
    nbytes: dict = {c: [] for c in cases}

    def run(kernel, th, masks):
        if kernel == "gather":
            for w, m in zip(weights, masks, strict=True):
                cpu.gather_matvec(w, x, m, threads=th)
        elif kernel == "axpy":
            for w, aa, m in zip(weights, a, masks, strict=True):
                cpu.sparse_axpy(w, aa, m, threads=th)
        else:
            for plan, m in zip(plans, masks, strict=True):
                plan(x, rows=torch.ones(1, F, dtype=torch.bool) if m is None else m, threads=th)

    def step_rows(masks) -> int:
        """Rows the ffn_step reads: gate rows of the mask, up and down rows where relu(gate) != 0."""
        total = 0
        for i, m in enumerate(masks):
            m = torch.ones(1, F, dtype=torch.bool) if m is None else m
            g = cpu.gather_matvec(weights[i], x, m)
            total += int(m.sum()) + 2 * int((m & (g > 0)).sum())
        return total

    run("gather", threads[0], [None] * LAYERS)  # warm-up: page everything in
    run("axpy", threads[0], [None] * LAYERS)
    for _ in range(rounds):
        for c in cases:
            kernel, th, dens = c
            masks = [None if dens is None else torch.rand(1, F) < dens for _ in range(LAYERS)]
            rows = (
                step_rows(masks)
                if kernel == "ffn_step"
                else sum(F if m is None else int(m.sum()) for m in masks)
            )
            c0, t0 = time.thread_time(), time.perf_counter()
            run(kernel, th, masks)
            times[c].append(time.perf_counter() - t0)
            cpu_times[c].append(time.thread_time() - c0)
            nbytes[c].append(rows * rb)
    out: dict = {}
    for (kernel, th, dens), ts in times.items():
        gbps = statistics.median(b / t / 1e9 for b, t in zip(nbytes[(kernel, th, dens)], ts, strict=True))
        key = "dense" if dens is None else f"{round(dens * 100)}%"
        out.setdefault(kernel, {}).setdefault(th, {})[key] = round(gbps, 2)
        if th == 1:
            cpu_gbps = statistics.median(
                b / t / 1e9
                for b, t in zip(nbytes[(kernel, th, dens)], cpu_times[(kernel, th, dens)], strict=True)
            )
            out.setdefault(kernel + "_cpu_time", {}).setdefault(th, {})[key] = round(cpu_gbps, 2)
    return out


def results_section(res: dict, cmd: str) -> str:
    m = res["machine"]
    lines = [
        f"\n## CPU kernels — {res['date']}\n",
        f"`{cmd}` · {m['cpu']}, {m['cores']} cores, SIMD {m['simd']}, backend {m['backend']}, "
        f"load average before/after {m['loadavg_before']} / {m['loadavg_after']}\n",
        "FFN matrices of a 1B model (22 of 5632 x 2048) and of a 7B model (6 of 11008 x 4096), rows drawn "
        "at random per call, effective GB/s (bytes of the rows read / time), median of interleaved rounds; "
        "`dense` = rows=None; the ratio is the 10% figure over the dense GEMV (the gather kernel's `dense`) "
        "of the same shape, type and threads. `ffn_step` is the decode path's single C call (gate, up and "
        "down over the mask, up and down only where relu(gate) != 0; its `dense` column is an all-set "
        "mask), timed with the bytes of the rows it reads.\n",
        "| threads | copy (r+w) | torch mv f32 | torch mv f16 |",
        "| --- | --- | --- | --- |",
    ]
    for th in res["threads"]:
        lines.append(
            f"| {th} | {res['copy_gbps'][th]:.1f} | {res['torch_mv_f32_gbps'][th]:.1f} "
            f"| {res['torch_mv_f16_gbps'][th]:.1f} |"
        )
    keys = [f"{round(d * 100)}%" for d in res["densities"]] + ["dense"]
    lines += ["", "| shape | kernel | type | threads | " + " | ".join(keys) + " | 10% / dense GEMV |"]
    lines.append("| --- " * (5 + len(keys)) + "|")
    for kernel in ("gather", "axpy", "ffn_step", "gather_cpu_time", "axpy_cpu_time", "ffn_step_cpu_time"):
        for shape, by_fmt in res["kernels"].items():
            for fmt, r in by_fmt.items():
                for th in res["threads"]:
                    if th not in r.get(kernel, {}):
                        continue
                    row = r[kernel][th]
                    gemv = r["gather_cpu_time" if kernel.endswith("cpu_time") else "gather"][th]["dense"]
                    ratio = f"{row['10%'] / gemv:.2f}" if "10%" in row and gemv else "-"
                    cells = " | ".join(f"{row[k]:.1f}" for k in keys)
                    lines.append(f"| {shape} | {kernel} | {fmt} | {th} | {cells} | {ratio} |")
    if "torch_mv_f16_cpu_time_gbps" in res:
        lines.append(
            f"\ntorch mv by thread CPU time, 1 thread: f32 {res['torch_mv_f32_cpu_time_gbps']:.1f}, "
            f"f16 {res['torch_mv_f16_cpu_time_gbps']:.1f} GB/s (compare with the `*_cpu_time` rows)."
        )
    lines.append(
        "\n`*_cpu_time` rows: the same 1-thread runs timed by the thread's CPU time, which a busy machine "
        "distorts less than wall time."
    )
    if max(m["loadavg_before"][0], m["loadavg_after"][0]) > (m["cores"] or 1):
        lines.append(
            "**The machine was oversubscribed during this run** (load average above the core count): an "
            "OpenMP fork/join then waits for a descheduled worker (~20 ms per call measured), so the "
            "2-thread rows (and torch's own 2-thread mv) say nothing about the kernels; rerun on a quiet machine."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer rounds, densities 10%% and 100%%, F16 and Q4_0 only"
    )
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--formats", default=None, help=f"comma-separated subset of {','.join(FORMATS)}, or all")
    ap.add_argument("--shapes", default="1b,7b", help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS_LOG.md")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    shapes = args.shapes.split(",")
    if unknown := [sh for sh in shapes if sh not in SHAPES]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.formats == "all":
        formats = list(FORMATS)
    else:
        formats = (
            args.formats.split(",") if args.formats else (["f16", "q4_0"] if args.quick else DEFAULT_FORMATS)
        )
    densities = [0.10, 1.00] if args.quick else DENSITIES
    rounds = args.rounds or (3 if args.quick else 7)

    res: dict = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "backend": cpu.backend(),
            "simd": cpu.simd(),
            "loadavg_before": [round(v, 2) for v in os.getloadavg()],
        },
        "threads": threads,
        "densities": densities,
        "shapes": {k: {"rows": f, "cols": d, "matrices": n} for k, (f, d, n) in SHAPES.items()},
    }
    res.update(machine_bandwidth(threads, rounds))
    res["kernels"] = {}
    for shape in shapes:
        for fmt in formats:
            res["kernels"].setdefault(shape, {})[fmt] = bench_format(fmt, shape, threads, densities, rounds)
            print(f"# {shape} {fmt} done", file=sys.stderr, flush=True)
    res["machine"]["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(res, indent=1))
    if not args.no_results:
        path = Path(__file__).with_name("RESULTS_LOG.md")
        if not path.exists():
            path.write_text(
                "# Benchmark results\n\nEvery figure quoted in the docs, with the command that produced it.\n"
            )
        cmd = "python benchmarks/kernel_bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with path.open("a") as f:
            f.write(results_section(res, cmd.strip()))
    return res


if __name__ == "__main__":
    main()
