"""Phi-3 / Phi-4-mini against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes
arch phi3 (fused attn_qkv, fused ffn_up = [gate; up], NeoX RoPE over `partial_rotary_factor` of a head), loaded
as llama layers (the fused matrices split by rows at load), decoded by the same decoders."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.convert import convert
from hotcold.gguf.io import ModelFile
from tests.fixtures import TOKENIZER_VOCAB, random_ids, run_family_checks, save_checkpoint, scale_matrices

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


LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
    original_max_position_embeddings=64,
)  # Phi-3.5-mini / Phi-4-mini's scaling, scaled down: factors for 8 rotated pairs, a 64-token original context


@pytest.fixture(scope="module")
def longrope(tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp("longrope")
    hf = make_phi3(
        folder / "hf", spm_model_file, num_key_value_heads=2, original_max_position_embeddings=64,
        rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=1.0, **LONGROPE),
    )  # fmt: skip
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_longrope_file_layout_follows_upstream(longrope):
    _, path = longrope
    mf = ModelFile(path)
    assert mf.metadata["phi3.rope.scaling.original_context_length"] == 64
    # upstream: sqrt(1 + ln(256 / 64) / ln(64))
    assert mf.metadata["phi3.rope.scaling.attn_factor"] == pytest.approx(
        (1 + math.log(4) / math.log(64)) ** 0.5
    )
    for name in ("long", "short"):  # float32, as upstream writes them
        stored = mf.tensor(f"rope_factors_{name}.weight")
        assert stored.dtype == torch.float32
        assert torch.equal(stored, torch.tensor(LONGROPE[f"{name}_factor"], dtype=torch.float32))


@pytest.mark.parametrize("ctx, n_tokens", [(64, 40), (256, 100)])
def test_longrope_matches_transformers(longrope, ctx, n_tokens):
    """Within the original context the short factors rotate (transformers: for any sequence up to it); loaded
    for a longer context, the long ones (transformers: for a sequence past it), as llama.cpp picks them."""
    hf, path = longrope
    llm = hotcold.load(path, device="cpu", ctx_size=ctx)
    ids = random_ids(n_tokens, seed=ctx)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    got = llm.logits(ids)
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    # and the two factor sets differ enough that the wrong one would fail
    other = hotcold.load(path, device="cpu", ctx_size=256 if ctx == 64 else 64).logits(ids[:40])
    assert (other - expected[:40]).abs().max().item() > 1e-2 * expected.abs().max().item()


def test_longrope_f16_decoders_agree(longrope):
    from hotcold.convert.quantize import quantize_file
    from tests.fixtures import check_decoder_equals_eager

    _, path = longrope
    f16 = Path(path).with_suffix(".f16.gguf")
    quantize_file(path, f16, "f16")
    fast = hotcold.load(f16, device="cpu", ctx_size=256)
    assert fast.decoder == "cpu_one_call", fast.loaded.notes
    check_decoder_equals_eager(fast, hotcold.load(f16, device="cpu", ctx_size=256, decoder="eager"))


def test_longrope_with_wrong_factor_counts_is_refused(longrope, tmp_path):
    import json
    import shutil

    from hotcold.convert.checkpoint import ConvertError

    _, path = longrope
    shutil.copytree(Path(path).parent / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["short_factor"] = [
        1.0
    ] * 3  # transformers refuses this too; an edited file has it
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="long_factor and short_factor of 8 values each"):
        convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")


@pytest.mark.parametrize("attention", [False, True])
def test_sparsify_reaches_phi3_files(tmp_path, spm_model_file, attention):
    """`hotcold sparsify` on a Phi-4-mini-like file (fused attn_qkv and [gate; up] ffn_up, read as separate row
    views): it skips about half the FFN neurons, the output holds the separate tensors, the decoder load chooses
    gives the eager decoder's tokens, and at sparsity 0 the logits are the dense file's."""
    from tests.fixtures import check_sparsify_reaches

    make_phi3(tmp_path / "hf", spm_model_file, **CASES["phi4mini-gqa-partial-tied"])
    dense = convert(tmp_path / "hf", None, tmp_path / "m.f16.gguf", outtype="f16")
    # input-sparse attention too (no biases): still the one-call decoder
    out = check_sparsify_reaches(dense, tmp_path, attention=attention, decoder="cpu_one_call")
    written = ModelFile(out)
    assert {"blk.0.ffn_gate.weight", "blk.0.attn_q.weight"} <= set(written.tensors)
    assert "blk.0.attn_qkv.weight" not in written.tensors
    assert tuple(written.tensors["blk.0.ffn_up.weight"].shape) == (1280, 64)
