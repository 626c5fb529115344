"""Qwen2 / Qwen2.5 against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes
arch qwen2 (q/k/v biases, q/k as stored, NeoX RoPE), loaded by `hotcold.load` as a llama layer whose description
says so, and decoded by the same decoders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.gguf_io import ModelFile
from tests.fixtures import TOKENIZER_VOCAB, run_family_checks, save_checkpoint, scale_matrices

CASES = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "gqa-tied-1e6": dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6),
}


def make_qwen2(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**settings)).eval()
    scale_matrices(model)
    with torch.no_grad():  # biases that matter (their init is small)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
    save_checkpoint(model, hf_dir, spm_model)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_qwen2(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    hf, path = converted
    run_family_checks(path, hf)


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "qwen2"
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(mf.tensors)
    assert "blk.0.attn_output.bias" not in mf.tensors
    # q as stored (NeoX RoPE needs no permutation)
    q = hf.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(mf.tensor("blk.0.attn_q.weight").float(), q)
    assert ("output.weight" in mf.tensors) == (not hf.config.tie_word_embeddings)
    layer = hotcold.load(path, device="cpu").loaded.model.layers[0]
    assert layer.spec.rope_neox and layer.spec.attn_bias
