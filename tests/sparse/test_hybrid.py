"""Hybrid FFN == CPU-only sparse FFN for any placement (a second CPU placement stands in for the GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hotcold
from hotcold.loader import load_model
from hotcold.placement.gpuidx import gpuidx_path, read_gpuidx
from hotcold.sparse.ffn import SparseFFN
from hotcold.sparse.hybrid import HybridFFN
from tests.fixtures import ffn_state, ffn_weights, with_activation_stats

F, D = 1280, 64


def make_weights(kind: str, dtype=torch.float32, bias=False, seed=0):
    return ffn_weights(F, D, kind, dtype, seed=seed, bias=bias, scale=8)


def random_predictor(rate: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(D, F, generator=g)
    thr = torch.quantile((torch.randn(256, D, generator=g) @ proj).flatten(), 1 - rate).item()
    return lambda p: (p @ proj) >= thr


@pytest.mark.parametrize("kind, bias", [("gated", False), ("gated_both", False), ("plain", True)])
@pytest.mark.parametrize("hot_share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("T", [1, 5])
def test_hybrid_equals_cpu_sparse(kind, bias, hot_share, T):
    weights = make_weights(kind, bias=bias)
    predictor = random_predictor(0.2, seed=1)
    hot = torch.randperm(F, generator=torch.Generator().manual_seed(2))[: int(hot_share * F)]
    x, p = torch.randn(T, D), torch.randn(T, D)
    ref = SparseFFN(weights, predictor, layer=0, threads=1).apply(x, p, ffn_state())
    seq = ffn_state()
    got = HybridFFN(weights, predictor, hot, "cpu", layer=0, threads=1).apply(x, p, seq)
    assert torch.allclose(got, ref, atol=1e-5 * ref.abs().max(), rtol=0)
    assert seq.counts[0].total == T * F and 0 < seq.counts[0].computed < T * F


def test_hybrid_with_f16_weights():
    weights = make_weights("gated", dtype=torch.float16)
    predictor = random_predictor(0.1, seed=3)
    hot = torch.arange(0, F, 3)
    x, p = torch.randn(2, D), torch.randn(2, D)
    ref = SparseFFN(weights, predictor, layer=0).apply(x, p, ffn_state())
    got = HybridFFN(weights, predictor, hot, "cpu", layer=0).apply(x, p, ffn_state())
    assert torch.allclose(got, ref, atol=1e-5 * ref.abs().max(), rtol=0)


@pytest.fixture()
def model_with_stats(tmp_path, tiny_sparse_gguf):
    return with_activation_stats(tiny_sparse_gguf, tmp_path)[0]


IDS = list(range(3, 40))


def budget_gib(path, extra_bytes: int) -> float:
    """Scratch space plus the dense parts of the tiny model (~0.9 MB) plus extra_bytes for hot rows."""
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.placement.budget import scratch_bytes

    return (scratch_bytes(config_from_file(ModelFile(path))) + 900_000 + extra_bytes) / 2**30


def test_loader_hybrid_equals_cpu_sparse_and_caches_placement(model_with_stats):
    ref = hotcold.load(model_with_stats, device="cpu").logits(IDS)
    # a budget that fits the attention of both layers and some hot neurons but not all (1280 x 768 B each)
    small, large = budget_gib(model_with_stats, 800_000), budget_gib(model_with_stats, 1_400_000)
    loaded = load_model(model_with_stats, device="cpu", fast_device="cpu", vram_budget=small)
    assert all(loaded.plan.layer_on_gpu) and loaded.plan.output_on_gpu
    assert loaded.plan.hot_bytes > 0
    hot = [len(h) for h in loaded.hot]
    assert 0 < sum(hot) < 2 * 1280 and all(h % 256 == 0 for h in hot)
    got = hotcold.Model(loaded).logits(IDS)
    assert torch.allclose(got, ref, atol=1e-5 * ref.abs().max(), rtol=0)
    cache = gpuidx_path(model_with_stats)
    assert cache.exists() and [len(h) for h in read_gpuidx(cache).hot] == hot
    again = load_model(model_with_stats, device="cpu", fast_device="cpu", vram_budget=small)
    assert any("placement from" in n for n in again.notes)
    bigger = load_model(model_with_stats, device="cpu", fast_device="cpu", vram_budget=large)
    assert any("solving again" in n for n in bigger.notes)  # never reused for another budget
    assert sum(len(h) for h in bigger.hot) >= sum(hot)


def test_budget_too_small_runs_on_cpu_and_says_so(model_with_stats):
    loaded = load_model(model_with_stats, device="cpu", fast_device="cpu", vram_budget=0.0001)
    assert loaded.hot is None and not any(loaded.plan.layer_on_gpu)
    assert any("no VRAM left" in n for n in loaded.notes)
    ref = hotcold.load(model_with_stats, device="cpu").logits(IDS)
    assert torch.allclose(hotcold.Model(loaded).logits(IDS), ref, atol=1e-6 * ref.abs().max())


def test_missing_statistics_named_with_the_fix(tmp_path, tiny_sparse_gguf):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_sparse_gguf, path)
    loaded = load_model(path, device="cpu", fast_device="cpu", vram_budget=budget_gib(path, 800_000))
    assert loaded.hot is None
    assert any("no activation statistics" in n and "hotcold profile" in n for n in loaded.notes)


def test_no_gpu_budget_note(tiny_sparse_gguf):
    loaded = load_model(tiny_sparse_gguf, device="cpu", vram_budget=4)
    assert any("ignored: no CUDA GPU" in n for n in loaded.notes)


def test_place_cli_writes_cache_and_info_reports_it(model_with_stats, capsys):
    from hotcold.cli import main

    budget = budget_gib(model_with_stats, 800_000)
    assert main(["place", "-m", str(model_with_stats), "--vram-budget", f"{budget:.6f}"]) == 0
    out = capsys.readouterr().out
    assert "hot neurons per layer" in out
    assert gpuidx_path(model_with_stats).exists()
    assert main(["info", "-m", str(model_with_stats)]) == 0
    assert "of FFN neurons hot" in capsys.readouterr().out


def test_dense_layer_offload_equals_cpu(tiny_dense_gguf):
    ref = hotcold.load(tiny_dense_gguf, device="cpu").logits(IDS)
    loaded = load_model(tiny_dense_gguf, device="cpu", fast_device="cpu", n_gpu_layers=1)
    assert any("-ngl 1: 1 of 2 layers" in n for n in loaded.notes)
    assert torch.allclose(hotcold.Model(loaded).logits(IDS), ref, atol=1e-6 * ref.abs().max())


def test_corrupt_activation_file_named(model_with_stats):
    bad = model_with_stats.parent / "activation" / "activation_1.pt"
    bad.write_bytes(b"not a tensor")
    with pytest.raises(ValueError, match="activation_1.pt: not a readable activation tensor"):
        load_model(
            model_with_stats,
            device="cpu",
            fast_device="cpu",
            vram_budget=budget_gib(model_with_stats, 800_000),
        )


def test_hot_rows_of_types_the_gpu_kernels_lack_go_over_as_f16():
    """Q8_0 / Q4_0 hot rows stay ggml blocks on the fast device (the Triton kernels read them); any
    other block type (a Q4_K_M file's Q4_K and Q6_K) goes over dequantized to F16, at load."""
    from gguf import GGMLQuantizationType as Q

    from hotcold.gguf.quants import QuantTensor
    from hotcold.sparse.hybrid import _rows_to
    from tests.fixtures import random_blocks

    rows = torch.tensor([0, 3])
    raw = random_blocks(Q.Q4_K, 8, np.random.default_rng(0))
    raw[:, :4] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)  # moderate d and dmin
    q4k = QuantTensor(torch.from_numpy(raw.reshape(4, -1)), Q.Q4_K, (4, 512))
    fast = torch.device("meta")  # stands in for CUDA: any device that is not the CPU
    moved = _rows_to(q4k, rows, fast)
    assert isinstance(moved, torch.Tensor) and moved.dtype == torch.float16 and moved.shape == (2, 512)
    kept = _rows_to(QuantTensor.from_float(torch.randn(4, 64), Q.Q8_0), rows, fast)
    assert isinstance(kept, QuantTensor) and kept.qtype == Q.Q8_0 and kept.device == fast
    assert isinstance(_rows_to(q4k, rows, torch.device("cpu")), QuantTensor)  # the CPU reads Q4_K itself


# ---------------------------------------------------------------- launches and host waits, on meta

COUNT_ON_META = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from hotcold.kernels.launches import LaunchCounter
    from hotcold.sparse.hybrid import HybridFFN
    from hotcold.sparse.predictor import Predictor
    from tests.fixtures import ffn_state, ffn_weights, with_activation_stats

    F, D, R = 1280, 256, 64
    out = {{}}
    for name, n_hot in (("split", 512), ("all_hot", F)):
        weights = ffn_weights(F, D, "gated", torch.float16, bias=False)
        predictor = Predictor(torch.empty(R, D, device="meta"), torch.empty(F, R, device="meta"), 0.0)
        ffn = HybridFFN(weights, predictor, torch.arange(n_hot), "meta", layer=0, threads=1)
        h, p = torch.empty(1, D, device="meta"), torch.empty(1, D, device="meta")
        with LaunchCounter("meta") as count:
            ffn.apply(h, p, ffn_state())
        out[name] = dict(syncs=count.syncs, sync_ops=dict(count.sync_ops), d2h=count.d2h, h2d=count.h2d,
                         launches=count.launches, ops=dict(count.by_op))
    print(json.dumps(out))
    """
)


def test_hybrid_layer_waits_for_the_host_once():
    """Counted on the meta device (the same dispatch path as CUDA): one host wait a layer, for the
    predictor's mask and the FFN input together; no blocking copy; the cold result goes back without one."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_ON_META.format(root=root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    split, all_hot = got["split"], got["all_hot"]
    assert split["sync_ops"] == {"event_wait": 1}, split
    assert split["d2h"] == 2 and split["h2d"] == 1, split  # mask + x out, the cold result in
    assert all_hot["sync_ops"] == {"event_wait": 1} and all_hot["d2h"] == 1 and all_hot["h2d"] == 0, all_hot
    assert split["ops"]["triton:_matvec_kernel"] == 2 and split["ops"]["triton:_axpy_kernel"] == 1, split


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hybrid_on_gpu_equals_cpu_sparse_and_waits_once_a_layer(model_with_stats):
    """On a real GPU: a budget that holds part of the FFN gives the CPU-only logits (the KV cache and the
    attention run in fp16 there, hence the tolerance) and a decode token waits for the host once a layer."""
    from hotcold.kernels.launches import LaunchCounter
    from hotcold.runtime.engine import Engine

    ref = hotcold.load(model_with_stats, device="cpu").logits(IDS)
    loaded = load_model(model_with_stats, device="cuda", vram_budget=budget_gib(model_with_stats, 800_000))
    assert loaded.hot is not None and 0 < sum(len(h) for h in loaded.hot) < 2 * 1280
    got = hotcold.Model(loaded).logits(IDS)
    assert torch.allclose(got, ref, atol=2e-3 * ref.abs().max(), rtol=0)
    engine = Engine(loaded.model, loaded.tokenizer, 64)
    logits = engine.prefill(IDS[:10])
    token = int(logits.argmax())
    with LaunchCounter("cuda") as count, torch.inference_mode():
        decoded = engine.forward([token], 10, last_only=True)[-1]  # the fused decode paths
    assert count.sync_ops.get("event_wait", 0) == sum(1 for h in loaded.hot if len(h)), count.sync_ops
    cpu = load_model(model_with_stats, device="cpu")
    reference = Engine(cpu.model, cpu.tokenizer, 64)
    reference.prefill(IDS[:10])
    with torch.inference_mode():
        expected = reference.forward([token], 10, last_only=True)[-1]
    assert torch.allclose(decoded, expected, atol=2e-3 * expected.abs().max(), rtol=0)


# ---------------------------------------------------------------- one decode token through the fused kernels


def test_a_failing_fused_token_falls_back_and_switches_off():
    """A hybrid layer whose fused decode token raises (a GPU or Triton that cannot compile the kernels)
    gives the general path's output, and the fused paths go off for the process, saying why."""
    import types

    class Switch:
        enabled, failure = True, None

        @classmethod
        def fail(cls, exc):
            cls.enabled, cls.failure = False, str(exc)

    class Broken:
        device = torch.device("cpu")
        td = types.SimpleNamespace(FusedPaths=Switch)

        def __call__(self, *args, **kwargs):
            raise RuntimeError("PTX JIT compilation failed")

    from hotcold.ops import Norm
    from hotcold.sparse.predictor import Predictor

    g = torch.Generator().manual_seed(1)
    w = make_weights("gated")
    pred = Predictor(torch.randn(32, D, generator=g), torch.randn(F, 32, generator=g), 0.5)
    norm = Norm(torch.rand(D, generator=g) + 0.5, 1e-5)
    x = torch.randn(1, D, generator=g)
    ffn = HybridFFN(w, pred, torch.arange(300), "cpu", layer=0, norm=norm, threads=1)
    ref = ffn(x, ffn_state())
    ffn.one_token = Broken()
    got = ffn(x, ffn_state())
    assert torch.equal(got, ref) and not Switch.enabled and "PTX" in Switch.failure


ONE_TOKEN = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from gguf import GGMLQuantizationType as Q
    from hotcold.kernels.launches import LaunchCounter
    from hotcold.ops import Norm
    from hotcold.gguf.quants import QuantTensor
    from hotcold.sparse.ffn import SparseFFN
    from hotcold.sparse.hybrid import HybridFFN
    from hotcold.sparse.predictor import Predictor
    from tests.fixtures import ffn_state, ffn_weights, with_activation_stats

    F, D, R = 1280, 64, 32
    g = torch.Generator().manual_seed(5)
    fc1, fc2 = torch.randn(R, D, generator=g) / 4, torch.randn(F, R, generator=g) / 4
    out = {{}}
    for name, kind, act, qtype, hot_share in (("f32 relu 0.3", "gated", "relu", None, 0.3),
                                             ("f16 silu both 1.0", "gated_both", "silu", torch.float16, 1.0),
                                             ("q4_0 relu 0.5", "gated", "relu", Q.Q4_0, 0.5)):
        w = ffn_weights(F, D, kind, torch.float32 if qtype is None or qtype == Q.Q4_0 else qtype, seed=3, scale=8)
        w.activation = act
        if qtype == Q.Q4_0:
            w.up, w.gate, w.down_t = (QuantTensor.from_float(t, Q.Q4_0) for t in (w.up, w.gate, w.down_t))
        pred = Predictor(fc1, fc2, 0.3)
        hot = torch.randperm(F, generator=g)[: int(F * hot_share)]
        norm = Norm(torch.rand(D, generator=g) + 0.5, 1e-5)
        ref_ffn = SparseFFN(w, pred, layer=0, threads=1, norm=norm if name.startswith("f16") else None)
        ffn = HybridFFN(w, pred, hot, "cpu", layer=0, threads=1, norm=ref_ffn.norm, one_token=True)
        assert ffn.one_token is not None
        ref_state, got_state = ffn_state(), ffn_state()
        errs, kept = [], []
        for _ in range(2):  # the same layer again: its buffers are reused, the results must not be
            x, p = torch.randn(1, D, generator=g), torch.randn(1, D, generator=g)
            if name.startswith("f16"):  # through __call__: the norm inside the predictor's first kernel, p = x
                ref, got = ref_ffn(x, ref_state), ffn(x, got_state)
            else:
                ref, got = ref_ffn.apply(x, p, ref_state), ffn.apply(x, p, got_state)
            errs.append(((got - ref).abs().max() / ref.abs().max()).item())
            kept.append((got, ref))
        c_ref, c_got = ref_state.seqs[0].counts[0], got_state.seqs[0].counts[0]
        first = ((kept[0][0] - kept[0][1]).abs().max() / kept[0][1].abs().max()).item()
        out[name] = dict(err=max(errs), first_unchanged=first == errs[0],
                         counts=[c_ref.computed, c_got.computed, c_ref.total, c_got.total])
    w = ffn_weights(F, 256, "gated", torch.float16, seed=3)
    pred = Predictor(torch.empty(R, 256, device="meta"), torch.empty(F, R, device="meta"), 0.0)
    ffn = HybridFFN(w, pred, torch.arange(512), "meta", layer=0, threads=1, one_token=True)
    with LaunchCounter("meta") as count:
        ffn.apply(torch.empty(1, 256, device="meta"), torch.empty(1, 256, device="meta"), ffn_state())
    out["meta"] = dict(launches=count.launches, syncs=count.syncs, d2h=count.d2h, h2d=count.h2d,
                       ops=dict(count.by_op))
    print(json.dumps(out))
    """
)


def test_one_token_fused_path_equals_cpu_sparse():
    """A decode token of a hybrid layer through the fused kernels (run by the Triton interpreter on a CPU
    placement): the CPU-only sparse FFN's output and neuron counts, for float and Q4_0 rows, gated and
    gated_both, part or all of the neurons hot, two tokens through the same layer (its buffers reused); on
    meta, one host wait, one copy each way and about ten launches."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", ONE_TOKEN.format(root=root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    meta = got.pop("meta")
    for name, row in got.items():
        # block rows: the CPU kernels multiply them with 8-bit activations (as llama.cpp does), the GPU
        # kernels with float ones, so the two differ by the activations' rounding
        assert row["err"] < (1e-2 if name.startswith("q4_0") else 1e-5), (name, row)
        assert row["first_unchanged"], (name, row)  # a returned output is not a reused buffer
        assert row["counts"][0] == row["counts"][1] > 0 and row["counts"][2] == row["counts"][3], (name, row)
    assert meta["syncs"] == 1 and meta["launches"] <= 12, meta
    # the FFN input and the mask out in one copy (they sit side by side), the cold result back in one
    assert meta["d2h"] == 1 and meta["h2d"] == 1, meta
