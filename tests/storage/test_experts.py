"""An MoE file under a RAM budget (storage/experts.py): whole experts read from the file when the router picks them,
a cache of recent ones, the rest resident where the budget has room. The products are the unlimited load's, bit
for bit (the cached experts packed as the unlimited load packs them); the reads start as soon as the router has
chosen (every chosen expert in flight before the first is computed); the plan refuses a budget without room for a
token's top-k experts, naming it; a budget with room for every expert is an ordinary load (the one-call decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hotcold
from benchmarks import gpt_oss_synth, smallthinker_synth
from hotcold.config import config_from_file
from hotcold.gguf.io import ModelFile
from hotcold.placement.walk import GIB
from hotcold.storage.experts import ExpertStore
from hotcold.storage.plan import SLOT_COST, plan_ram
from tests.storage.test_ffn import run

CTX = 128
SHAPE = dict(
    n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_used=2, n_ff=256, n_vocab=512
)


@pytest.fixture(scope="module", params=["gpt-oss", "smallthinker"])
def moe_file(tmp_path_factory, request):
    """8 experts of which a token uses 2, in 2 layers, F16: gpt-oss-shaped (attention sinks, biases, a router with a
    bias, clamped-SwiGLU experts, all three matrices packed by a load without storage) or SmallThinker-shaped (ReLU
    experts computed over their live rows: only the gate packed, up and down gathered by rows)."""
    make = gpt_oss_synth if request.param == "gpt-oss" else smallthinker_synth
    return make.synthesize(tmp_path_factory.mktemp("moe") / "moe.gguf", seed=3, **SHAPE)


def budget(path, slots: int) -> float:
    """GiB leaving room for `slots` cached experts a layer beside what every token reads."""
    mf = ModelFile(path)
    plan = plan_ram(mf, config_from_file(mf), 1 << 40, ctx_size=CTX)
    per_layer = max(int(SLOT_COST * b) for b in plan.per_neuron)
    return (plan.always_bytes + SHAPE["n_layer"] * (slots * per_layer + 4096)) / GIB  # 4 KiB: float rounding


def stores(llm) -> list:
    return [layer.ffn.experts for layer in llm.loaded.model.layers]


@pytest.mark.parametrize("slots", [2, 3])
def test_experts_read_on_demand_give_the_unlimited_bits(moe_file, slots):
    full = hotcold.load(moe_file, device="cpu", ctx_size=CTX, threads=2)
    llm = hotcold.load(moe_file, device="cpu", ctx_size=CTX, threads=2, ram_budget=budget(moe_file, slots))
    assert all(isinstance(s, ExpertStore) and s.capacity == slots for s in stores(llm))
    assert llm.decoder == "eager"  # the cached experts have no fixed addresses for the one-call plans
    (want, want_ids), (got, got_ids) = run(full), run(llm)
    assert got_ids == want_ids
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    counts = llm.loaded.model.storage_stats.snapshot()
    assert counts["bytes_read"] > 0 and counts["cold_selected"] > 0 and counts["hot_selected"] == 0
    expert = stores(llm)[0].expert_bytes
    assert counts["bytes_read"] == expert * (counts["cold_selected"] - counts["cache_hits"])  # whole experts
    if slots == 3:
        assert counts["cache_hits"] > 0
    assert all(len(s.cached) <= slots and not s.pending for s in stores(llm))


def test_the_reads_start_when_the_router_chooses(moe_file):
    """route() starts the reads of every chosen expert (SmallThinker routes before its attention, so they overlap
    it); the layer then computes them in order as they arrive."""
    from tests.fixtures import ffn_state

    llm = hotcold.load(moe_file, device="cpu", ctx_size=CTX, threads=2, ram_budget=budget(moe_file, 2))
    store, moe = stores(llm)[0], llm.loaded.model.layers[0].ffn
    x = torch.randn(1, SHAPE["n_embd"], generator=torch.Generator().manual_seed(4))
    ids, weights = moe.route(moe.norm(x))
    chosen = sorted(ids[0].tolist())
    assert sorted(store.pending) == chosen and not store.cached  # in flight before any is computed
    moe(x, ffn_state(dense=True), routing=(ids, weights))
    assert sorted(store.cached) == chosen and not store.pending


def test_a_budget_without_room_for_a_tokens_experts_is_refused(moe_file):
    with pytest.raises(ValueError, match=r"room for 1 experts a layer; a token needs its 2"):
        hotcold.load(moe_file, device="cpu", ctx_size=CTX, ram_budget=budget(moe_file, 1))


def test_room_for_every_expert_is_an_ordinary_load(moe_file):
    mf = ModelFile(moe_file)
    total = sum(e.n_bytes for e in mf.tensors.values()) / GIB
    llm = hotcold.load(moe_file, device="cpu", ctx_size=CTX, threads=2, ram_budget=total + 0.1)
    assert all(isinstance(s, list) for s in stores(llm)) and llm.decoder == "cpu_one_call"
    full = hotcold.load(moe_file, device="cpu", ctx_size=CTX, threads=2)
    assert torch.equal(run(llm)[0][-1], run(full)[0][-1])
    plan = plan_ram(mf, config_from_file(mf), int((total + 0.1) * GIB), ctx_size=CTX)
    assert plan.unit == "expert" and all(np.array_equal(h, np.arange(8)) for h in plan.hot)
    for mine, theirs in zip(
        stores(llm)[0], stores(full)[0], strict=True
    ):  # packed as the load without a budget
        for name in ("up", "gate"):
            assert (getattr(getattr(mine.weights, name), "packed", None) is None) == (
                getattr(getattr(theirs.weights, name), "packed", None) is None
            )
    assert "resident experts 100.0%" in plan.describe()


def test_routing_statistics_keep_the_most_routed_experts_resident(moe_file, tmp_path):
    """`hotcold profile` on an MoE model counts the router's picks per expert (activation files of n_expert counts);
    a budget with room beyond each layer's top-k slots then keeps the most routed experts resident, with the
    unlimited load's bits."""
    import shutil

    from hotcold.placement.profile import activation_output_dir, profile_routing, write_activation_files

    path = tmp_path / "moe.gguf"
    shutil.copy(moe_file, path)
    dense = hotcold.load(path, device="cpu", ctx_size=CTX, threads=2, dense=True)
    ids = [
        int(i) for i in torch.randint(3, SHAPE["n_vocab"], (300,), generator=torch.Generator().manual_seed(0))
    ]
    counts = profile_routing(dense, ids, ctx=100)
    # 300 tokens in windows of 100 (BOS + 99): 4 windows, their BOS positions counted too
    assert [int(c.sum()) for c in counts] == [SHAPE["n_used"] * (len(ids) + 4)] * SHAPE["n_layer"]
    assert all(c.shape == (SHAPE["n_expert"],) for c in counts)
    write_activation_files(counts, activation_output_dir(path), inputs=[path])
    llm = hotcold.load(path, device="cpu", ctx_size=CTX, threads=2, ram_budget=budget(path, 4))
    plan = llm.loaded.storage.plan
    assert plan.statistics is not None and "the most routed" in plan.describe()
    for layer, store in enumerate(stores(llm)):
        assert isinstance(store, ExpertStore) and len(store.resident) < SHAPE["n_expert"]
        order = torch.argsort(counts[layer], descending=True, stable=True)[: len(store.resident)]
        assert sorted(store.resident) == sorted(order.tolist())
        assert store.capacity >= SHAPE["n_used"]
    assert sum(len(s.resident) for s in stores(llm)) >= 4  # of the 2 x 8: the budget's spare room, by count
    full = hotcold.load(path, device="cpu", ctx_size=CTX, threads=2)
    (want, want_ids), (got, got_ids) = run(full), run(llm)
    assert got_ids == want_ids and all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    assert llm.loaded.model.storage_stats.snapshot()["hot_selected"] > 0
