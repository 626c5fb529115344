"""What sparsity does, as the server reports it: the `timings` object of every finished response, and the
model's placement (the `hotcold` part of `/props`).

`timings` keeps llama.cpp's names and meaning (`prompt_n`, `prompt_ms`, `prompt_per_token_ms`,
`prompt_per_second`, `predicted_n`, `predicted_ms`, `predicted_per_token_ms`, `predicted_per_second`,
`cache_n`) and adds the FFN figures, all from the engine's own counts for this request:

- `prompt_n`: prompt tokens run (`cache_n` more came from the slot's cached prefix); `prompt_ms` is their
  prefill, which also gives the first generated token's logits;
- `predicted_n`: tokens generated; `predicted_ms` times the forwards of the tokens after the first, so
  `predicted_per_second` = (predicted_n - 1) / predicted_ms (0 when under two tokens were generated);
- `ffn_neurons_computed` / `ffn_neurons_total`: FFN neurons computed over every layer of the request's
  forwards (prefill and decode) / the neurons of those forwards; `ffn_computed_share` is their ratio;
- `ffn_gpu_neurons` / `ffn_gpu_share`: how many of the computed neurons the hot copies on the GPU
  computed, and their share of the computed ones; null when the model has no hot neurons on a GPU;
- under a RAM budget (`--ram-budget`; else absent): `storage_bytes_read` and `storage_bytes_per_token` (FFN
  rows read from the model file over the request's forwards, per token forwarded), `neuron_cache_hit_rate`
  (of the cold rows asked for, the share the neuron cache held; null when none was asked for); the model's
  counts over the request's time, so a concurrent request's reads are in them too.

With `n` choices the counts and times are summed over the choices (each is its own sequence, with its
own prefill), so the rates are per sequence. Pure functions of the stats and the loaded model.
"""

from __future__ import annotations

from collections.abc import Sequence

from hotcold.runtime.generation import GenerationStats


def _rate(n: int, ms: float) -> float:
    return n * 1000.0 / ms if ms > 0 else 0.0


def _per_token(ms: float, n: int) -> float:
    return ms / n if n > 0 else 0.0


def timings(stats: Sequence[GenerationStats], *, hybrid: bool) -> dict:
    prompt_n = sum(s.prompt_computed for s in stats)
    prompt_ms = sum(s.prompt_seconds for s in stats) * 1000.0
    predicted_n = sum(s.generated_tokens for s in stats)
    predicted_ms = sum(s.generate_seconds for s in stats) * 1000.0
    decoded = sum(max(s.generated_tokens - 1, 0) for s in stats)  # the tokens predicted_ms times
    computed = sum(s.neurons_computed for s in stats)
    total = sum(s.neurons_total for s in stats)
    on_gpu = sum(s.neurons_hot for s in stats) if hybrid else None
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _per_token(prompt_ms, prompt_n),
        "prompt_per_second": _rate(prompt_n, prompt_ms),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": _per_token(predicted_ms, decoded),
        "predicted_per_second": _rate(decoded, predicted_ms),
        "cache_n": sum(s.prompt_tokens - s.prompt_computed for s in stats),
        "ffn_neurons_computed": computed,
        "ffn_neurons_total": total,
        "ffn_computed_share": computed / total if total else None,
        "ffn_gpu_neurons": on_gpu,
        "ffn_gpu_share": None if on_gpu is None or not computed else on_gpu / computed,
        **storage_timings(stats),
    }


def storage_timings(stats: Sequence[GenerationStats]) -> dict:
    """The RAM budget's figures of a request (timings' docstring), {} without a RAM budget."""
    parts = [s.storage for s in stats if getattr(s, "storage", None)]
    if not parts:
        return {}
    from hotcold.storage.rows import StorageStats

    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    f = StorageStats.figures(total)
    return {k: f[k] for k in ("storage_bytes_read", "storage_bytes_per_token", "neuron_cache_hit_rate")}


def storage_lines(stats) -> list[str]:
    """/metrics lines of a model under a RAM budget (storage.rows.StorageStats since load); [] without one."""
    if stats is None:
        return []
    c = stats.snapshot()
    f = stats.figures(c)
    rows = [
        ("storage_bytes_read_total", "counter", "FFN row bytes read from the model file (--ram-budget).", c["bytes_read"]),
        ("storage_reads_total", "counter", "Reads issued for them (adjacent rows: one read).", c["reads"]),
        ("storage_tokens_total", "counter", "Tokens forwarded through the stored layers.", c["tokens"]),
        ("neuron_cache_lookups_total", "counter", "Cold FFN rows asked for (not resident).", c["cold_selected"]),
        ("neuron_cache_hits_total", "counter", "Of those, rows the neuron cache held.", c["cache_hits"]),
        ("storage_bytes_per_token", "gauge", "FFN row bytes read per token since load.", f["storage_bytes_per_token"]),
        ("neuron_cache_hit_rate", "gauge", "Hits / lookups since load (0 before any lookup).",
         f["neuron_cache_hit_rate"] or 0.0),
    ]  # fmt: skip
    out = []
    for name, kind, text, value in rows:
        out += [f"# HELP hotcold_{name} {text}", f"# TYPE hotcold_{name} {kind}", f"hotcold_{name} {value:g}"]
    return out


def hot_per_layer(loaded) -> list[int] | None:
    """Hot neurons per layer on the fast device, or None when no layer has any (CPU-only, dense)."""
    plan = loaded.devices
    if plan is None or plan.fast is None or plan.hot is None:
        return None
    hot = [0 if plan.hot_rows(i) is None else len(plan.hot_rows(i)) for i in range(plan.n_layer)]
    return hot if any(hot) else None


def placement(loaded) -> dict:
    """Where the model runs, for `/props` and the chat page's header: the mode, the devices, the hot
    neurons per layer and their share of the FFN, and a one-line summary."""
    config, plan = loaded.config, loaded.devices
    mode = "dense" if loaded.dense else "sparse"
    hot = hot_per_layer(loaded)
    n_neurons = config.n_layer * config.n_ff
    budget = loaded.plan.budget_bytes if loaded.plan is not None else None
    if loaded.plan is not None:  # a sparse file at a VRAM budget: the budget walk says what went there
        fast, layers_fast = str(plan.fast), sum(loaded.plan.layer_on_gpu)
    else:  # CPU only, or a dense file's -ngl layers
        offloaded = [d for d in (plan.attention if plan is not None else ()) if d.type != "cpu"]
        fast, layers_fast = (str(offloaded[0]) if offloaded else None), len(offloaded)
    if hot is not None:
        share = sum(hot) / n_neurons
        where = (
            f"{100 * share:.1f}% of FFN neurons hot on {fast}, the rest on the CPU; "
            f"attention of {layers_fast}/{config.n_layer} layers on {fast}"
        )
    elif fast is not None and layers_fast:
        where = f"{layers_fast}/{config.n_layer} layers on {fast}, the rest on the CPU"
    else:
        where = "CPU only"
    if budget is not None:
        where += f" (VRAM budget {budget / 2**30:.2f} GiB)"
    return {
        "architecture": config.arch,
        "mode": mode,
        "n_layer": config.n_layer,
        "n_ff": config.n_ff,
        "fast_device": fast,
        "hybrid": hot is not None,
        "layers_on_fast_device": layers_fast,
        "vram_budget_bytes": budget,
        "ffn_neurons": n_neurons,
        "hot_neurons": sum(hot) if hot is not None else 0,
        "hot_share": sum(hot) / n_neurons if hot is not None and n_neurons else 0.0,
        "hot_neurons_per_layer": hot,
        "summary": f"{config.arch} {mode}, {where}",
    }
