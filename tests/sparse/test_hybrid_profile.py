"""HybridFFN.profile (#46): per-call times of a hybrid layer for benchmarks/gpu.py (launch, host wait, CPU
cold rows, hot kernels, overlap), here on a CPU placement standing in for the GPU: the numbers change
nothing, every part is there, and a stand-in reports no overlap (its hot rows run on the host first)."""

from __future__ import annotations

import torch

from hotcold.sparse.hybrid import HybridFFN
from tests.fixtures import ffn_state
from tests.sparse.test_hybrid import F, make_weights, random_predictor

PARTS = {"launch", "wait", "cpu_cold", "tail", "sync", "gpu_hot", "overlap"}


def test_profile_records_each_call_and_changes_nothing():
    weights = make_weights("gated")
    predictor = random_predictor(0.2, seed=1)
    hot = torch.randperm(F, generator=torch.Generator().manual_seed(2))[: F // 3]
    ffn = HybridFFN(weights, predictor, hot, "cpu", layer=0, threads=1)
    x, p = torch.randn(1, 64), torch.randn(1, 64)
    ref = ffn.apply(x, p, ffn_state())
    ffn.profile = []
    got = [ffn.apply(x, p, ffn_state()) for _ in range(3)]
    assert all(torch.equal(g, ref) for g in got)
    assert len(ffn.profile) == 3 and all(set(r) == PARTS for r in ffn.profile), ffn.profile
    for r in ffn.profile:
        assert r["cpu_cold"] > 0 and r["gpu_hot"] > 0 and r["overlap"] == 0.0, r
        assert all(v >= 0 for v in r.values()), r
    ffn.profile = None
    ffn.apply(x, p, ffn_state())  # off again: nothing recorded, nothing raised
