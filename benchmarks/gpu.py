"""Every GPU figure in ONE call on a borrowed NVIDIA machine (H200: one call of ~9 minutes, no second try).

Parts, in order of importance, each checked against a global deadline (--deadline-s) before it starts,
each with its own time limit, each saving $OUT/gpu.json as soon as a figure is measured (one failure
never loses the others; a part that cannot fit is skipped with the reason recorded):

1. bandwidth: GPU device-to-device copy (GB/s, read + write), host copy (a large torch CPU copy), pinned
   host-to-device;
2. synth: a 7B-wide synthetic ReLU-LLaMA with fewer layers (--layers, default 8; ~10% firing, hottest 20%
   take 80%), F16, as a PowerInfer file (activation/ beside it) and the same weights in the dense layout;
3. hotcold, all on the GPU: dense file, then sparse file (tokens/s, effective GB/s, ms per token / layer);
4. the original PowerInfer on the same two files (gpu_pi: its `main` from .anchors/powerinfer-cuda, every run
   at -c --ctx; hybrid at hotcold's budget and at equal hot bytes, sparse all-GPU, dense -ngl, dense
   all-GPU, CPU only), each run with its own limit inside the part's;
5. hotcold at a VRAM budget holding about a third of the FFN (attention + KV at --ctx + predictors +
   output + scratch + FFN / 3): hybrid vs dense -ngl at the same VRAM, and sparse CPU-only; the hybrid's
   per-layer CPU / GPU times and overlap (sparse/hybrid.LayerClock, 8 more tokens after the timed ones);
CPU runs and the cold side take cores - 1 threads, so the thread that launches the GPU work keeps a core.
6. the Triton kernels (hot_gather_matvec, hot_axpy) on 7B FFN shapes at 10% / 100% rows, F16, against the
   copy bandwidth; `benchmarks/gpu_fused.benchmark(device)` (the fused decode kernels); every kernel timed
   in a CUDA graph over copies of its operands 3x the L2 (gpu_timing);
7. `pytest -m gpu` on the test files that hold GPU tests.

On a GPU each hotcold run and the fused-kernel benchmark run in a child process (a hang or a CUDA error
that poisons a process costs that part alone); PowerInfer and pytest are child processes too, killed with
everything they started at their limits; a watchdog saves and exits 25 s after the deadline, whatever hangs.

    python benchmarks/gpu.py --out $OUT/gpu.json          # the device call: benchmarks/gpu_run.sh
    python benchmarks/gpu.py --cpu-dry-run --out /tmp/gpu.json   # the plumbing on the CPU, tiny shape
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if not __package__:  # run as `python benchmarks/gpu.py`: the checkout, not benchmarks/, goes first on
    sys.path[0] = str(REPO)  # sys.path (a sibling must never shadow a dependency)

from benchmarks.gpu_bench import GIB, REQUIRED, Bench, finish  # noqa: E402, F401 (REQUIRED: tests)
from benchmarks.gpu_measure import (  # noqa: E402
    cold_threads,
    equal_bytes,
    fused_kernels,
    gpu_bandwidth,
    host_copy_gb_s,
    kernel_bench,
    ngl_for,
    vram_budget_gib,
)
from benchmarks.gpu_parts import gpu_tests, in_child, one_run, powerinfer, run_config, synth_files  # noqa: E402
from benchmarks.gpu_summary import summary  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gpu.json")
    ap.add_argument(
        "--cpu-dry-run", action="store_true", help="the plumbing on the CPU: tiny shape, few tokens"
    )
    ap.add_argument("--shape", default=None, help="synth.py shape (default 7b; tiny in a dry run)")
    ap.add_argument(
        "--layers", type=int, default=None, help="layers of the synthetic model (default 8; 2 dry)"
    )
    ap.add_argument(
        "--n-gen", type=int, default=None, help="tokens per decode measurement (default 64; 4 dry)"
    )
    ap.add_argument("--vocab", type=int, default=None, help="synth.py vocabulary (default 32000; 1024 dry)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="tokens decoded before each measurement (16; 2 dry)"
    )
    ap.add_argument("--ctx", type=int, default=2048, help="context size the KV cache is charged for")
    ap.add_argument(
        "--threads", type=int, default=cold_threads(os.cpu_count()), help="CPU threads (default: cores - 1)"
    )
    ap.add_argument("--workdir", default=None, help="model files (default /dev/shm/hotcold-gpu or /tmp/...)")
    ap.add_argument("--anchors", default=str(REPO / ".anchors"), help="a copy of ../shared/anchors")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="no part starts after this")
    ap.add_argument("--synth-limit-s", type=float, default=150.0)
    ap.add_argument("--pi-limit-s", type=float, default=200.0, help="the original's runs together")
    ap.add_argument("--pi-run-limit-s", type=float, default=60.0, help="each of the original's runs")
    ap.add_argument("--tests-limit-s", type=float, default=120.0)
    ap.add_argument("--run-limit-s", type=float, default=120.0, help="each hotcold load + decode")
    ap.add_argument("--fused-limit-s", type=float, default=120.0, help="gpu_fused.benchmark")
    ap.add_argument(
        "--isolate",
        choices=("auto", "all", "none"),
        default="auto",
        help="hotcold runs in child processes (auto: all on a GPU; in a dry run the first only, to check it)",
    )
    ap.add_argument("--one-run", metavar="SPEC.json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_run:
        return one_run(args.one_run)
    dry = args.cpu_dry_run
    args.device = "cpu" if dry else "cuda"
    args.shape = args.shape or ("tiny" if dry else "7b")
    args.layers = args.layers or (2 if dry else 8)
    args.n_gen = args.n_gen or (4 if dry else 64)
    args.warmup = args.warmup if args.warmup is not None else (2 if dry else 16)
    args.vocab = args.vocab or (1024 if dry else None)  # a small vocabulary opens fast (the test's time)
    if args.workdir is None:  # /dev/shm when it holds both files with room to spare (not Docker's 64 MB)
        shm = Path("/dev/shm")
        roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 24 * GIB
        args.workdir = str((shm if roomy and not dry else Path(tempfile.gettempdir())) / "hotcold-gpu")
    b = Bench(Path(args.out), args.deadline_s)
    done = b.watchdog(args.deadline_s + 25)
    try:
        return run_all(b, args)
    finally:
        done.set()


def run_all(b: Bench, args) -> int:
    dry = args.cpu_dry_run
    try:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception as exc:  # a broken driver: the CPU figures still come
        b.note("errors", "cuda", f"{type(exc).__name__}: {exc}")
        gpu = None
    b.set(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=gpu,
        dry_run=dry, shape=args.shape, layers=args.layers, n_gen=args.n_gen, warmup=args.warmup, ctx=args.ctx,
        threads=args.threads, torch=torch.__version__, python=sys.version.split()[0],
    )  # fmt: skip
    if not dry and gpu is None:
        b.note(
            "errors", "cuda", "no CUDA GPU: only the CPU figures can be measured (--cpu-dry-run for a check)"
        )
        args.device = "cpu"
    cuda = args.device == "cuda"

    def bandwidth():
        b.set(host_copy_gb_s=host_copy_gb_s((64 << 20) if dry else GIB))
        if cuda:
            b.set(**gpu_bandwidth())
        else:
            b.note("skipped", "gpu_bandwidth", "no CUDA GPU")

    b.part("bandwidth", bandwidth, need_s=10, limit_s=60)
    files = b.part("synth", lambda: synth_files(b, args), need_s=40, limit_s=args.synth_limit_s + 10)
    if files is None:
        print(summary(b.results))
        return 1
    sparse, dense = files

    def budget():
        gib, parts = vram_budget_gib(sparse, args.ctx)
        b.set(budget_gib=gib, budget_parts_gib=parts)
        b.set(ngl=ngl_for(dense, gib, args.ctx))
        b.set(**equal_bytes(sparse, gib, args.ctx))

    b.part("budget", budget, need_s=1, limit_s=60)
    run = dict(need_s=15, limit_s=args.run_limit_s + 10)
    b.part("dense_all_gpu", lambda: run_config(b, "dense_all_gpu", dense, args, dense=True), **run)
    b.part(
        "sparse_all_gpu", lambda: run_config(b, "sparse_all_gpu", sparse, args, reset_gpu_index=True), **run
    )
    vram, ngl = b.results["budget_gib"], b.results["ngl"]
    if vram is not None and ngl is not None:
        # PowerInfer runs all five of its configurations in one script; the hotcold budget runs come after it
        pi_limit = min(args.pi_limit_s, b.left() - 90)
        pi = lambda: powerinfer(b, args, sparse, dense, pi_limit)  # noqa: E731
        b.part("powerinfer", pi, need_s=60 + 90, limit_s=pi_limit + 20)
    else:
        b.note("skipped", "powerinfer", "no budget or -ngl (the budget part failed)")
    if vram is not None:
        hybrid = dict(vram_budget=vram, reset_gpu_index=True)
        b.part("hybrid", lambda: run_config(b, "hybrid", sparse, args, **hybrid), **run)
    else:
        b.note("skipped", "hybrid", "no budget (the budget part failed)")
    if ngl is not None:
        offload = dict(dense=True, n_gpu_layers=ngl)
        b.part("dense_ngl", lambda: run_config(b, "dense_ngl", dense, args, **offload), **run)
    else:
        b.note("skipped", "dense_ngl", "no -ngl (the budget part failed)")
    b.part("sparse_cpu_only", lambda: run_config(b, "sparse_cpu_only", sparse, args, vram_budget=0), **run)
    finish(b)
    if cuda:

        def kernels():
            b.set(kernels=kernel_bench(b.results["copy_gb_s"]))
            torch.cuda.empty_cache()

        b.part("kernels", kernels, need_s=20, limit_s=90)
    else:
        b.note("skipped", "kernels", "no CUDA GPU")

    def fused():
        if cuda and importlib.util.find_spec("hotcold.kernels.triton_decode") is not None:
            spec = dict(kind="fused", device="cuda", workdir=args.workdir)
            b.set(fused_kernels=in_child(b, "fused_kernels", spec, min(args.fused_limit_s, b.left())))
        else:
            b.set(fused_kernels=fused_kernels(args.device))

    b.part("fused_kernels", fused, need_s=20, limit_s=args.fused_limit_s + 10)
    if cuda:  # what the fixed-shape step (CUDA graph, fused kernels) gives over the eager step, same files
        eager = {"HOTCOLD_STATIC_STEP": "0"}
        b.part(
            "sparse_all_gpu_eager",
            lambda: run_config(b, "sparse_all_gpu_eager", sparse, args, env=eager, reset_gpu_index=True),
            **run,
        )
        b.part(
            "dense_all_gpu_eager",
            lambda: run_config(b, "dense_all_gpu_eager", dense, args, env=eager, dense=True),
            **run,
        )
    else:
        b.note("skipped", "eager_step_runs", "no CUDA GPU")
    if dry:
        b.note("skipped", "gpu_tests", "dry run")
    else:
        b.part(
            "gpu_tests",
            lambda: gpu_tests(b, min(args.tests_limit_s, b.left())),
            need_s=30,
            limit_s=args.tests_limit_s + 10,
        )
    finish(b)
    text = summary(b.results)
    Path(args.out).with_name("gpu-summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
