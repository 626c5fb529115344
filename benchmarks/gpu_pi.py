"""The original PowerInfer (CUDA build in .anchors/powerinfer-cuda, a copy of ../shared/anchors) in
benchmarks/gpu.py's one GPU call, compared fairly with hotcold (#46):

- every run gets `-c` equal to hotcold's context (anchors/powerinfer-gpu.sh passes none: the original then
  budgets a 512-token KV cache against hotcold's 2048);
- the hybrid runs twice: at hotcold's `--vram-budget` (the same flag: hotcold's budget also holds ~600 MiB
  of prefill scratch the original does not budget) and at the budget that gives the original as many hot
  FFN bytes as hotcold holds (`equal_bytes_budget`, from the original's own spending rules: reference
  §4.2 and §3.2 of powerinfer-format.md).

Each configuration is its own `main` process with its own time limit, and its figure is saved as it comes.
The plan (`pi_plan`) and the budget arithmetic are pure functions, tested without a GPU.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
PROMPT = "Once upon a time"
# the original's FFN split (llama.cpp:3109-3116): one "slice" a neuron costs n_ff * type size * 4.5 (gated)
# or * 2 bytes, and the solver gets floor(remaining / that) * 4 neurons
_FFN = re.compile(r"^blk\.\d+\.ffn_(up|gate|down|down_t)\.weight$")
_CPU_ONLY = ("token_embd", "token_embd_norm", "position_embd", "rope_freqs")


@dataclass(frozen=True)
class PIRun:
    name: str  # the pi-table / gpu.json name (hybrid_budget -> pi_hybrid_tps, ...)
    field: str  # gpu.json field for its tokens/s
    argv: tuple[str, ...]  # main's arguments after the binary
    reset_index: str | None = None  # the sparse file whose .generated.gpuidx goes first (a new budget)


def pi_plan(sparse: Path, dense: Path, *, budget_gib: float, equal_bytes_gib: float | None, ngl: int,
            n_gen: int, threads: int, ctx: int) -> list[PIRun]:  # fmt: skip
    """The original's configurations in the order they run (most important first), every one at -c ctx."""
    common = (
        "-n",
        str(n_gen),
        "-t",
        str(threads),
        "-c",
        str(ctx),
        "-p",
        PROMPT,
        "--temp",
        "0",
        "--ignore-eos",
    )
    s, d = str(sparse), str(dense)
    runs = [PIRun("hybrid_budget", "pi_hybrid_tps", ("-m", s, "--vram-budget", _gib(budget_gib), *common), s)]
    if equal_bytes_gib is not None:
        argv = ("-m", s, "--vram-budget", _gib(equal_bytes_gib), *common)
        runs.append(PIRun("hybrid_equal_bytes", "pi_hybrid_equal_bytes_tps", argv, s))
    runs += [
        PIRun("sparse_all_gpu", "pi_sparse_all_gpu_tps", ("-m", s, "--vram-budget", "120", *common), s),
        PIRun("dense_ngl", "pi_dense_ngl_tps", ("-m", d, "-ngl", str(ngl), *common)),
        PIRun("dense_all_gpu", "pi_dense_all_gpu_tps", ("-m", d, "-ngl", "999", *common)),
        PIRun("sparse_cpu_only", "pi_sparse_cpu_only_tps", ("-m", s, "--vram-budget", "0", *common)),
    ]
    return runs


def _gib(x: float) -> str:
    """A budget in GiB for main's float flag, rounded up at 1e-4 GiB (~0.1 MiB: a few neurons, not 400)."""
    return f"{math.ceil(x * 1e4) / 1e4:.4f}"


def pi_spending(tensors: dict[str, tuple[str, int]], *, n_layer: int, n_ff: int, n_embd_gqa: int,
                ctx: int, kv_bytes: int = 2) -> dict:  # fmt: skip
    """What the original spends its budget on before hot neurons, from the file's tensors
    {name: (ggml type name, bytes)}: every tensor but the embedding and the FFN matrices (attention, norms,
    predictors, output), then the K and V caches at ctx (f16), then FFN neurons at `slice_bytes` per 4."""
    dense = sum(
        n for name, (_, n) in tensors.items() if not _FFN.match(name) and not name.startswith(_CPU_ONLY)
    )
    up = next((t for name, t in tensors.items() if name.endswith("ffn_up.weight")), None)
    if up is None:
        raise ValueError("no ffn_up tensor: not a FFN model file")
    has_gate = any(name.endswith("ffn_gate.weight") for name in tensors)
    elem = {"F16": 2.0, "BF16": 2.0, "F32": 4.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}.get(up[0].upper())
    if elem is None:
        raise ValueError(f"ffn_up of type {up[0]}: the original's slice size for it is not known here")
    slice_bytes = int(n_ff * elem * (4.5 if has_gate else 2))
    kv = 2 * n_embd_gqa * n_layer * ctx * kv_bytes
    return {"dense_bytes": dense, "kv_bytes": kv, "slice_bytes": slice_bytes}


def equal_bytes_budget(spending: dict, hot_neurons: int) -> float:
    """The --vram-budget (GiB) at which the original's solver may place `hot_neurons` FFN neurons (its
    capacity is floor(remaining / slice) * 4): its dense tensors + KV + ceil(hot / 4) slices."""
    slices = math.ceil(hot_neurons / 4)
    return (spending["dense_bytes"] + spending["kv_bytes"] + slices * spending["slice_bytes"]) / GIB


def pi_capacity(spending: dict, budget_gib: float) -> int:
    """Hot neurons the original's solver may place at a budget (0 when its dense tensors + KV do not fit)."""
    remaining = int(budget_gib * GIB) - spending["dense_bytes"] - spending["kv_bytes"]
    return max(0, remaining // spending["slice_bytes"] * 4)


def hotcold_hot_neurons(plan) -> int:
    """Hot neurons hotcold's plan (placement BudgetPlan) has room for: hot_bytes over a neuron's bytes,
    at most the layers' widths (the solver fills layers greedily; every layer has the same cost here)."""
    per = max(plan.bytes_per_neuron) if plan.bytes_per_neuron else 0
    return plan.hot_bytes // per if per else 0


def parse_tps(log: str) -> float | None:
    """Generation tokens/s from main's timings (" eval time = ... tokens per second"), not the prompt's."""
    rows = [ln for ln in log.splitlines() if " eval time" in ln and "prompt eval" not in ln]
    m = re.search(r"([0-9.]+) tokens per second", rows[-1]) if rows else None
    return float(m.group(1)) if m else None


def pi_env(anchors: Path, work: Path) -> tuple[dict, str | None]:
    """main's environment as powerinfer-gpu.sh builds it: the cuBLAS / cudart 13 that torch brings on the
    library path, the solver's Python package and the cvxopt wheel on PYTHONPATH. (env, a problem or None)"""
    env = dict(os.environ)
    libs = []
    for so in ("libcublas.so.13", "libcudart.so.13"):
        try:
            found = subprocess.run(
                ["find", "/", "-xdev", "-name", so], capture_output=True, text=True, timeout=60
            )
            path = next(iter(found.stdout.split()), None)
        except subprocess.TimeoutExpired:
            path = None
        if path:
            libs.append(os.path.dirname(path))
    env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    site = work / "site"
    problem = None
    wheels = sorted((anchors / "powerinfer-cuda" / "whl").glob("cvxopt-*.whl"))
    if wheels and not site.exists():
        pip = [
            env.get("PY", "python3"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
        ]
        done = subprocess.run(pip + ["--target", str(site), str(wheels[0])], capture_output=True, text=True)
        if done.returncode != 0:
            problem = f"cvxopt wheel: {done.stderr[-300:]}"
    env["PYTHONPATH"] = f"{anchors / 'powerinfer-cuda' / 'py'}:{site}"
    binary = anchors / "powerinfer-cuda" / "bin" / "main"
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    missing = [ln.strip() for ln in ldd.stdout.splitlines() if "not found" in ln]
    if missing:
        problem = f"missing libraries for {binary}: {missing}"
    return env, problem
