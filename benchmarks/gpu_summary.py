"""benchmarks/gpu.py's markdown summary of gpu.json (for benchmarks/RESULTS.md): each configuration beside the
original, the bytes ceiling beside each sparse figure, the kernels against the copy bandwidth."""

from __future__ import annotations


def ceiling_cell(r: dict, run: str) -> str:
    """Beside an all-GPU sparse figure: its speed over the dense run's of the same step, and the most the
    bytes a token allow (dense bytes / sparse bytes), e.g. "1.52x (ceiling 1.94x: 0.78 of it)"."""
    if not run.startswith("sparse_all_gpu"):
        return ""
    runs = r.get("runs", {})
    sparse, dense = runs.get(run, {}).get("tps"), runs.get(run.replace("sparse", "dense"), {}).get("tps")
    ceiling = r.get("sparse_bytes_ceiling")
    got = sparse / dense if sparse and dense else None
    share = got / ceiling if got and ceiling else None

    def f(x, spec):
        return "—" if x is None else format(x, spec)

    return f"{f(got, '.2f')}x (ceiling {f(ceiling, '.2f')}x: {f(share, '.2f')} of it)"


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
        "| configuration | hotcold tok/s | ms/token | GB/s | PowerInfer tok/s | hotcold / PowerInfer "
        "| sparse / dense (bytes ceiling) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, run, pi in rows:
        rec = runs.get(run, {})
        if not rec and pi is None:
            continue
        tps, pi_tps = rec.get("tps"), r.get(pi) if pi else None
        ratio = tps / pi_tps if tps and pi_tps else None
        lines.append(
            f"| {label} | {f(tps)} | {f(rec.get('ms_per_token'), '.2f')} | {f(rec.get('gb_s'))} | {f(pi_tps)} "
            f"| {f(ratio, '.2f')} | {ceiling_cell(r, run)} |"
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
