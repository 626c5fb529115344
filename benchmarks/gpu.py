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
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if not __package__:  # run as `python benchmarks/gpu.py`: the checkout, not benchmarks/, goes first on
    sys.path[0] = str(REPO)  # sys.path (a sibling must never shadow a dependency)
GIB = 1 << 30
# fields every gpu.json has (null when not measured); the GPU issues judge these
REQUIRED = (
    "gpu", "date", "copy_gb_s", "host_copy_gb_s", "h2d_pinned_gb_s",
    "dense_all_gpu_tps", "dense_all_gpu_gb_s", "sparse_all_gpu_tps", "sparse_all_gpu_gb_s",
    "pi_dense_all_gpu_tps", "pi_sparse_all_gpu_tps", "budget_gib", "ngl", "hybrid_tps", "dense_ngl_tps",
    "sparse_cpu_only_tps", "pi_hybrid_tps", "pi_dense_ngl_tps", "pi_sparse_cpu_only_tps", "vram_used_gib",
    "dense_all_gpu_share_of_copy", "sparse_over_dense_all_gpu", "hybrid_over_dense_ngl",
    "hybrid_over_pi_hybrid", "sparse_all_gpu_over_pi", "dense_all_gpu_over_pi", "dense_ngl_over_pi",
    "sparse_cpu_only_over_pi", "pi_hybrid_over_pi_dense_ngl", "pi_hybrid_equal_bytes_tps",
    "hybrid_over_pi_hybrid_equal_bytes", "pi_equal_bytes_budget_gib", "dense_bytes_per_token",
    "sparse_bytes_per_token", "sparse_bytes_ceiling", "errors",
)  # fmt: skip
RATIOS = {  # name: (numerator, denominator)
    "dense_all_gpu_share_of_copy": ("dense_all_gpu_gb_s", "copy_gb_s"),
    "sparse_over_dense_all_gpu": ("sparse_all_gpu_tps", "dense_all_gpu_tps"),
    "hybrid_over_dense_ngl": ("hybrid_tps", "dense_ngl_tps"),
    "hybrid_over_pi_hybrid": ("hybrid_tps", "pi_hybrid_tps"),  # the same flags (-c too)
    "hybrid_over_pi_hybrid_equal_bytes": ("hybrid_tps", "pi_hybrid_equal_bytes_tps"),  # the same hot bytes
    "sparse_bytes_ceiling": ("dense_bytes_per_token", "sparse_bytes_per_token"),  # sparse / dense by bytes
    "sparse_all_gpu_over_pi": ("sparse_all_gpu_tps", "pi_sparse_all_gpu_tps"),
    "dense_all_gpu_over_pi": ("dense_all_gpu_tps", "pi_dense_all_gpu_tps"),
    "dense_ngl_over_pi": ("dense_ngl_tps", "pi_dense_ngl_tps"),
    "sparse_cpu_only_over_pi": ("sparse_cpu_only_tps", "pi_sparse_cpu_only_tps"),
    "pi_hybrid_over_pi_dense_ngl": ("pi_hybrid_tps", "pi_dense_ngl_tps"),
}


class PartTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise PartTimeout()


def kill_tree(pid: int) -> None:
    """End a child we started and everything under it (GNU timeout moves itself to a process group of its
    own, so a group kill would miss PowerInfer's main): SIGTERM to each, then SIGKILL to what is left."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    alive = tree
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        for _ in range(20 if sig == signal.SIGTERM else 0):  # up to 2 s to go quietly
            alive = [p for p in alive if _running(p)]
            if not alive:
                return
            time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie is gone (its parent reaps it)


class Bench:
    """The results dict, saved after every change; parts run under the deadline."""

    def __init__(self, out: Path, deadline_s: float):
        self.out, self.deadline_s, self.t0 = out, deadline_s, time.monotonic()
        self.results: dict = {k: None for k in REQUIRED}
        self.results.update(errors={}, skipped={}, part_seconds={}, runs={})
        self.lock = threading.RLock()
        self.procs: set[subprocess.Popen] = set()

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        with self.lock:
            self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.results, indent=2, default=str))
            tmp.replace(self.out)

    def set(self, **fields) -> None:
        with self.lock:
            self.results.update(fields)
        self.save()

    def note(self, table: str, key: str, text: str) -> None:
        with self.lock:
            self.results[table][key] = text
        print(f"gpu.py: {table} {key}: {text}", file=sys.stderr, flush=True)
        self.save()

    def part(self, name: str, fn, *, need_s: float, limit_s: float):
        """Run fn() unless less than need_s is left; stop it after limit_s (or at the deadline)."""
        left = self.left()
        if left < need_s:
            self.note(
                "skipped", name, f"{left:.0f} s left before the deadline, the part needs ~{need_s:.0f} s"
            )
            return None
        limit = max(1.0, min(limit_s, left))
        start = time.monotonic()
        print(f"gpu.py: {name} (limit {limit:.0f} s, {left:.0f} s left)", file=sys.stderr, flush=True)
        alarm = threading.current_thread() is threading.main_thread()
        if alarm:
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn()
        except PartTimeout:
            self.note("errors", name, f"stopped at its time limit ({limit:.0f} s)")
        except Exception as exc:  # record and go on: one failure must not lose the other figures
            self.note("errors", name, f"{type(exc).__name__}: {exc}"[:1500])
            with self.lock:
                self.results.setdefault("tracebacks", {})[name] = traceback.format_exc()[-3000:]
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            with self.lock:
                self.results["part_seconds"][name] = round(time.monotonic() - start, 1)
            self.save()
        return None

    def run_proc(self, cmd, *, limit_s: float, env=None, on_line=None, cwd=REPO) -> tuple[int | None, str]:
        """A child process (its own session), stdout+stderr read line by line; killed, with everything it
        started, at limit_s. (return code or None when killed, the output's tail)"""
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, errors="replace",
        )  # fmt: skip
        self.procs.add(proc)
        lines: list[str] = []

        def read():
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
            self.procs.discard(proc)
            reader.join(timeout=5)
        return rc, "".join(lines)[-4000:]

    def watchdog(self, hard_s: float) -> threading.Event:
        """At hard_s after the start, whatever hangs: save, end our children, exit (rc 124)."""
        done = threading.Event()

        def watch():
            if done.wait(max(0.0, hard_s - (time.monotonic() - self.t0))):
                return
            self.note("errors", "watchdog", f"hard stop at {hard_s:.0f} s (a part hung past its limit)")
            for proc in list(self.procs):
                kill_tree(proc.pid)
            try:
                with self.lock:
                    print(summary(self.results), flush=True)
            except Exception:  # the main thread may be anywhere
                pass
            os._exit(124)

        threading.Thread(target=watch, daemon=True).start()
        return done


# ---------------------------------------------------------------- measurements


def host_copy_gb_s(n_bytes: int, rounds: int = 5) -> float:
    src = torch.ones(n_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(rounds + 1):  # the first pages dst in
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * n_bytes / (time.perf_counter() - start) / 1e9)  # read + write
    return best


def device_seconds(fn, iters: int, device: str = "cuda") -> float:
    """Mean seconds per call of fn(i) after one warm-up call: CUDA events on a GPU, the clock elsewhere."""
    fn(0)
    if device != "cuda":
        start = time.perf_counter()
        for i in range(iters):
            fn(i)
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _copy_gb_s(n_bytes: int) -> float:
    src = torch.ones(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return max(2 * n_bytes / device_seconds(lambda i: dst.copy_(src), 1) for _ in range(10)) / 1e9


def _h2d_gb_s(n_bytes: int) -> float:
    pinned = torch.ones(n_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    return (
        max(n_bytes / device_seconds(lambda i: dev.copy_(pinned, non_blocking=True), 1) for _ in range(5))
        / 1e9
    )


def gpu_bandwidth(n_bytes: int = GIB) -> dict:
    """Device-to-device copy (read + write, best of 10) and pinned host-to-device (best of 5), GB/s."""
    result = {"copy_gb_s": _copy_gb_s(n_bytes)}
    torch.cuda.empty_cache()
    result["h2d_pinned_gb_s"] = _h2d_gb_s(n_bytes)
    torch.cuda.empty_cache()
    return result


def vram_budget_gib(sparse_path: Path, ctx: int) -> tuple[float, dict]:
    """A budget that holds attention + KV (at ctx) + predictors + output + scratch + a third of the FFN."""
    from hotcold.config import config_from_file
    from hotcold.gguf_io import ModelFile
    from hotcold.placement.budget import layer_tensor_groups, plan_budget

    mf = ModelFile(sparse_path)
    config = config_from_file(mf)
    plan = plan_budget(mf, config, 1 << 50, ctx_size=ctx, device_type="cuda")  # everything fits
    _, _, ffn = layer_tensor_groups(mf, config.n_layer)
    ffn_bytes = sum(mf.tensors[n].n_bytes for names in ffn for n in names)
    parts = {"scratch": plan.scratch_bytes, **plan.spent, "ffn_third": ffn_bytes // 3}
    return sum(parts.values()) / GIB, {k: round(v / GIB, 3) for k, v in parts.items()}


def equal_bytes(sparse_path: Path, budget_gib: float, ctx: int) -> dict:
    """The original's budget holding as many hot FFN neurons as hotcold's plan at budget_gib (gpu_pi), what
    the original spends before them, and how many it would hold at hotcold's own budget."""
    from benchmarks.gpu_pi import equal_bytes_budget, hotcold_hot_neurons, pi_capacity, pi_spending
    from hotcold.config import config_from_file
    from hotcold.gguf_io import ModelFile
    from hotcold.placement.budget import plan_budget

    mf = ModelFile(sparse_path)
    c = config_from_file(mf)
    plan = plan_budget(mf, c, int(budget_gib * GIB), ctx_size=ctx, device_type="cuda")
    hot = min(hotcold_hot_neurons(plan), c.n_layer * c.n_ff)
    tensors = {name: (e.qtype.name, e.n_bytes) for name, e in mf.tensors.items()}
    spending = pi_spending(tensors, n_layer=c.n_layer, n_ff=c.n_ff, n_embd_gqa=c.n_embd_kv, ctx=ctx)
    return {
        "pi_equal_bytes_budget_gib": equal_bytes_budget(spending, hot),
        "hot_neurons_planned": hot,
        "hot_share_planned": hot / (c.n_layer * c.n_ff),
        "pi_hot_neurons_at_budget": min(pi_capacity(spending, budget_gib), c.n_layer * c.n_ff),
        "pi_spending": spending,
    }


def ngl_for(dense_path: Path, budget_gib: float, ctx: int) -> int:
    """Layers of the dense file that fit the same budget (hotcold's -ngl walk; n_layer + 1: the head too)."""
    from hotcold.config import config_from_file
    from hotcold.gguf_io import ModelFile
    from hotcold.placement.budget import dense_layers_fitting

    mf = ModelFile(dense_path)
    config = config_from_file(mf)
    n = dense_layers_fitting(mf, config, int(budget_gib * GIB), ctx_size=ctx)
    return n + 1 if n == config.n_layer else n


def hot_neurons(model) -> int | None:
    """FFN neurons whose rows the load put on the fast device (hybrid layers), None without hybrid layers."""
    from hotcold.sparse.hybrid import HybridFFN

    ffns = [layer.ffn for layer in model.layers if isinstance(getattr(layer, "ffn", None), HybridFFN)]
    return sum(len(f.hot_idx) for f in ffns) if ffns else None


def hybrid_profile(llm, *, n_tokens: int) -> dict:
    """Per hybrid layer, the mean ms a token of each part (sparse/hybrid.LayerClock: launch, host wait, CPU
    cold rows, tail, hot kernels on the GPU, the sync the clock adds, overlap), over n_tokens more tokens,
    and their sums over the layers. Measured apart from the timed tokens (the clock syncs each layer)."""
    from hotcold.cli.bench import measure
    from hotcold.sparse.hybrid import HybridFFN

    ffns = {
        i: layer.ffn for i, layer in enumerate(llm.loaded.model.layers) if isinstance(layer.ffn, HybridFFN)
    }
    for ffn in ffns.values():
        ffn.profile = []
    try:
        measure(llm, "tg", n_tokens)
    finally:
        records = {i: ffn.profile for i, ffn in ffns.items()}
        for ffn in ffns.values():
            ffn.profile = None
    layers = {}
    for i, rows in records.items():
        rows = rows[-n_tokens:]  # decode tokens (the prompt's call, if any, comes first)
        if rows:
            layers[i] = {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in rows[0]}
    total = {k: round(sum(v[k] for v in layers.values()), 4) for k in next(iter(layers.values()), {})}
    return {"tokens": n_tokens, "per_layer_ms": layers, "per_token_ms": total}


def cold_threads(cores: int | None) -> int:
    """CPU threads for the cold side (and every CPU run): one core fewer than the machine has, so the
    thread that launches the GPU kernels and waits on them keeps a core of its own while the C kernels'
    threads compute (with all cores busy it waits for a time slice: the GPU idles behind it)."""
    return max(1, (cores or 1) - 1)


def decode_step_used(llm, decoder) -> str:
    """Which decode step the run measured: the fixed-shape one (CUDA graph) or the eager one, and why."""
    if decoder is None:
        return next((n for n in llm.loaded.notes if n.startswith("decode:")), "decode: the eager step")
    if decoder.failure is not None:
        return f"decode: the eager step (the fixed-shape step's first step failed: {decoder.failure})"
    kernels = "fused Triton kernels" if decoder.fused else "torch kernels"
    return f"decode: the fixed-shape step, {decoder.steps} steps ({kernels}, graph: {decoder.capture})"


def step_check(llm, decoder, n: int = 4) -> dict:
    """The fixed-shape step against the eager step at this model's size: the same prompt through two
    engines, n greedy tokens, one through the step (a fresh cache: a new capture), one eagerly with the
    fused kernels off (torch ops only); the worst logit difference relative to the logit scale, and whether
    every argmax agrees."""
    from hotcold.engine import Engine
    from hotcold.kernels.triton_decode import FusedPaths as switch

    was_on = switch.enabled
    model = llm.loaded.model
    ids = llm.tokenize("Once upon a time, in a small village by the sea,")
    graphed, eager = Engine(model, llm.tokenizer, 128), Engine(model, llm.tokenizer, 128)
    try:
        with torch.inference_mode():
            a, b = graphed.prefill(ids), eager.prefill(ids)
            worst, same = 0.0, True
            for i in range(n):
                token, pos = int(b.argmax()), len(ids) + i
                a = graphed.forward([token], pos, last_only=True)[-1]
                model.static_step = None
                switch.enabled = False  # the reference: torch ops only, no fused kernel on either path
                try:
                    b = eager.forward([token], pos, last_only=True)[-1]
                finally:
                    model.static_step, switch.enabled = decoder, was_on
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
                same = same and int(a.argmax()) == int(b.argmax())
    except Exception as exc:  # the check must not cost the run's figures
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"tokens": n, "max_rel_err": worst, "same_argmax": same, "steps": decoder.steps}


def decode_run(
    path: Path, *, n_gen: int, ctx: int, threads: int, device: str, warmup: int = 16, **load_args
) -> dict:
    """hotcold.load + one decode measurement (bench.measure: n_gen tokens after `warmup` tokens, which also
    map in the pages of the rows that fire most, so the measurement pays few first-touch page faults)."""
    import hotcold
    from hotcold.cli.bench import measure, weight_bytes

    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    llm = hotcold.load(path, ctx_size=ctx, threads=threads, device=device, **load_args)
    load_s = time.perf_counter() - start
    decoder = getattr(llm.loaded.model, "static_step", None)  # decode_step.StaticDecoder, when attached
    try:
        measure(llm, "tg", warmup)
        seconds, rate = measure(llm, "tg", n_gen)
        sizes = weight_bytes(llm.loaded.file)
        sparse = not llm.loaded.dense
        per_token = sizes["other"] + sizes["ffn"] * (rate if sparse else 1.0)
        per_token += sizes["predictor"] if sparse else 0
        ms = 1e3 * seconds / n_gen
        record = {
            "tps": n_gen / seconds,
            "gb_s": per_token * n_gen / seconds / 1e9,
            "ms_per_token": ms,
            "ms_per_layer": ms / llm.config.n_layer,
            "firing_rate": rate if sparse else 1.0,
            "bytes_per_token": per_token,
            "load_seconds": load_s,
            "n_gen": n_gen,
            "warmup": warmup,
            "ctx_size": ctx,
            "notes": llm.loaded.notes,
            "decode_step": decode_step_used(llm, decoder),
            "hot_neurons": hot_neurons(llm.loaded.model),
            "threads": threads,
        }
        if decoder is not None and decoder.failure is None:
            record["step_check"] = step_check(llm, decoder)
        if record["hot_neurons"] is not None:  # after the timed tokens: the profile syncs every layer
            record["layer_profile"] = hybrid_profile(llm, n_tokens=8)
        if cuda:  # the fused eager paths (a GPU layer's attention, a hybrid layer's token): on, or why not
            from hotcold.kernels.triton_decode import FusedPaths

            record["fused_paths"] = (
                "on" if FusedPaths.enabled else f"off: {FusedPaths.failure or 'HOTCOLD_FUSED_EAGER=0'}"
            )
        if cuda:
            record["vram_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            record["vram_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        return record
    finally:
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def kernel_bench(copy_gb_s: float | None, *, device: str = "cuda", shape=(11008, 4096)) -> dict:
    """hot_gather_matvec / hot_axpy over 7B FFN rows (11008 x 4096, F16, one token), 10% and 100% of rows,
    each timed in a CUDA graph over copies of the weights and masks that together hold 3x the L2
    (gpu_timing); GB/s of the rows read. (device "cpu" under TRITON_INTERPRET=1 with a small shape: a check
    of this function, not a figure.)"""
    import hotcold.kernels.triton as kt
    from benchmarks.gpu_timing import copies_for, graph_seconds, l2_bytes

    if not kt.available():
        raise RuntimeError("Triton is not available")
    F, D = shape
    n = copies_for(F * D * 2, l2_bytes(device))
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(F, D, device=device, dtype=torch.float16, generator=gen) for _ in range(n)]
    x = torch.randn(1, D, device=device, generator=gen)
    a = torch.randn(1, F, device=device, generator=gen)
    out_mv = torch.empty(1, F, device=device)
    out_ax = torch.empty(1, D, device=device)
    dense_out = torch.empty(F, device=device, dtype=torch.float16)
    xh = x[0].half()  # torch's F16 GEMV over all rows: the dense reference
    rows = {}
    for density in (0.10, 1.00):
        masks = [torch.rand(1, F, device=device, generator=gen) < density for _ in range(n)]
        n_rows = sum(int(m.sum()) for m in masks) / n
        ops = {
            "hot_gather_matvec": lambda i, m=masks: kt.hot_gather_matvec(ws[i], x, m[i], out=out_mv),
            "hot_axpy": lambda i, m=masks: kt.hot_axpy(ws[i], a, m[i], out=out_ax),
        }
        if density == 1.0:
            ops["torch_mv_dense"] = lambda i: torch.mv(ws[i], xh, out=dense_out)
        for op, fn in ops.items():
            seconds = graph_seconds(fn, n, device=device)
            gb_s = n_rows * D * 2 / seconds / 1e9
            rows[f"{op}@{density:.0%}"] = {
                "us": seconds * 1e6,
                "rows": n_rows,
                "gb_s": gb_s,
                "share_of_copy": gb_s / copy_gb_s if copy_gb_s else None,
                "copies": n,
                "timing": "cuda graph" if torch.device(device).type == "cuda" else "loop (not a figure)",
            }
    return rows


def fused_kernels(device: str) -> dict:
    """benchmarks/gpu_fused.benchmark(device): the fused decode kernels (hotcold.kernels.triton_decode)."""
    if device != "cuda":
        return {"skipped": "the fused kernels' benchmark needs a CUDA GPU"}
    from benchmarks.gpu_fused import benchmark

    return {"result": benchmark(torch.device("cuda"))}


# ---------------------------------------------------------------- the parts


def synth_files(b: Bench, args) -> tuple[Path, Path]:
    """The sparse and the dense file of one model (synth.py, the two in parallel; reused when complete)."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    stem = f"synth-{args.shape}-{args.layers}l" + (f"-v{args.vocab}" if args.vocab else "")
    sparse, dense = work / f"{stem}.powerinfer.gguf", work / f"{stem}.gguf"
    done = work / f"{stem}.done"
    if not done.exists():
        start = time.perf_counter()
        base = [sys.executable, str(HERE / "synth.py"), "--shape", args.shape, "--layers", str(args.layers)]
        base += ["--vocab", str(args.vocab)] if args.vocab else []
        procs = {
            name: subprocess.Popen(base + extra + ["-o", str(path)], stdout=subprocess.PIPE, text=True)
            for name, path, extra in (("sparse", sparse, []), ("dense", dense, ["--dense"]))
        }
        b.procs.update(procs.values())
        try:
            for name, proc in procs.items():
                out, _ = proc.communicate(
                    timeout=max(1.0, args.synth_limit_s - (time.perf_counter() - start))
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"synth.py ({name}) exited {proc.returncode}")
                b.results.setdefault("synth", {})[name] = json.loads(out)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    kill_tree(proc.pid)
                b.procs.discard(proc)
        b.set(synth_seconds=time.perf_counter() - start)
        done.write_text("ok\n")
    b.set(sparse_file=str(sparse), dense_file=str(dense), file_bytes=sparse.stat().st_size)
    return sparse, dense


def in_child(b: Bench, name: str, spec: dict, limit_s: float) -> dict:
    """one_run(spec) in a child process, killed at limit_s: a hang or a CUDA error that poisons the process
    then costs this part alone. Returns the child's record."""
    work = Path(b.out).parent if spec.get("workdir") is None else Path(spec["workdir"])
    spec_file, result_file = work / f"run-{name}.json", work / f"run-{name}.result.json"
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "result": str(result_file)}))
    rc, tail = b.run_proc(
        [sys.executable, str(HERE / "gpu.py"), "--one-run", str(spec_file)], limit_s=limit_s
    )
    if not result_file.exists():
        why = "was stopped at its time limit" if rc is None else f"exited {rc}"
        raise RuntimeError(f"the child {why} without a result; its output ends: {tail[-1200:]}")
    return json.loads(result_file.read_text())


def run_config(b: Bench, name: str, path: Path, args, env: dict | None = None, **load_args) -> None:
    """One decode_run, in a child process when isolated (with `env` added to its environment), else in
    this process."""
    spec = dict(path=str(path), n_gen=args.n_gen, ctx=args.ctx, threads=args.threads, device=args.device)
    spec["warmup"] = args.warmup
    if (
        env
        or args.isolate == "all"
        or (args.isolate == "auto" and (args.device == "cuda" or name == "dense_all_gpu"))
    ):
        spec = dict(kind="decode", workdir=args.workdir, load_args=load_args, env=env or {}, **spec)
        record = in_child(b, name, spec, max(1.0, min(args.run_limit_s, b.left())))
        record["isolated"] = True
    else:
        record = decode_run(Path(spec.pop("path")), **spec, **load_args)
    with b.lock:
        b.results["runs"][name] = record
    b.set(**{f"{name}_tps": record["tps"], f"{name}_gb_s": record["gb_s"]})
    print(
        f"gpu.py: {name}: {record['tps']:.2f} tok/s, {record['gb_s']:.1f} GB/s", file=sys.stderr, flush=True
    )


def one_run(spec_file: str) -> int:
    """The child of an isolated part: decode_run or fused_kernels as the spec says, the record written
    where it says."""
    spec = json.loads(Path(spec_file).read_text())
    result = Path(spec.pop("result"))
    kind = spec.pop("kind")
    spec.pop("workdir", None)
    os.environ.update(spec.pop("env", {}))
    if kind == "decode":
        load_args = spec.pop("load_args")
        record = decode_run(Path(spec.pop("path")), **spec, **load_args)
    elif kind == "fused":
        record = fused_kernels(spec["device"])
    else:
        raise ValueError(f"{spec_file}: unknown kind {kind!r}")
    tmp = result.with_name(result.name + ".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(result)
    return 0


def powerinfer(b: Bench, args, sparse: Path, dense: Path, limit_s: float) -> None:
    """The original's configurations (gpu_pi.pi_plan: every one at -c ctx; the hybrid at hotcold's budget
    and at equal hot bytes), each its own `main` process with its own limit, each figure saved as it comes."""
    from benchmarks.gpu_pi import parse_tps, pi_env, pi_plan

    anchors = Path(args.anchors)
    binary = anchors / "powerinfer-cuda" / "bin" / "main"
    if not binary.exists():
        b.note(
            "skipped",
            "powerinfer",
            f"{binary} missing (bash benchmarks/gpu_run.sh --prepare, carry .anchors)",
        )
        return
    if args.device != "cuda":
        b.note("skipped", "powerinfer", "no CUDA GPU (its binaries are CUDA builds)")
        return
    start = time.monotonic()
    pi_out = Path(args.workdir) / "pi"
    pi_out.mkdir(parents=True, exist_ok=True)
    env, problem = pi_env(anchors, pi_out)
    if problem:
        b.note("errors", "powerinfer", problem)
        return
    r = b.results
    runs = pi_plan(sparse, dense, budget_gib=r["budget_gib"], equal_bytes_gib=r.get("pi_equal_bytes_budget_gib"),
                   ngl=r["ngl"], n_gen=args.n_gen, threads=args.threads, ctx=args.ctx)  # fmt: skip
    table: dict = {}
    logs: dict = {}
    try:
        for run in runs:
            left = limit_s - (time.monotonic() - start)
            if left < 10:
                b.note(
                    "skipped",
                    f"powerinfer_{run.name}",
                    f"{left:.0f} s left of the original's {limit_s:.0f} s",
                )
                continue
            if run.reset_index:  # a placement solved for another budget is reused silently (reference §3.1)
                Path(run.reset_index + ".generated.gpuidx").unlink(missing_ok=True)
            lines: list[str] = []
            rc, _ = b.run_proc([str(binary), *run.argv], limit_s=min(args.pi_run_limit_s, left), env=env,
                               on_line=lines.append, cwd=pi_out)  # fmt: skip
            text = "".join(lines)
            (pi_out / f"pi-{run.name}.log").write_text(text)
            logs[run.name] = text[-1500:]
            tps = parse_tps(text)
            table[run.name] = {"rc": rc, "tps": tps, "argv": " ".join(run.argv)}
            b.set(
                pi_table=dict(table),
                powerinfer={"binary": str(binary), "logs": dict(logs)},
                **{run.field: tps},
            )
            if tps is None or rc != 0:
                b.note("errors", f"powerinfer_{run.name}", f"rc={rc}, no tokens/s (see powerinfer.logs)")
    finally:
        Path(str(sparse) + ".generated.gpuidx").unlink(missing_ok=True)


def gpu_tests(b: Bench, limit_s: float) -> None:
    files = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "--continue-on-collection-errors",
        "-p",
        "no:cacheprovider",
    ]
    rc, tail = b.run_proc(cmd + (files or ["tests/"]), limit_s=limit_s)
    b.set(gpu_tests={"files": files, "returncode": rc, "tail": tail[-2500:]})


def finish(b: Bench) -> None:
    with b.lock:
        r = b.results
        for field, run in (
            ("dense_bytes_per_token", "dense_all_gpu"),
            ("sparse_bytes_per_token", "sparse_all_gpu"),
        ):
            r[field] = r["runs"].get(run, {}).get("bytes_per_token")
        for key, (num, den) in RATIOS.items():
            r[key] = r[num] / r[den] if r.get(num) and r.get(den) else None
        hybrid = r["runs"].get("hybrid", {})
        r["vram_used_gib"] = hybrid.get("vram_peak_reserved_gib")
        r["vram_allocated_gib"] = hybrid.get("vram_peak_allocated_gib")
    b.save()


def summary(r: dict) -> str:
    def f(x, spec=".1f"):
        return "—" if x is None else format(x, spec)

    runs = r.get("runs", {})
    rows = [
        ("dense, all on the GPU", "dense_all_gpu", "pi_dense_all_gpu_tps"),
        ("sparse, all on the GPU", "sparse_all_gpu", "pi_sparse_all_gpu_tps"),
        (
            f"hybrid, {f(r.get('budget_gib'), '.2f')} GiB (the original: same flags, -c too)",
            "hybrid",
            "pi_hybrid_tps",
        ),
        (
            f"hybrid (the original at equal hot bytes: {f(r.get('pi_equal_bytes_budget_gib'), '.2f')} GiB)",
            "hybrid",
            "pi_hybrid_equal_bytes_tps",
        ),
        (f"dense -ngl {r.get('ngl')}, same VRAM", "dense_ngl", "pi_dense_ngl_tps"),
        ("sparse, CPU only", "sparse_cpu_only", "pi_sparse_cpu_only_tps"),
        ("dense, all on the GPU, eager step", "dense_all_gpu_eager", None),
        ("sparse, all on the GPU, eager step", "sparse_all_gpu_eager", None),
    ]
    lines = [
        f"### GPU run {r.get('date')} on {r.get('gpu')} ({r.get('shape')} x {r.get('layers')} layers, F16, "
        f"tg{r.get('n_gen')}, ctx {r.get('ctx')}, {r.get('threads')} threads{', CPU DRY RUN' if r.get('dry_run') else ''})",
        "",
        f"Copy bandwidth: GPU {f(r.get('copy_gb_s'), '.0f')} GB/s, host {f(r.get('host_copy_gb_s'))} GB/s, "
        f"pinned host-to-device {f(r.get('h2d_pinned_gb_s'))} GB/s. Synthesis {f(r.get('synth_seconds'))} s.",
        "",
        "| configuration | hotcold tok/s | ms/token | GB/s | PowerInfer tok/s | hotcold / PowerInfer |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, run, pi in rows:
        rec = runs.get(run, {})
        if not rec and pi is None:
            continue
        tps, pi_tps = rec.get("tps"), r.get(pi) if pi else None
        ratio = tps / pi_tps if tps and pi_tps else None
        lines.append(
            f"| {label} | {f(tps)} | {f(rec.get('ms_per_token'), '.2f')} | {f(rec.get('gb_s'))} | {f(pi_tps)} | {f(ratio, '.2f')} |"
        )
    lines += [
        "",
        f"Dense all-GPU reads {f(r.get('dense_all_gpu_share_of_copy'), '.0%')} of copy bandwidth; sparse / dense all-GPU "
        f"{f(r.get('sparse_over_dense_all_gpu'), '.2f')}x; hybrid / dense -ngl {f(r.get('hybrid_over_dense_ngl'), '.2f')}x "
        f"(PowerInfer: {f(r.get('pi_hybrid_over_pi_dense_ngl'), '.2f')}x); hybrid VRAM used {f(r.get('vram_used_gib'), '.2f')} GiB.",
        "",
        f"Bytes a token: dense {f((r.get('dense_bytes_per_token') or 0) / 1e9, '.2f')} GB, sparse "
        f"{f((r.get('sparse_bytes_per_token') or 0) / 1e9, '.2f')} GB: sparse / dense can reach at most "
        f"{f(r.get('sparse_bytes_ceiling'), '.2f')}x by bytes. Hot neurons: hotcold planned "
        f"{r.get('hot_neurons_planned')}, loaded {runs.get('hybrid', {}).get('hot_neurons')}; the original at hotcold's "
        f"budget {r.get('pi_hot_neurons_at_budget')}.",
        f"Hybrid layer profile, ms a token over all layers: {(runs.get('hybrid', {}).get('layer_profile') or {}).get('per_token_ms')}",
        "",
        *(f"- {run}: {rec.get('decode_step')}" for run, rec in runs.items() if rec.get("decode_step")),
        *(
            f"- {run}: fused eager paths {rec['fused_paths']}"
            for run, rec in runs.items()
            if rec.get("fused_paths")
        ),
        *(
            f"- {run}: fixed-shape step against the eager step: {rec['step_check']}"
            for run, rec in runs.items()
            if rec.get("step_check")
        ),  # fmt: skip
    ]
    kernels = dict(r.get("kernels") or {})
    fused = (r.get("fused_kernels") or {}).get("result")
    if isinstance(fused, dict):  # triton_decode.benchmark's rows: {name: {"us": ..., "gb_s": ...}, ...}
        kernels |= {f"fused {k}": v for k, v in fused.items() if isinstance(v, dict) and "gb_s" in v}
    if kernels:
        copy = r.get("copy_gb_s")
        lines += ["", "| kernel @ rows | us | GB/s | share of copy |", "| --- | --- | --- | --- |"]
        for k, v in kernels.items():
            gb_s = v.get("gb_s")
            share = gb_s / copy if isinstance(gb_s, (int, float)) and copy else None
            lines.append(f"| {k} | {f(v.get('us'))} | {f(gb_s, '.0f')} | {f(share, '.0%')} |")
    tests = r.get("gpu_tests") or {}
    if tests:
        last = tests.get("tail", "").strip().splitlines()[-1:] or [""]
        lines += ["", f"pytest -m gpu: rc {tests.get('returncode')}: {last[0]}"]
    for table in ("errors", "skipped"):
        for k, v in (r.get(table) or {}).items():
            lines.append(f"- {table[:-1] if table == 'errors' else table}: {k}: {str(v)[:200]}")
    return "\n".join(lines)


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
