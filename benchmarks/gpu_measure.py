"""benchmarks/gpu.py's measurements: copy bandwidths, the VRAM budget and its equal-bytes twin for the
original, -ngl at that budget, one hotcold load + decode (tokens/s, GB/s, the decode step used, the
fixed-shape step against the eager one, the hybrid layers' profile), and the Triton kernels' benchmarks
(each timed in a CUDA graph over operand copies larger than the L2: benchmarks/gpu_timing)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from benchmarks.gpu_bench import GIB


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
    from hotcold.gguf.io import ModelFile
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
    from hotcold.gguf.io import ModelFile
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
    from hotcold.gguf.io import ModelFile
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
    from hotcold.kernels.triton_decode import FusedPaths as switch
    from hotcold.runtime.engine import Engine

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
        seconds, rate, _ = measure(llm, "tg", n_gen)
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
