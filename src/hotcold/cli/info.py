"""hotcold info: what a model file holds, without running it."""

from __future__ import annotations

import json
import math
import shlex
from collections import Counter
from pathlib import Path


def add_args(p) -> None:
    p.add_argument("-m", "--model", default=None, help="model file; omitted: the bundled demo model")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--vram-budget",
        type=float,
        default=None,
        help="GiB: show the VRAM plan at this budget by part (dense tensors, KV cache, scratch, hot rows)",
    )
    p.add_argument(
        "--ram-budget",
        type=float,
        default=None,
        help="GiB: show the RAM plan (sparse files on the CPU): what every token reads, hot neurons, neuron cache, "
        "what stays in the file",
    )
    p.add_argument(
        "-c", "--ctx-size", type=int, default=None, help="context size the plan charges the KV for"
    )
    p.add_argument(
        "--load",
        action="store_true",
        help="load the model (on the GPU when there is one): the decoder chosen, VRAM planned vs allocated",
    )


def describe(
    path: str | None,
    *,
    vram_budget: float | None = None,
    ctx_size: int | None = None,
    ram_budget: float | None = None,
) -> dict:
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.loader import demo_model_path
    from hotcold.registry import require

    path = Path(path) if path else demo_model_path()
    mf = ModelFile(path)
    require(mf.architecture, str(path))  # unknown architectures fail here, listing the supported ones
    c = config_from_file(mf)
    types = Counter(e.qtype.name for e in mf.tensors.values())
    n_params = sum(
        math.prod(e.shape) for e in mf.tensors.values() if ".fc1." not in e.name and ".fc2." not in e.name
    )
    ranks = [
        mf.tensors[f"blk.{i}.fc1.weight"].shape[0]
        for i in range(c.n_layer)
        if f"blk.{i}.fc1.weight" in mf.tensors
    ]
    from hotcold.placement.gpuidx import gpuidx_candidates, gpuidx_path
    from hotcold.placement.profile import default_activation_dir

    activation_dir = default_activation_dir(path)  # beside the model, or where `hotcold profile` wrote them

    # the first place the loader looks that holds one (beside the model, then the user cache), else where it goes
    gpuidx = next((p for p in gpuidx_candidates(path) if p.exists()), gpuidx_path(path))
    return {
        "file": str(path),
        "format": "PowerInfer (PWRI, sparse)" if mf.is_sparse else "GGUF (dense)",
        "size_bytes": path.stat().st_size,
        "architecture": c.arch,
        "name": c.name,
        "parameters": n_params,
        "tensor_types": dict(types),
        "n_layer": c.n_layer,
        "n_embd": c.n_embd,
        "n_ff": c.n_ff,
        "n_head": c.n_head,
        "n_head_kv": c.n_head_kv,
        "n_vocab": c.n_vocab,
        "context_length": c.n_ctx_train,
        "rope_freq_base": c.rope_base,
        "ffn_activation": c.ffn_activation,
        "predictors": {"layers": len(ranks), "ranks": sorted(set(ranks))} if ranks else None,
        "sparse_threshold": c.sparse_threshold if c.sparse else None,
        "activation_stats": str(activation_dir) if activation_dir.is_dir() else None,
        "placement_cache": _placement(gpuidx),
        "n_expert": c.n_expert or None,
        "sparsify": _sparsify(mf, c),
        "vram_plan": None if vram_budget is None else vram_plan(mf, c, vram_budget, ctx_size),
        "ram_plan": None if ram_budget is None else ram_plan(path, mf, c, ram_budget, ctx_size),
    }


def ram_plan(path: Path, mf, c, budget_gib: float, ctx_size: int | None) -> dict:
    """The RAM budget's plan (hotcold.storage.plan), the process's own memory now (Python, torch) beside it."""
    import torch  # noqa: F401  (the overhead reported is a process that has torch loaded, as a load has)

    from hotcold.placement.budget import default_ctx
    from hotcold.storage.model import ram_plan as plan_for
    from hotcold.storage.plan import process_rss

    notes: list[str] = []
    plan = plan_for(
        path, mf, c, budget_gib, ctx_size=ctx_size or default_ctx(c), overhead=process_rss(), notes=notes
    )
    plan.notes += notes
    return {**plan.as_dict(), "text": plan.describe()}


def vram_plan(mf, c, budget_gib: float, ctx_size: int | None) -> dict:
    """The budget walk for this file (sparse: plan_budget, `hot` = what it leaves for hot rows; dense:
    -ngl's plan_offload), without loading anything."""
    from hotcold.placement.budget import GIB, default_ctx, plan_budget, plan_offload

    budget, ctx = int(budget_gib * GIB), ctx_size or default_ctx(c)
    chosen: dict = {}
    if c.sparse:
        plan = plan_budget(mf, c, budget, ctx_size=ctx)
        parts, missed = plan.parts(), plan.missed
        # with statistics: what the plan keeps off the CPU a token, and why it left hot neurons out (if it did)
        chosen = {"value_bytes_per_token": plan.value_bytes, "choice": plan.choice}
        placed = (
            f"attention of {sum(plan.layer_on_gpu)}/{c.n_layer} layers, predictors of "
            f"{sum(plan.predictor_on_gpu)}, output on {'GPU' if plan.output_on_gpu else 'CPU'}"
        )
    else:
        offload = plan_offload(mf, c, budget, ctx_size=ctx)
        parts, missed = offload.parts(), offload.missed
        placed = (
            f"{offload.n_layers}/{c.n_layer} layers, output on {'GPU' if offload.output_on_gpu else 'CPU'}"
        )
    return {
        "budget_bytes": budget,
        "ctx_size": ctx,
        "parts_bytes": parts,
        "total_bytes": sum(parts.values()),
        "placed": placed,
        "did_not_fit": missed,
        **chosen,
    }


def load_for_info(args):
    """The model loaded as `generate` would load it."""
    import hotcold

    llm = hotcold.load(
        args.model,
        vram_budget=args.vram_budget,
        ctx_size=args.ctx_size,
        ram_budget=getattr(args, "ram_budget", None),
    )
    return llm


def vram_of(llm) -> dict:
    """The loaded model's VRAM plan beside what CUDA's allocator reports."""
    from hotcold.loader import vram_figures

    v = vram_figures(llm.loaded)
    if v.used is None:
        return {"gpu": None, "note": "no GPU in use: nothing planned or allocated in VRAM"}
    return {
        "gpu": "cuda",
        "budget_bytes": v.budget,
        "planned_bytes": v.planned,
        "planned_total_bytes": v.planned_total,
        "allocated_bytes": v.used,
        "peak_reserved_bytes": v.peak_reserved,
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _vram_text(v: dict) -> str:
    if v.get("gpu", "plan") is None:
        return v["note"]
    parts = v.get("parts_bytes") or v.get("planned_bytes") or {}
    text = ", ".join(f"{k} {_gib(b)}" for k, b in parts.items())
    if "allocated_bytes" in v:
        return (
            f"planned {_gib(v['planned_total_bytes'])} ({text}) of budget {_gib(v['budget_bytes'])}; "
            f"allocated {_gib(v['allocated_bytes'])}, peak reserved {_gib(v['peak_reserved_bytes'])}"
        )
    missed = "; did not fit: " + "; ".join(v["did_not_fit"]) if v["did_not_fit"] else ""
    choice = "; " + "; ".join(v["choice"]) if v.get("choice") else ""
    return (
        f"{_gib(v['budget_bytes'])} at ctx {v['ctx_size']}: {text} = {_gib(v['total_bytes'])}; "
        f"{v['placed']}{missed}{choice}"
    )


def _sparsify(mf, c) -> str | None:
    """The `hotcold sparsify` assets in one line: method, target, thresholds, statistics, ffn_down_t type."""
    if not c.sparsified:
        return None
    from hotcold.gguf import names
    from hotcold.sparse.thresholded import SparsifyAssets

    a = SparsifyAssets.from_file(mf, c.n_layer, c.n_ff)
    t = a.thresholds
    down = mf.tensors.get(names.tensor(names.FFN_DOWN_T, 0))
    return (
        f"{a.method}, target sparsity {a.sparsity:g} (override: --sparsity), thresholds {min(t):.3g}..{max(t):.3g}"
        f" over {c.n_layer} layers, quantiles at {len(a.grid)} levels from {a.tokens} calibration tokens, "
        f"ffn_down_t {down.qtype.name if down else '-'}, keep frequencies {'yes' if a.frequency is not None else 'no'}"
        + (
            ", attention inputs too (attn_qkv_t, attn_output_t)"
            if names.SPARSIFY_ATTN_QUANTILES in mf.tensors
            else ""
        )
        + (", the gate from its input channels (ffn_gate_t)" if a.gate_in is not None else "")
        + _row_copies(mf)
    )


def _row_copies(mf) -> str:
    """The row copies the decode gathers from (names.FFN_UP_ROWS), as a clause, or ""."""
    from hotcold.gguf import names

    kinds = [n for n in (names.FFN_UP_ROWS, names.FFN_GATE_ROWS) if names.tensor(n, 0) in mf.tensors]
    if not kinds:
        return ""
    qtype = mf.tensors[names.tensor(kinds[0], 0)].qtype.name
    return f", {qtype} row copies for the decode ({', '.join(k.split('.')[-1] for k in kinds)})"


def run(args) -> int:
    info = describe(
        args.model, vram_budget=getattr(args, "vram_budget", None), ctx_size=getattr(args, "ctx_size", None),
        ram_budget=getattr(args, "ram_budget", None),
    )  # fmt: skip
    if getattr(args, "load", False):
        llm = load_for_info(args)
        info["decoder"] = llm.decoder  # chosen at load (hotcold.runtime.decoders)
        decode_note = next((n for n in llm.loaded.notes if n.startswith("decode: ")), None)
        failure = getattr(llm.loaded.model, "decoder_failure", None)
        info["decoder_why"] = failure or (decode_note[len("decode: ") :] if decode_note else None)
        info["vram"] = vram_of(llm)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if value is None:
            value = "-"
        if key == "size_bytes":
            key, value = "size", f"{value / 2**20:.1f} MiB"
        elif key in ("vram_plan", "vram") and isinstance(value, dict):
            value = _vram_text(value)
        elif key == "ram_plan" and isinstance(value, dict):
            value = value["text"]
        print(f"{key:18s} {value}")
    if info["activation_stats"] or info["predictors"]:
        model = f" -m {shlex.quote(args.model)}" if args.model else ""
        print(
            f"{'plots':18s} hotcold profile{model} --plot locality.png; "
            f"hotcold place{model} --vram-budget GIB --plot placement.png (pip install 'hotcold[plot]')"
        )
    return 0


def _placement(gpuidx: Path) -> str | None:
    if not gpuidx.exists():
        return None
    from hotcold.gguf.io import GGUFError
    from hotcold.placement.gpuidx import read_gpuidx

    try:
        p = read_gpuidx(gpuidx)
    except GGUFError as exc:
        return f"{gpuidx} (unreadable: {exc})"
    return (
        f"{gpuidx.name}: {100 * p.hot_fraction():.1f}% of FFN neurons hot, {p.vram_capacity / 2**20:.0f} MiB"
    )
