"""Phi-3 / Phi-4-mini against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes
arch phi3 (fused attn_qkv, fused ffn_up = [gate; up], NeoX RoPE over `partial_rotary_factor` of a head), loaded
as llama layers (the fused matrices split by rows at load), decoded by the same decoders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.gguf_io import ModelFile
from tests.fixtures import TOKENIZER_VOCAB, run_family_checks, save_checkpoint, scale_matrices

CASES = {
    "phi3-mha-full-rotary": dict(num_key_value_heads=4, partial_rotary_factor=1.0),
    "phi4mini-gqa-partial-tied": dict(
        num_key_value_heads=2, partial_rotary_factor=0.5, tie_word_embeddings=True
    ),
}


def make_phi3(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import Phi3Config, Phi3ForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    hf = Phi3ForCausalLM(Phi3Config(**settings)).eval()
    scale_matrices(hf)
    save_checkpoint(hf, hf_dir, spm_model)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_phi3(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    hf, path = converted
    run_family_checks(path, hf)


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "phi3"
    assert tuple(mf.tensors["blk.0.attn_qkv.weight"].shape) == (
        64 + 2 * 16 * hf.config.num_key_value_heads,
        64,
    )
    assert (
        tuple(mf.tensors["blk.0.ffn_up.weight"].shape) == (2 * 1280, 64)
        and "blk.0.ffn_gate.weight" not in mf.tensors
    )
    assert mf.metadata["phi3.rope.dimension_count"] == int(16 * hf.config.partial_rotary_factor)
    layer = hotcold.load(path, device="cpu").loaded.model.layers[0]
    assert (
        layer.spec.rope_neox and layer.qkv.c_group is None
    )  # float32: torch multiplies (one group of three)
    assert len(layer.qkv.weights) == 3


def test_long_context_variants_are_refused_by_name(tmp_path, spm_model_file):
    from hotcold.convert.checkpoint import ConvertError

    scaling = dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                   original_max_position_embeddings=128)  # fmt: skip
    make_phi3(tmp_path / "hf", spm_model_file, rope_parameters=dict(rope_theta=10000.0, **scaling))
    with pytest.raises(ConvertError, match="longrope"):
        convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")


def test_sparsify_refuses_the_fused_gate_by_name(converted, tmp_path):
    from hotcold.convert.sparsify import sparsify_file

    _, path = converted
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text " * 50)
    with pytest.raises(ValueError, match="fuses into ffn_up"):
        sparsify_file(path, tmp_path / "o.gguf", corpus, sparsity=0.5)
