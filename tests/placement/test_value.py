"""Plans chosen by value (placement/value.py): over a sweep of budgets the bytes a token kept off the CPU never
decrease, and a larger budget holds fewer hot neurons only where the plan says why (#47: the demo model held
100% of its FFN neurons hot at 0.05 GiB and 0% at 0.06, where the first GPU layer's attention scratch took it all).

The value here is computed from the model file and the statistics directly, not by placement/value.py: per
token, the file bytes of the units placed on the GPU (attention blocks with half their KV cache, predictors,
the head: each read every token) plus, per hot neuron, its rows' file bytes times count / the layer's largest
count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.config import config_from_file
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile
from hotcold.loader import demo_model_path
from hotcold.placement.budget import GIB, default_ctx, kv_bytes_per_layer, plan_budget
from hotcold.placement.profile import default_activation_dir, read_activation_files
from hotcold.placement.solver import solve_placement
from tests.placement.test_budget import fake_model


def value_of(mf, config, plan, hot, counts, ctx: int) -> float:
    """CPU bytes a token the plan and its hot neurons keep off the CPU, by the statistics."""
    nbytes = {n: int(e.n_bytes) for n, e in mf.tensors.items()}
    total = 0.0
    for i in range(config.n_layer):
        layer = [n for n in nbytes if names.block_of(n) == i]
        pred = [n for n in layer if names.template_of(n, names.PREDICTOR_MATRICES)]
        ffn = [n for n in layer if names.template_of(n, names.FFN_MATRICES)]
        if plan.layer_on_gpu[i]:
            attention = [n for n in layer if n not in pred and n not in ffn]
            total += sum(nbytes[n] for n in attention) + kv_bytes_per_layer(config, ctx, 2) / 2
        if plan.predictor_on_gpu[i]:
            total += sum(nbytes[n] for n in pred)
        rows = [names.tensor(t, i) for t in (names.FFN_UP, names.FFN_GATE, names.FFN_DOWN_T)]
        row_bytes = sum(nbytes[n] / mf.tensors[n].shape[0] for n in rows if n in nbytes)
        c = np.asarray(counts[i], dtype=np.float64)
        if hot is not None and len(hot[i]) and c.max() > 0:
            total += float(c[hot[i]].sum() / c.max()) * row_bytes
    if plan.output_on_gpu:
        head = (
            names.tensor(names.OUTPUT)
            if names.tensor(names.OUTPUT) in nbytes
            else names.tensor(names.TOKEN_EMBD)
        )
        total += nbytes[head] + nbytes.get(names.tensor(names.OUTPUT_NORM), 0)
    return total


def sweep(mf, config, counts, budgets_gib, *, activations):
    """(budget, hot neurons, value, plan) for each budget, placed as the loader places them."""
    ctx = default_ctx(config)
    rows = []
    for gib in budgets_gib:
        plan = plan_budget(mf, config, int(gib * GIB), ctx_size=ctx, activations=activations)
        hot = solve_placement(counts, plan.hot_bytes, plan.bytes_per_neuron) if plan.hot_bytes > 0 else None
        n_hot = 0 if hot is None else sum(len(h) for h in hot)
        rows.append((gib, n_hot, value_of(mf, config, plan, hot, counts, ctx), plan))
    return rows


def broken_promises(rows) -> list[str]:
    """Where a larger budget keeps fewer bytes a token off the CPU, or holds fewer hot neurons without saying why."""
    found = []
    for (b0, n0, v0, _), (b1, n1, v1, plan) in zip(rows, rows[1:]):
        if v1 < v0 * (1 - 1e-9):
            found.append(f"{b0:.4f} -> {b1:.4f} GiB: value {v0:.0f} -> {v1:.0f} bytes a token")
        if n1 < n0 and not (getattr(plan, "displaced", 0) > 0 and "displaced" in plan.describe()):
            found.append(
                f"{b0:.4f} -> {b1:.4f} GiB: {n0} -> {n1} hot neurons, unexplained: {plan.describe()}"
            )
    return found


BUDGETS = np.round(np.arange(0, 0.3001, 0.005), 4)


@pytest.fixture
def demo(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "cache"))  # the bundled statistics, not a user's
    mf = ModelFile(demo_model_path())
    config = config_from_file(mf)
    counts = read_activation_files(default_activation_dir(mf.path), config.n_layer, config.n_ff)
    assert counts is not None
    return mf, config, counts


def test_demo_model_sweep_is_monotone_or_says_why(demo):
    mf, config, counts = demo
    rows = sweep(mf, config, counts, BUDGETS, activations="auto")
    assert broken_promises(rows) == []
    for _, _, value, plan in rows:  # the plan's own figure is the solver's placement, valued independently
        assert plan.value_bytes is None or value == pytest.approx(plan.value_bytes, rel=1e-9)
    by_budget = {gib: (n, plan) for gib, n, _, plan in rows}
    total = config.n_layer * config.n_ff
    assert by_budget[0.05][0] == total  # every FFN neuron hot
    n_006, plan_006 = by_budget[0.06]
    assert n_006 < total and "output head on the GPU: read every token" in plan_006.describe()
    assert by_budget[0.1][0] == total and all(by_budget[0.1][1].layer_on_gpu)
    # the original's order, which ignores the statistics, breaks both promises on this model
    assert broken_promises(sweep(mf, config, counts, BUDGETS, activations=None))


def test_synthetic_model_sweep_is_monotone_or_says_why():
    mf, config = fake_model("small")
    rng = np.random.default_rng(0)
    counts = [torch.from_numpy(rng.zipf(1.3, config.n_ff).clip(max=10**6)) for _ in range(config.n_layer)]
    budgets = np.round(np.arange(0, 0.3001, 0.0025), 4)
    rows = sweep(mf, config, counts, budgets, activations=counts)
    assert broken_promises(rows) == []
    assert rows[-1][3].output_on_gpu and all(rows[-1][3].layer_on_gpu)
    assert broken_promises(sweep(mf, config, counts, budgets, activations=None))


def test_without_statistics_the_walk_keeps_the_originals_order(tiny_sparse_gguf):
    mf = ModelFile(tiny_sparse_gguf)  # no activation folder beside it
    c = config_from_file(mf)
    auto = plan_budget(mf, c, 1 << 34, ctx_size=64)
    assert auto.value_bytes is None and auto.choice == [] and auto.output_on_gpu and all(auto.layer_on_gpu)


def test_disable_gpu_index_plans_without_hot_rows():
    """--disable-gpu-index places no hot rows, so the plan must not trade attention or the head for them: it is
    the plan of a model without statistics (today's order), whatever the statistics say."""
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.loader import demo_model_path, load_model
    from hotcold.placement.budget import plan_budget

    mf = ModelFile(demo_model_path())
    config = config_from_file(mf)
    budget = int(0.06 * 2**30)
    plain = plan_budget(mf, config, budget, ctx_size=512, device_type="cpu", activations=None)
    loaded = load_model(
        None, device="cpu", fast_device="cpu", vram_budget=0.06, disable_gpu_index=True, ctx_size=512
    )
    assert loaded.plan.layer_on_gpu == plain.layer_on_gpu
    assert loaded.plan.output_on_gpu == plain.output_on_gpu
