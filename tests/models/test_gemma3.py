"""Gemma 3 (text) against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes arch
gemma3 (norms stored as 1 + w, sandwich norms, per-head q/k norms, NeoX RoPE, tied output), loaded as llama layers
whose description says so: embeddings times sqrt(width), GELU-tanh gated FFN, every sixth layer global and the
others in a sliding window with RoPE base 10000."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.gguf.io import ModelFile
from tests.fixtures import TOKENIZER_VOCAB, run_family_checks, save_checkpoint, scale_matrices

CASES = {
    # 7 layers: local, local, local, local, local, global, local; a window of 8 over 40-token checks
    "gqa-window8": dict(num_hidden_layers=7, num_key_value_heads=2, sliding_window=8),
    "mha-linear-scaling": dict(
        num_hidden_layers=6,
        num_key_value_heads=4,
        sliding_window=16,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", rope_theta=1e6, factor=4.0),
        ),
    ),  # fmt: skip
}


def make_gemma3(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return make_gemma(Gemma3ForCausalLM, Gemma3TextConfig, hf_dir, spm_model, seed=seed, **overrides)


def make_gemma(model_class, config_class, hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    """A tiny random Gemma (2 or 3) of `model_class`, its norms off their zero start, saved to hf_dir."""
    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_attention_heads=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    hf = model_class(config_class(**settings)).eval()
    scale_matrices(hf)
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1 + w): make them matter
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    save_checkpoint(hf, hf_dir, spm_model)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_gemma3(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    """Logits and greedy tokens against transformers; the one-call decoder (sandwich norms, local and global RoPE
    tables, GELU-tanh in C) equal to the eager one on the F16 copy."""
    hf, path = converted
    run_family_checks(path, hf)


def test_a_qk_scale_of_its_own_in_the_one_call_decoder(converted):
    """Gemma 3 27B scales q.k by 1 / sqrt(width / heads), not 1 / sqrt(head_dim) (upstream derives it from its 62
    layers, so a tiny file cannot carry it): with that scale in every layer's description the one-call decoder
    (q times the scale in C after its norms) gives the eager layers' bits, and the scale changes the logits."""
    from dataclasses import replace

    from tests.fixtures import decode_logits, random_ids

    hf, path = converted
    f16 = Path(path).with_suffix(".decoder-f16.gguf")  # run_family_checks' F16 copy
    if not f16.exists():
        from hotcold.convert.quantize import quantize_file

        quantize_file(path, f16, "f16")
    fast, eager = hotcold.load(f16, device="cpu"), hotcold.load(f16, device="cpu", decoder="eager")
    ids = random_ids(16, seed=4)
    plain = decode_logits(eager, ids, 6)
    for llm in (fast, eager):
        for layer in llm.loaded.model.layers:
            object.__setattr__(layer, "spec", replace(layer.spec, attn_scale=1 / math.sqrt(24.0)))
    got, want = decode_logits(fast, ids, 6), decode_logits(eager, ids, 6)
    assert fast.decoder == "cpu_one_call" and fast.loaded.model.cpu_decode.steps == len(ids) - 6
    assert torch.equal(got, want)
    assert (want - plain).abs().max() > 1e-3


def test_file_layout_follows_upstream(converted):
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "gemma3" and "output.weight" not in mf.tensors
    assert {
        "blk.0.post_attention_norm.weight",
        "blk.0.post_ffw_norm.weight",
        "blk.0.attn_q_norm.weight",
    } <= set(mf.tensors)
    w = hf.model.layers[0].input_layernorm.weight.detach()
    assert torch.equal(mf.tensor("blk.0.attn_norm.weight").float(), w + 1)  # Gemma's 1 + w, stored
    layers = hotcold.load(path, device="cpu").loaded.model.layers
    assert [layer.spec.local_rope for layer in layers] == [(i + 1) % 6 != 0 for i in range(len(layers))]
    assert all(
        layer.spec.sliding_window == (hf.config.sliding_window if layer.spec.local_rope else 0)
        for layer in layers
    )


def test_sparsify_reaches_gemma3_files(tmp_path, spm_model_file):
    """`hotcold sparsify` on a GeGLU file (the score |gelu_tanh(gate)|, sandwich norms around the sparse FFN and
    the input-sparse attention): about half the FFN neurons skipped, at sparsity 0 (every neuron, every input
    channel) the logits are the dense file's, and the one-call decoder (the C thresholded step with GELU-tanh, the
    sandwich norms around it) gives the eager decoder's tokens."""
    from tests.fixtures import check_sparsify_reaches

    make_gemma3(tmp_path / "hf", spm_model_file, **CASES["gqa-window8"])
    dense = convert(tmp_path / "hf", None, tmp_path / "m.f16.gguf", outtype="f16")
    check_sparsify_reaches(dense, tmp_path, attention=True, decoder="cpu_one_call", max_tokens=600)
