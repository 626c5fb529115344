"""Mixtral (MoE) against Hugging Face transformers: converted by `hotcold convert`, loaded by `hotcold.load`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.cli.info import describe
from hotcold.convert import convert
from hotcold.gguf.io import ModelFile
from tests.fixtures import (
    TOKENIZER_VOCAB,
    hf_logits,
    random_ids,
    run_family_checks,
    save_checkpoint,
    write_predictors,
)

N_EXPERT, N_USED = 4, 2
CASES = {
    "relu": dict(hidden_act="relu"),
    "silu-dense": dict(hidden_act="silu"),
    "drelu": dict(hidden_act="relu", hotcold_ffn_kind="gated_both"),  # TurboSparse-Mixtral
}


def drelu_experts(experts):
    """transformers' MixtralExperts with relu on both gate and up (what TurboSparse's custom code computes)."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.num_experts):
            tokens, slot = torch.where(top_k_index == e)
            if len(tokens):
                gate, up = torch.nn.functional.linear(hidden_states[tokens], experts.gate_up_proj[e]).chunk(
                    2, -1
                )
                y = torch.nn.functional.linear(torch.relu(gate) * torch.relu(up), experts.down_proj[e])
                out.index_add_(0, tokens, y * top_k_weights[tokens, slot, None])
        return out

    return forward


def make_mixtral(
    hf_dir: Path, spm_model: Path, *, seed: int = 0, hotcold_ffn_kind: str | None = None, **overrides
):
    from transformers import MixtralConfig, MixtralForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=N_EXPERT,
        num_experts_per_tok=N_USED,
        max_position_embeddings=256,
        hidden_act="relu",
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**settings)).eval()
    with torch.no_grad():  # random init is too tame: make logits, activations and routing non-trivial
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10.0)
    save_checkpoint(model, hf_dir, spm_model)
    if hotcold_ffn_kind:
        config = json.loads((hf_dir / "config.json").read_text())
        config["hotcold_ffn_kind"] = hotcold_ffn_kind
        (hf_dir / "config.json").write_text(json.dumps(config))
        for layer in model.model.layers:
            layer.mlp.experts.forward = drelu_experts(layer.mlp.experts)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_mixtral(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_logits_and_routing_match_transformers(converted):
    hf, path = converted
    llm = hotcold.load(path, device="cpu")
    ids = random_ids(40)
    routes, handles = [], []
    for layer in hf.model.layers:
        handles.append(layer.mlp.gate.register_forward_hook(lambda m, a, out: routes.append(out[2])))
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    for h in handles:
        h.remove()
    scale = ref.abs().max()
    assert scale > 1.0, "test model too tame to be a meaningful comparison"
    assert (ours - ref).abs().max() <= 1e-4 * scale
    routing = llm.engine.seq.routing  # the sequence's own record of the last forward, per layer
    for i, theirs in enumerate(routes):  # the same experts for every token
        mine = routing[i]
        assert torch.equal(mine.sort(-1).values, theirs.sort(-1).values)
        assert len(torch.unique(mine)) == N_EXPERT  # every expert gets tokens: the test exercises them all


def test_family_runner(converted):
    hf, path = converted
    # the dense SiLU case's greedy run is covered by the logits test; transformers' MoE decode is slow
    run_family_checks(path, hf, greedy=hf.config.hidden_act != "silu")


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "llama"
    assert mf.metadata["llama.expert_count"] == N_EXPERT and mf.metadata["llama.expert_used_count"] == N_USED
    assert mf.tensors["blk.0.ffn_gate_exps.weight"].shape == (N_EXPERT, 1280, 64)
    assert mf.tensors["blk.0.ffn_down_exps.weight"].shape == (N_EXPERT, 64, 1280)
    assert mf.tensors["blk.0.ffn_gate_inp.weight"].shape == (N_EXPERT, 64)
    info = describe(str(path))
    assert info["architecture"] == "llama" and info["n_expert"] == N_EXPERT
    assert info["ffn_activation"] == hf.config.hidden_act
    drelu = mf.metadata.get("hotcold.ffn_kind") == "gated_both"
    assert drelu == ("drelu" in str(path))


@pytest.mark.parametrize("case", ["relu", "drelu"])
def test_sparse_all_firing_expert_predictors_equal_transformers(tmp_path, spm_model_file, case):
    hf = make_mixtral(tmp_path / "hf", spm_model_file, seed=1, **CASES[case])
    for e in range(N_EXPERT):
        write_predictors(tmp_path / "pred" / f"expert_{e}", 2, 64, 1280, all_fire=True, seed=e)
    (tmp_path / "pred" / "config.json").write_text(json.dumps({"sparse_threshold": 0.0}))
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    mf = ModelFile(path)
    assert mf.is_sparse and "blk.1.ffn_down_t.3.weight" in mf.tensors and "blk.1.fc2.3.weight" in mf.tensors
    llm = hotcold.load(path, device="cpu")
    assert not llm.loaded.dense
    ids = random_ids(40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    stats = llm.engine.seq.counts[0]
    assert stats.total == 40 * N_USED * 1280 and stats.computed == stats.total


def test_sparse_expert_predictors_skip_neurons(tmp_path, spm_model_file):
    """Random per-expert predictors: the sparse run equals the dense run of the same file with every routed
    expert's inactive neurons zeroed (masks recorded from the sparse run)."""
    make_mixtral(tmp_path / "hf", spm_model_file, seed=2)
    for e in range(N_EXPERT):
        write_predictors(tmp_path / "pred" / f"expert_{e}", 2, 64, 1280, seed=10 + e)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    sparse = hotcold.load(path, device="cpu")
    masks = {}
    for i, layer in enumerate(sparse.loaded.model.layers):
        for e, ffn in enumerate(layer.ffn.experts):

            def wrapped(p, key=(i, e), predictor=ffn.predictor):
                masks[key] = predictor(p)
                return masks[key]

            ffn.predictor = wrapped
    ids = random_ids(40, seed=5)
    ours = sparse.logits(ids)
    rate = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    assert 0.2 < rate < 0.8

    dense = hotcold.load(path, device="cpu", dense=True)
    for i, layer in enumerate(dense.loaded.model.layers):
        for e, ffn in enumerate(layer.ffn.experts):
            mask = masks[(i, e)]
            combine = ffn.weights.combine
            ffn.weights.combine = lambda up, gate, combine=combine, mask=mask: combine(up, gate) * mask
    ref = dense.logits(ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
