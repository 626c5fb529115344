"""The VRAM budget walk: the original's order, without stopping at the first tensor that does not fit."""

from __future__ import annotations

from hotcold.config import config_from_file
from hotcold.gguf_io import ModelFile
from hotcold.placement.budget import kv_bytes_per_layer, plan_budget, scratch_bytes


def test_walk_order_and_remainder(tiny_sparse_gguf):
    mf = ModelFile(tiny_sparse_gguf)
    c = config_from_file(mf)
    nothing = plan_budget(mf, c, 0, ctx_size=64)
    assert not any(nothing.layer_on_gpu) and nothing.hot_bytes == 0
    huge = plan_budget(mf, c, 1 << 34, ctx_size=64)
    assert all(huge.layer_on_gpu) and all(huge.predictor_on_gpu) and huge.output_on_gpu
    assert huge.bytes_per_neuron == [3 * 64 * 4] * 2  # up + gate + down_t rows, F32
    spent = huge.scratch_bytes + sum(huge.spent.values())
    assert huge.hot_bytes == (1 << 34) - spent
    assert huge.spent["attention"] >= 2 * kv_bytes_per_layer(c, 64, 2)  # the KV cache is counted


def test_a_unit_that_does_not_fit_does_not_stop_the_walk(tiny_sparse_gguf):
    mf = ModelFile(tiny_sparse_gguf)
    c = config_from_file(mf)
    # room for the scratch and one layer's attention, not for a second one: predictors still get placed
    one_layer = plan_budget(mf, c, 1 << 34, ctx_size=2048).spent["attention"] // 2  # KV makes it ~580 KB
    budget = scratch_bytes(c) + one_layer + 200_000  # a predictor is ~82 KB
    plan = plan_budget(mf, c, budget, ctx_size=2048)
    assert plan.layer_on_gpu == [True, False]
    assert plan.predictor_on_gpu == [True, False]
    assert plan.hot_bytes >= 0
