"""hotcold place: solve the hot-neuron placement for a VRAM budget and write `<model>.generated.gpuidx` (beside
the model; for the bundled demo model or a read-only folder, in the user cache: placement.gpuidx). Runs without a GPU: it only needs the model file and its activation statistics. `--plot OUT.png` also draws
the hot neurons per layer against the budget (hotcold.plots)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def add_args(p) -> None:
    p.add_argument(
        "-m", "--model", default=None, help="PowerInfer model file; omitted: the bundled demo model"
    )
    p.add_argument("--vram-budget", type=float, default=None, help="GiB (default: all free VRAM of the GPU)")
    p.add_argument(
        "-c", "--ctx-size", type=int, default=None, help="context size the KV cache is budgeted for"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="also draw the hot neurons per layer against the budget (needs hotcold[plot])",
    )


def run(args) -> int:
    import torch

    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.loader import AUTO_BUDGET_STEP, DEFAULT_CTX, demo_model_path
    from hotcold.placement.budget import GIB, default_budget_bytes, plan_budget
    from hotcold.placement.gpuidx import gpuidx_path, resolve_placement

    path = Path(args.model) if args.model else demo_model_path()
    if args.plot is not None:  # a missing extra or a bad name fails before anything is solved or written
        from hotcold import plots
        from hotcold.placement.gpuidx import model_inputs

        plots.require()
        plots.check_png(args.plot, [gpuidx_path(path), *model_inputs(path)])
    mf = ModelFile(path)
    config = config_from_file(mf)
    if not config.sparse:
        raise ValueError(
            f"{path}: a dense GGUF file has no predictors; placement needs a PowerInfer (PWRI) file"
        )
    if args.vram_budget is None:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA GPU to read free memory from: give --vram-budget GIB")
        budget = default_budget_bytes() // AUTO_BUDGET_STEP * AUTO_BUDGET_STEP
    else:  # finite, >= 0 and at most validate.MAX_VRAM_GIB: checked by hotcold.cli.validate_args
        budget = int(args.vram_budget * GIB)
    ctx = args.ctx_size or min(config.n_ctx_train, DEFAULT_CTX)
    plan = plan_budget(mf, config, budget, ctx_size=ctx)
    notes = [plan.describe()]
    hot = resolve_placement(path, mf, config, plan, True, notes, strict=True)  # a failed write raises
    result = {
        "model": str(path),
        "budget_bytes": budget,
        "hot_bytes": plan.hot_bytes,
        "layers_on_gpu": sum(plan.layer_on_gpu),
        "hot_neurons_per_layer": [len(h) for h in hot] if hot is not None else None,
        "hot_fraction": sum(len(h) for h in hot) / (config.n_layer * config.n_ff) if hot is not None else 0.0,
        # with activation statistics (placement.value): CPU bytes a token the plan keeps off the CPU, the hot
        # neurons it gives up for units read every token, and why; None / 0 / [] without statistics
        "value_bytes_per_token": plan.value_bytes,
        "displaced_hot_neurons": plan.displaced,
        "choice": plan.choice,
        "notes": notes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for note in notes:
            print(note)
        if hot is not None:
            print("hot neurons per layer:", " ".join(str(len(h)) for h in hot))
    if hot is None:
        print("hotcold: no placement written", file=sys.stderr)
        return 1
    if not _written(gpuidx_path(path), hot):
        print(
            f"hotcold: error: the placement was solved but {gpuidx_path(path)} was not written",
            file=sys.stderr,
        )
        return 1
    print(f"hotcold: wrote {gpuidx_path(path)}", file=sys.stderr)
    if args.plot is not None:
        from hotcold import plots
        from hotcold.placement.gpuidx import model_inputs

        used = sum(len(h) * b for h, b in zip(hot, plan.bytes_per_neuron))
        spent = dict(plan.spent, scratch=min(plan.scratch_bytes, budget), hot=used)
        plots.plot_placement(
            [len(h) for h in hot],
            config.n_ff,
            args.plot,
            budget_bytes=budget,
            spent=spent,
            title=f"{path.name}: placement at a {budget / GIB:g} GiB VRAM budget",
            inputs=[gpuidx_path(path), *model_inputs(path)],
        )
        print(f"hotcold: wrote {args.plot}", file=sys.stderr)
    return 0


def _written(cache: Path, hot) -> bool:
    from hotcold.gguf.io import GGUFError
    from hotcold.placement.gpuidx import read_gpuidx

    try:
        cached = read_gpuidx(cache)
    except (OSError, GGUFError):
        return False
    return len(cached.hot) == len(hot) and all(np.array_equal(a, b) for a, b in zip(cached.hot, hot))
