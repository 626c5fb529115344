"""Qwen2 / Qwen2.5 and Qwen3 against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp
writes arch qwen2 (q/k/v biases) and qwen3 (per-head q/k RMS norms, a head size of its own), both with q/k as
stored and NeoX RoPE; loaded by `hotcold.load` as llama layers whose description says so, decoded by the same
decoders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.gguf.io import ModelFile
from tests.fixtures import TOKENIZER_VOCAB, run_family_checks, save_checkpoint, scale_matrices

CASES = {
    "qwen2-gqa-untied": dict(model="qwen2", num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-gqa-tied-1e6": dict(
        model="qwen2", num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6
    ),
    # Qwen3: head_dim 32 with width 64 and 4 heads (q is 128 wide: the head size is its own)
    "qwen3-gqa-head32": dict(model="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "qwen3-mha-untied": dict(model="qwen3", num_key_value_heads=4, tie_word_embeddings=False),
}


def make_qwen(hf_dir: Path, spm_model: Path, *, model: str, seed: int = 0, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if model == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    )

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
    hf = model_cls(config_cls(**settings)).eval()
    scale_matrices(hf)
    with torch.no_grad():  # biases and q/k norms that matter (their init is small, or ones)
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    save_checkpoint(hf, hf_dir, spm_model)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_qwen(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    hf, path = converted
    run_family_checks(path, hf)


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    qwen3 = hf.config.model_type == "qwen3"
    assert mf.architecture == hf.config.model_type
    biases = {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"}
    norms = {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"}
    assert (norms <= set(mf.tensors)) == qwen3 and (biases <= set(mf.tensors)) == (not qwen3)
    assert "blk.0.attn_output.bias" not in mf.tensors
    q = hf.model.layers[0].self_attn.q_proj.weight.detach()  # as stored (NeoX RoPE needs no permutation)
    assert torch.equal(mf.tensor("blk.0.attn_q.weight").float(), q)
    assert ("output.weight" in mf.tensors) == (not hf.config.tie_word_embeddings)
    layer = hotcold.load(path, device="cpu").loaded.model.layers[0]
    assert layer.spec.rope_neox and layer.spec.attn_bias == (not qwen3) and layer.spec.qk_norm == qwen3


@pytest.mark.parametrize(
    "case, attention",
    [("qwen3-gqa-head32", False), ("qwen3-gqa-head32", True), ("qwen2-gqa-untied", True)],
)
def test_sparsify_reaches_qwen_files(tmp_path, spm_model_file, case, attention):
    """`hotcold sparsify` on a Qwen3 (q/k norms) and a Qwen2 (biases) file, with input-sparse attention too: it
    skips FFN neurons, and the one-call decoder (its input-sparse head adds the biases and norms each head of q
    and k) gives the eager decoder's tokens."""
    from tests.fixtures import check_sparsify_reaches

    make_qwen(tmp_path / "hf", spm_model_file, **CASES[case])
    dense = convert(tmp_path / "hf", None, tmp_path / "m.f16.gguf", outtype="f16")
    check_sparsify_reaches(dense, tmp_path, attention=attention, decoder="cpu_one_call")
