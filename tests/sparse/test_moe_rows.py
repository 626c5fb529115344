"""sparse/moe.py's expert-row sparsity: a ReLU-gated expert over only its live rows (every gate row, the up rows where
relu(gate) != 0, the down rows whose activation is nonzero) equals the dense expert bit for bit, down stored [D, F]
(upstream's ffn_down_exps) or transposed (ffn_down_t, the PowerInfer fork's --transpose-down), gated and dReLU, in
the row kernels' types; and a MoE layer routes its tokens through it and counts the live rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hotcold.gguf.quants import QuantTensor, quantize
from hotcold.ops import LinearGroup, Norm
from hotcold.sparse.ffn import DenseFFN, dense_step
from hotcold.sparse.moe import MoEFFN, relu_rows_apply, runs_relu_rows
from tests.fixtures import ffn_state, ffn_weights

F, D = 256, 64


def as_blocks(w: torch.Tensor, dtype: str) -> QuantTensor:
    from gguf import GGMLQuantizationType as Q

    qtype = Q.Q8_0 if dtype == "q8_0" else Q.Q4_0
    return QuantTensor(torch.from_numpy(quantize(w.float(), qtype)), qtype, tuple(w.shape))


def expert(kind: str, down: str, dtype: str, seed: int = 0):
    w = ffn_weights(F, D, kind, torch.float16, seed=seed, scale=4.0)
    w = replace(w, activation="relu")
    if down == "down":
        w = replace(w, down=w.down_t.T.contiguous(), down_t=None)
    if dtype != "f16":
        q = {"down": as_blocks(w.down, dtype)} if down == "down" else {"down_t": as_blocks(w.down_t, dtype)}
        w = replace(w, up=as_blocks(w.up, dtype), gate=as_blocks(w.gate, dtype), **q)
    return w


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("down", ["down", "down_t"])
@pytest.mark.parametrize("kind", ["gated", "gated_both"])
def test_live_rows_equal_the_dense_expert(kind, down, dtype):
    w = expert(kind, down, dtype)
    for t in (1, 3):
        h = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
        dense, a = dense_step(w, h, LinearGroup([w.up, w.gate]))
        sparse, live = relu_rows_apply(w, h)
        assert torch.equal(sparse, dense)
        assert torch.equal(live, a != 0)
        assert 0 < int(live.sum()) < live.numel()  # rows skipped: the test skips something


def test_moe_layer_runs_live_rows_and_counts_them():
    experts = [DenseFFN(expert("gated", "down_t", "f16", seed=e), layer=0, expert=e) for e in range(4)]
    assert all(runs_relu_rows(e) for e in experts)
    router = torch.randn(4, D, generator=torch.Generator().manual_seed(9)).half()
    moe = MoEFFN(router, experts, 2, layer=0, norm=Norm(torch.ones(D), 1e-6), gating="sigmoid")
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    sparse_ctx, dense_ctx = ffn_state(), ffn_state(dense=True)
    assert torch.equal(moe(x, sparse_ctx), moe(x, dense_ctx))
    computed, total = sparse_ctx.counts[0].computed, sparse_ctx.counts[0].total
    assert dense_ctx.counts[0].computed == dense_ctx.counts[0].total == total == 5 * 2 * F
    assert 0 < computed < 0.75 * total


def test_float32_and_silu_experts_take_the_dense_path():
    w = expert("gated", "down_t", "f16")
    assert not runs_relu_rows(DenseFFN(replace(w, activation="silu"), layer=0, expert=0))
    assert not runs_relu_rows(DenseFFN(replace(w, up=w.up.float(), gate=w.gate.float()), layer=0, expert=0))
