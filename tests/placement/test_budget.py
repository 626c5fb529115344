"""The VRAM budget walk: the original's order, without stopping at the first tensor that does not fit; and
plans for real model shapes that never exceed their budget once everything the loader allocates for them
is added up (a simulated allocator, below, written from the loader's rules, not from the walk's)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hotcold.config import ModelConfig, config_from_file
from hotcold.device import DevicePlan, placed_nbytes
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile, TensorEntry, tensor_nbytes
from hotcold.loader import hot_rows_bytes, offload_device_plan, sparse_device_plan
from hotcold.placement import budget as budget_mod
from hotcold.placement.budget import (
    FREE_VRAM_MARGIN,
    GIB,
    kv_bytes_per_layer,
    plan_budget,
    plan_offload,
    scratch_bytes,
)
from hotcold.placement.solver import solve_placement

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it here
BUDGETS_GIB = (2, 4, 8, 12, 16, 24)
CTX = 2048


def test_walk_order_and_remainder(tiny_sparse_gguf):
    mf = ModelFile(tiny_sparse_gguf)
    c = config_from_file(mf)
    nothing = plan_budget(mf, c, 0, ctx_size=64)
    assert not any(nothing.layer_on_gpu) and nothing.hot_bytes == 0
    huge = plan_budget(mf, c, 1 << 34, ctx_size=64)
    assert all(huge.layer_on_gpu) and all(huge.predictor_on_gpu) and huge.output_on_gpu
    assert (
        huge.bytes_per_neuron == [3 * 64 * 4 + 8] * 2
    )  # up + gate + down_t rows, F32, + the int64 id on CUDA
    assert plan_budget(mf, c, 1 << 34, ctx_size=64, device_type="cpu").bytes_per_neuron == [3 * 64 * 4] * 2
    spent = huge.scratch_bytes + sum(huge.spent.values())
    assert huge.hot_bytes == (1 << 34) - spent
    assert huge.spent["attention"] >= 2 * kv_bytes_per_layer(c, 64, 2)  # the KV cache is counted


def test_a_unit_that_does_not_fit_does_not_stop_the_walk(tiny_sparse_gguf):
    mf = ModelFile(tiny_sparse_gguf)
    c = config_from_file(mf)
    # room for the scratch and one layer's attention, not for a second one: predictors still get placed
    one_layer = plan_budget(mf, c, 1 << 34, ctx_size=2048).spent["attention"] // 2  # KV makes it ~580 KB
    budget = scratch_bytes(c, 2048) + one_layer + 200_000  # a predictor is ~82 KB
    plan = plan_budget(mf, c, budget, ctx_size=2048)
    assert plan.layer_on_gpu == [True, False]
    assert plan.predictor_on_gpu == [True, False]
    assert plan.hot_bytes >= 0


# ------------------------------------------------------------------------------------------------
# Real shapes, faked: tensor names, types and byte sizes of 7B / 13B / 40B files, no data
# ------------------------------------------------------------------------------------------------

SHAPES = {  # ReluLLaMA-7B, ReluLLaMA-13B (PowerInfer's), ReluFalcon-40B
    "7B": dict(arch="llama", D=4096, F=11008, L=32, H=32, Hkv=32, V=32000, rank=1024, n_ctx=4096),
    "13B": dict(arch="llama", D=5120, F=13824, L=40, H=40, Hkv=40, V=32000, rank=1024, n_ctx=4096),
    "40B": dict(arch="falcon", D=8192, F=32768, L=60, H=128, Hkv=8, V=65024, rank=1024, n_ctx=2048),
    "small": dict(
        arch="llama", D=768, F=3072, L=12, H=12, Hkv=4, V=32000, rank=128, n_ctx=2048
    ),  # test_value
}


def fake_model(
    shape: str, matrices: Q = Q.F16, *, sparse: bool = True, predictors: Q = Q.F16, biases: bool = False
):
    """(model file, config) with the shape's tensors (F32 norms, `matrices` elsewhere); no bytes behind them."""
    s = SHAPES[shape]
    D, F, L, H, Hkv, V, R = (s[k] for k in ("D", "F", "L", "H", "Hkv", "V", "rank"))
    Dh = D // H
    falcon = s["arch"] == "falcon"
    tensors: dict[str, TensorEntry] = {}

    def add(template, layer, shape_, qtype, suffix="weight"):
        name = names.tensor(template, layer, suffix)
        tensors[name] = TensorEntry(name, shape_, qtype, None, tensor_nbytes(qtype, shape_))

    add(names.TOKEN_EMBD, None, (V, D), matrices)
    add(names.OUTPUT_NORM, None, (D,), Q.F32)
    add(names.OUTPUT, None, (V, D), matrices)
    for i in range(L):
        add(names.ATTN_NORM, i, (D,), Q.F32)
        if falcon:  # two layer norms with biases, fused q/k/v, no gate
            add(names.ATTN_NORM, i, (D,), Q.F32, "bias")
            add(names.ATTN_NORM_2, i, (D,), Q.F32)
            add(names.ATTN_NORM_2, i, (D,), Q.F32, "bias")
            add(names.ATTN_QKV, i, ((H + 2 * Hkv) * Dh, D), matrices)
        else:
            add(names.FFN_NORM, i, (D,), Q.F32)
            add(names.ATTN_Q, i, (H * Dh, D), matrices)
            add(names.ATTN_K, i, (Hkv * Dh, D), matrices)
            add(names.ATTN_V, i, (Hkv * Dh, D), matrices)
            add(names.FFN_GATE, i, (F, D), matrices)
        add(names.ATTN_OUT, i, (D, H * Dh), matrices)
        add(names.FFN_UP, i, (F, D), matrices)
        if biases:  # OPT-style FFN biases
            add(names.FFN_UP, i, (F,), Q.F32, "bias")
            add(names.FFN_DOWN_T if sparse else names.FFN_DOWN, i, (D,), Q.F32, "bias")
        if sparse:
            add(names.FFN_DOWN_T, i, (F, D), matrices)
            add(names.PRED_FC1, i, (R, D), predictors)
            add(names.PRED_FC2, i, (F, R), predictors)
        else:
            add(names.FFN_DOWN, i, (D, F), matrices)
    config = ModelConfig(
        arch=s["arch"], n_vocab=V, n_ctx_train=s["n_ctx"], n_embd=D, n_layer=L, n_ff=F, n_head=H,
        n_head_kv=Hkv, head_dim=Dh, rope_dim=Dh, rope_base=10000.0, rope_scale=1.0, norm_eps=1e-5,
        ffn_activation="relu", ffn_kind="plain" if falcon else "gated", sparse=sparse, sparse_threshold=0.0,
    )  # fmt: skip
    return SimpleNamespace(tensors=tensors), config


def tensor_device(name: str, config: ModelConfig, devices: DevicePlan) -> torch.device | None:
    """Where the loader's TensorSource puts a file tensor (None: it stays in the mapped file)."""
    layer = names.block_of(name)
    if layer is None:
        if name == names.tensor(names.TOKEN_EMBD):
            return None  # on the CPU; a tied head's copy is charged with the head
        return devices.output
    if names.template_of(name, names.PREDICTOR_MATRICES):
        return devices.predictor[layer] if config.sparse else None  # a dense config reads no predictor
    if names.template_of(name, names.FFN_MATRICES):
        return devices.ffn[layer]
    return devices.attention[layer]  # attention matrices, norms (ffn_norm is read on the layer's device)


def hot_copy_bytes(mf, layer: int, n_hot: int) -> int:
    """What HybridFFN copies for `n_hot` neurons of a layer (sparse/hybrid.py `_rows_to`, `hot_idx_fast`)."""
    total = 8 * n_hot  # the int64 ids on the device
    if names.tensor(names.FFN_UP, layer, "bias") in mf.tensors:
        total += 4 * n_hot  # the hot neurons' up bias, float32
    for template in (names.FFN_UP, names.FFN_GATE, names.FFN_DOWN_T):
        e = mf.tensors.get(names.tensor(template, layer))
        if e is None:
            continue
        kept = e.qtype.name in ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # what the Triton kernels read
        total += n_hot * (e.n_bytes // e.shape[0] if kept else 2 * e.shape[1])
    return total


def simulated_allocator(mf, config, devices: DevicePlan, *, ctx: int, scratch: int, n_seq: int = 1) -> int:
    """Bytes the loader would allocate on the GPU for `devices` with `n_seq` sequences' KV caches (a
    server's slots), plus the scratch reserve."""
    total = scratch
    for name, e in mf.tensors.items():
        where = tensor_device(name, config, devices)
        if where is not None and where.type == "cuda":
            total += placed_nbytes(e.qtype.name, e.shape, e.n_bytes, "cuda")
    if names.tensor(names.OUTPUT) not in mf.tensors and devices.output.type == "cuda":
        e = mf.tensors[names.tensor(names.TOKEN_EMBD)]
        total += placed_nbytes(e.qtype.name, e.shape, e.n_bytes, "cuda")
    for device, dtype in zip(devices.attention, devices.kv_dtypes(), strict=True):
        if device.type == "cuda":  # KVCache: k and v [ctx, Hkv, Dh] in the layer's KV dtype
            total += n_seq * 2 * ctx * config.n_head_kv * config.head_dim * dtype.itemsize
    if devices.hot is not None:
        total += sum(hot_copy_bytes(mf, i, len(h)) for i, h in enumerate(devices.hot))
        for i, h in enumerate(devices.hot):  # HybridFFN moves its down bias to the layer's device, once
            bias = mf.tensors.get(names.tensor(names.FFN_DOWN_T, i, "bias"))
            if len(h) and bias is not None and devices.attention[i].type == "cuda":
                total += 4 * bias.shape[0]
    return total


def skewed_counts(n_layer: int, n_ff: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.zipf(1.5, n_ff).astype(np.float64) for _ in range(n_layer)]


def sparse_plan(mf, config, budget: int):
    """The loader's sparse path: walk, solve, device plan (loader.load_model without the file)."""
    plan = plan_budget(mf, config, budget, ctx_size=CTX)
    hot = None
    if plan.hot_bytes > 0:
        hot = solve_placement(
            skewed_counts(config.n_layer, config.n_ff), plan.hot_bytes, plan.bytes_per_neuron
        )
    return plan, hot, sparse_device_plan(plan, CUDA, hot)


@pytest.mark.parametrize("shape", ["7B", "13B", "40B"])
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0, Q.Q4_K], ids=["F16", "Q4_0", "Q4_K"])
def test_sparse_plans_never_exceed_the_budget(shape, qtype):
    """Fails where the walk prices something below what the loader allocates: Q4_K hot rows go to the GPU
    as fp16 (the Triton kernels read Q8_0/Q4_0 only), each hot neuron's id, norms as float32."""
    mf, config = fake_model(shape, qtype)
    for gib in BUDGETS_GIB:
        budget = gib * GIB
        plan, hot, devices = sparse_plan(mf, config, budget)
        used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=plan.scratch_bytes)
        assert used <= budget, f"{shape} {qtype.name} at {gib} GiB: {used - budget} bytes over"
        # and the plan's figures by part add up to the same total
        assert sum(plan.parts(hot_rows_bytes(plan, hot)).values()) == used
        if hot is not None:  # hot rows got what was left, to within one group of 256 neurons
            assert budget - used < 256 * max(plan.bytes_per_neuron) or all(len(h) == config.n_ff for h in hot)


@pytest.mark.parametrize("shape", ["7B", "13B", "40B"])
@pytest.mark.parametrize("sparse_file", [False, True], ids=["dense-file", "sparse-file-run-dense"])
def test_layer_offload_plans_never_exceed_the_budget_and_place_the_head(shape, sparse_file):
    """-ngl at a budget: fails if the head is reserved but left on the CPU (the old loader placed it only
    when every layer fit) or if a sparse file run dense puts its (unpriced) predictors on the GPU."""
    mf, config = fake_model(shape, sparse=sparse_file)
    for gib in BUDGETS_GIB:
        budget = gib * GIB
        offload = plan_offload(mf, config, budget, ctx_size=CTX)
        devices = offload_device_plan(config.n_layer, offload.n_layers, CUDA, output=offload.output_on_gpu)
        used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=offload.scratch_bytes)
        assert used <= budget, f"{shape} at {gib} GiB: {used - budget} bytes over"
        assert sum(offload.parts().values()) == used
        assert (devices.output.type == "cuda") == offload.output_on_gpu
        if gib >= 4:  # the head (<= 1 GiB for these shapes) is reserved first: it must be placed
            assert offload.output_on_gpu
        assert offload.n_layers > 0 or gib == 2
    # a budget that holds every layer holds the head as well
    offload = plan_offload(mf, config, 200 * GIB, ctx_size=CTX)
    assert offload.n_layers == config.n_layer and offload.output_on_gpu


def test_ffn_biases_are_charged():
    """A biased FFN (OPT, Falcon-style files): each hot neuron's up bias goes with it, and a hybrid layer
    keeps its down bias on the layer's device."""
    mf, config = fake_model("7B", biases=True)
    for gib in BUDGETS_GIB:
        plan, hot, devices = sparse_plan(mf, config, gib * GIB)
        assert plan.bytes_per_neuron[0] == 3 * 4096 * 2 + 4 + 8
        used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=plan.scratch_bytes)
        assert used <= gib * GIB, f"{gib} GiB: {used - gib * GIB} bytes over"


def test_every_slots_kv_cache_is_charged():
    """A server with 4 slots allocates 4 KV caches: planned for one, 7B at 8 GiB would overshoot by 3."""
    mf, config = fake_model("7B")
    one = plan_budget(mf, config, 8 * GIB, ctx_size=CTX)
    four = plan_budget(mf, config, 8 * GIB, ctx_size=CTX, kv_sequences=4)
    devices = sparse_device_plan(one, CUDA, None)
    assert simulated_allocator(mf, config, devices, ctx=CTX, scratch=one.scratch_bytes, n_seq=4) > 8 * GIB
    assert sum(four.layer_on_gpu) < sum(one.layer_on_gpu)
    assert four.kv_bytes == 4 * sum(four.layer_on_gpu) * kv_bytes_per_layer(config, CTX, 2)
    for gib in BUDGETS_GIB:
        plan = plan_budget(mf, config, gib * GIB, ctx_size=CTX, kv_sequences=4)
        hot = solve_placement(skewed_counts(32, config.n_ff), plan.hot_bytes, plan.bytes_per_neuron)
        devices = sparse_device_plan(plan, CUDA, hot if plan.hot_bytes > 0 else None)
        used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=plan.scratch_bytes, n_seq=4)
        assert used <= gib * GIB
        offload = plan_offload(mf, config, gib * GIB, ctx_size=CTX, kv_sequences=4)
        devices = offload_device_plan(32, offload.n_layers, CUDA, output=offload.output_on_gpu)
        used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=offload.scratch_bytes, n_seq=4)
        assert used <= gib * GIB


def test_a_budget_that_fits_part_of_the_attention():
    mf, config = fake_model("7B")
    plan, hot, devices = sparse_plan(mf, config, 2 * GIB)
    n = sum(plan.layer_on_gpu)
    assert 0 < n < config.n_layer
    assert plan.layer_on_gpu == [True] * n + [False] * (config.n_layer - n)  # from layer 0 up
    assert devices.attention[n].type == "cpu" and devices.attention[n - 1].type == "cuda"
    used = simulated_allocator(mf, config, devices, ctx=CTX, scratch=plan.scratch_bytes)
    assert used <= 2 * GIB
    # what did not fit is said, with what it needed (a layer: 4 x 32 MiB fp16 matrices, two norms, fp16 KV)
    kv = kv_bytes_per_layer(config, CTX, 2)
    assert plan.kv_bytes == n * kv
    assert f"attention+KV of {config.n_layer - n} layers (from layer {n}: 160.0 MiB" in plan.describe()
    # 100 MiB more: still no room for layer n's attention (160 MiB), but the walk goes on to 3 predictors
    # (30.5 MiB each) and gives the rest to hot rows
    more = plan_budget(mf, config, 2 * GIB + (100 << 20), ctx_size=CTX)
    assert more.layer_on_gpu == plan.layer_on_gpu
    assert more.predictor_on_gpu == [True] * 3 + [False] * (config.n_layer - 3)
    assert 0 < more.hot_bytes < 30 << 20


def test_a_budget_below_the_scratch_space_places_nothing_and_says_what_it_needed():
    mf, config = fake_model("7B")
    plan = plan_budget(mf, config, 100 << 20, ctx_size=CTX)
    assert not any(plan.layer_on_gpu) and not plan.output_on_gpu and plan.hot_bytes == 0
    need = scratch_bytes(config, CTX, attention=False)
    assert f"the prefill scratch space needs {need / 2**20:.1f} MiB" in plan.describe()
    offload = plan_offload(mf, config, 100 << 20, ctx_size=CTX)
    assert offload.n_layers == 0 and not offload.output_on_gpu
    assert "the prefill scratch space needs" in offload.describe(config.n_layer)


def test_kv_cache_dtype_follows_each_layers_device():
    """A layer whose attention stays on the CPU keeps a float32 cache (the C attention reads float32) even
    when other layers are on CUDA, and the walk prices each GPU layer's KV in fp16."""
    mf, config = fake_model("7B")
    plan = plan_budget(mf, config, 3 * GIB, ctx_size=CTX)
    devices = sparse_device_plan(plan, CUDA, None)
    n = sum(plan.layer_on_gpu)
    assert 0 < n < config.n_layer
    assert devices.kv_dtypes() == [torch.float16] * n + [torch.float32] * (config.n_layer - n)
    assert plan.kv_bytes == n * 2 * CTX * config.n_head_kv * config.head_dim * 2
    stand_in = plan_budget(mf, config, 3 * GIB, ctx_size=CTX, device_type="cpu")  # float32 KV there
    assert stand_in.kv_bytes == sum(stand_in.layer_on_gpu) * 2 * CTX * config.n_head_kv * config.head_dim * 4


def test_scratch_covers_the_prefill_temporaries():
    """The reserve covers a prefill chunk's temporaries at the context size (the old fixed 152 MB for 7B
    did not: attention scores alone are 128 MiB at 2048)."""
    from hotcold.runtime import generation

    assert budget_mod.PREFILL_CHUNK == generation.PREFILL_CHUNK
    mf, c = fake_model("7B")
    T, S = generation.PREFILL_CHUNK, CTX
    floor = (
        c.n_head * T * S * 4  # attention scores [H, T, ctx]
        + 3 * T * c.n_ff * 4  # up, gate, act [T, n_ff]
        + 2 * T * c.n_embd * 4  # residual copies [T, D]
        + T * (c.n_head + 2 * c.n_head_kv) * c.head_dim * 4  # q, k, v
        + c.n_vocab * 4  # the last row's logits
    )
    assert scratch_bytes(c, S) >= floor
    assert scratch_bytes(c, S) > 200 * 2**20
    assert scratch_bytes(c, 4096) > scratch_bytes(c, 2048)  # scores grow with the context
    assert scratch_bytes(c, 64) < scratch_bytes(c, 2048)  # a short context: short chunks
    # the walk reserves attention's temporaries only once a layer's attention is on the GPU
    plan = plan_budget(mf, c, 2 * GIB, ctx_size=S)
    assert plan.scratch_bytes == scratch_bytes(c, S)
    only_hot = plan_budget(mf, c, scratch_bytes(c, S, attention=False) + (64 << 20), ctx_size=S)
    assert not any(only_hot.layer_on_gpu) and only_hot.scratch_bytes == scratch_bytes(c, S, attention=False)
    assert only_hot.hot_bytes == 64 << 20


def test_default_budget_adds_back_the_caching_allocators_free_blocks(monkeypatch):
    """mem_get_info counts blocks this process reserved but does not use as taken; they are free to us."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * GIB, 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * GIB)
    assert budget_mod.default_budget_bytes() == 14 * GIB - FREE_VRAM_MARGIN


# ------------------------------------------------------------------------------------------------
# Above 2 GiB: byte counts and offsets in Python ints (PowerInfer's int32 overflowed there)
# ------------------------------------------------------------------------------------------------


def test_tensor_sizes_above_2_gib_whatever_integer_type_the_shape_holds():
    shape = (np.int32(152064), np.int32(8192))  # a 72B-sized vocabulary head: 2.3 GiB in fp16
    n = 152064 * 8192
    with np.errstate(over="raise"):
        assert placed_nbytes("Q4_0", shape, n // 32 * 18, "cuda") == 2 * n > 2**31
        assert placed_nbytes("F16", shape, 2 * n, "cpu") == 2 * n
        assert placed_nbytes("F32", (np.int32(1 << 20),), 0, "cuda") == 4 << 20


def test_plans_and_placements_above_2_gib():
    mf, config = fake_model("40B", Q.F16)
    head = mf.tensors[names.tensor(names.OUTPUT)]
    mf.tensors[head.name] = TensorEntry(head.name, (262144, 8192), Q.F16, None, 2 * 262144 * 8192)  # 4 GiB
    plan, hot, devices = sparse_plan(mf, config, 40 * GIB)
    assert plan.output_on_gpu and plan.spent["output"] == 4 * GIB + 4 * 8192
    assert isinstance(plan.hot_bytes, int) and plan.hot_bytes > 2**31
    used = hot_rows_bytes(plan, hot)
    assert isinstance(used, int) and 2**31 < used <= plan.hot_bytes
    assert simulated_allocator(mf, config, devices, ctx=CTX, scratch=plan.scratch_bytes) <= 40 * GIB


def test_placement_cache_keeps_a_capacity_above_4_gib(tmp_path):
    from hotcold.placement.gpuidx import Placement, read_gpuidx, write_gpuidx

    hot = [np.arange(0, 32768, 2, dtype=np.int64), np.arange(256, dtype=np.int64)]
    capacity = 20 * GIB + 12345
    path = write_gpuidx(tmp_path / "m.gguf.generated.gpuidx", Placement(hot, [32768] * 2, capacity, {}), [])
    back = read_gpuidx(path)
    assert back.vram_capacity == capacity and [len(h) for h in back.hot] == [16384, 256]
