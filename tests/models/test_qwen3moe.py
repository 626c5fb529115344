"""Qwen3-MoE against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes arch
qwen3moe (Qwen3's attention with per-head q/k norms; router and stacked experts; the experts' width as
expert_feed_forward_length), loaded by `hotcold.load` as Qwen3 attention with a softmax top-k MoE FFN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.convert.checkpoint import ConvertError
from hotcold.gguf.io import ModelFile
from tests.fixtures import (
    TOKENIZER_VOCAB,
    hf_logits,
    random_ids,
    run_family_checks,
    save_checkpoint,
    scale_matrices,
)

N_EXPERT = 8


def make_qwen3moe(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=512,  # the dense FFN width the config carries (unused: every layer is MoE)
        moe_intermediate_size=256,
        num_experts=N_EXPERT,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # Qwen3's head size of its own
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings)).eval()
    scale_matrices(hf)
    with torch.no_grad():  # q/k norms that matter, and a router that spreads tokens over every expert
        for name, p in hf.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.add_(0.5 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    save_checkpoint(hf, hf_dir, spm_model)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf = make_qwen3moe(folder / "hf", spm_model_file)
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "qwen3moe"
    assert mf.metadata["qwen3moe.expert_count"] == N_EXPERT
    assert mf.metadata["qwen3moe.expert_used_count"] == 2
    assert mf.metadata["qwen3moe.expert_feed_forward_length"] == 256
    assert mf.metadata["qwen3moe.feed_forward_length"] == 512
    assert mf.metadata["qwen3moe.attention.key_length"] == 32
    assert tuple(mf.tensors["blk.0.ffn_gate_inp.weight"].shape) == (N_EXPERT, 64)
    assert tuple(mf.tensors["blk.0.ffn_gate_exps.weight"].shape) == (N_EXPERT, 256, 64)
    assert tuple(mf.tensors["blk.0.ffn_up_exps.weight"].shape) == (N_EXPERT, 256, 64)
    assert tuple(mf.tensors["blk.0.ffn_down_exps.weight"].shape) == (N_EXPERT, 64, 256)
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(mf.tensors)
    assert "blk.0.ffn_gate.weight" not in mf.tensors
    experts = hf.model.layers[1].mlp.experts
    e3 = mf.tensor("blk.1.ffn_down_exps.weight")[3]
    reference = experts.down_proj[3] if hasattr(experts, "down_proj") else experts[3].down_proj.weight
    assert torch.equal(e3, reference.detach())


def test_logits_and_routing_match_transformers(converted):
    hf, path = converted
    llm = hotcold.load(path, device="cpu")
    ids = random_ids(40)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    scale = ref.abs().max()
    assert scale > 1.0, "test model too tame to be a meaningful comparison"
    assert (ours - ref).abs().max() <= 1e-4 * scale
    for i in range(len(hf.model.layers)):  # every expert gets tokens: the test exercises them all
        assert len(torch.unique(llm.engine.seq.routing[i])) == N_EXPERT


def test_family_runner(converted):
    hf, path = converted
    # transformers' MoE decode is slow: greedy decode is compared through the logits test
    run_family_checks(path, hf, greedy=False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob false"),
        ({"mlp_only_layers": [1]}, "dense layers among the experts"),
        ({"num_experts_per_tok": 9}, "need 1 <= per_tok <= experts"),
    ],
)
def test_unsupported_routing_is_refused_by_name(converted, tmp_path, change, message):
    import shutil

    _, path = converted
    shutil.copytree(Path(path).parent / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConvertError, match=message):
        convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")
