"""Falcon family against Hugging Face transformers: converted by `hotcold convert`, loaded by `hotcold.load`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.cli.info import describe
from hotcold.convert import convert
from hotcold.convert.falcon import jploski
from hotcold.gguf.io import ModelFile
from tests.fixtures import (
    TOKENIZER_VOCAB,
    hf_logits,
    random_ids,
    record_masks,
    run_family_checks,
    save_checkpoint,
    write_predictors,
)

# hidden 64 with ffn_hidden_size 1280 (PowerInfer's kernels want n_ff > 1000, a multiple of 256); the file stores
# the real ffn_hidden_size as feed_forward_length.
CASES = {
    "7b-multi-query": dict(new_decoder_architecture=False, multi_query=True),
    "40b-grouped-kv": dict(new_decoder_architecture=True, num_kv_heads=2),
    "mha-untied": dict(new_decoder_architecture=False, multi_query=False, tie_word_embeddings=False),
    "gelu-dense": dict(new_decoder_architecture=True, num_kv_heads=1, activation="gelu"),
}


def make_falcon(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import FalconConfig, FalconForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        ffn_hidden_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        activation="relu",
        bias=False,
        alibi=False,
        parallel_attn=True,
        layer_norm_epsilon=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = FalconForCausalLM(FalconConfig(**settings)).eval()
    with torch.no_grad():  # random init is too tame: make logits and activations non-trivial
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(2.0)
            elif "ln" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))  # non-trivial LayerNorm weights and biases
    save_checkpoint(model, hf_dir, spm_model)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_falcon(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    hf, path = converted
    run_family_checks(path, hf)


def test_info_reports_falcon(converted):
    hf, path = converted
    info = describe(str(path))
    cfg = hf.config
    expected_kv = cfg.num_kv_heads if cfg.new_decoder_architecture else (1 if cfg.multi_query else 4)
    assert info["architecture"] == "falcon"
    assert (info["n_layer"], info["n_embd"], info["n_ff"]) == (2, 64, 1280)
    assert (info["n_head"], info["n_head_kv"]) == (4, expected_kv)
    assert info["ffn_activation"] == cfg.activation
    assert info["format"] == "GGUF (dense)" and info["predictors"] is None


def test_jploski_layout_groups_q_then_k_then_v():
    # 4 query heads sharing 2 KV heads, head_dim 1: HF rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    rows = torch.arange(8.0)[:, None]
    assert jploski(rows, 4, 2).flatten().tolist() == [0, 1, 4, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("case", ["7b-multi-query", "40b-grouped-kv"])
def test_sparse_all_firing_equals_transformers(tmp_path, spm_model_file, case):
    hf = make_falcon(tmp_path / "hf", spm_model_file, **CASES[case])
    write_predictors(tmp_path / "pred", 2, 64, 1280, all_fire=True)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    assert path.read_bytes()[:4] == b"PWRI"
    llm = hotcold.load(path, device="cpu")
    assert not llm.loaded.dense
    ids = random_ids(40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    info = describe(str(path))
    assert info["predictors"] == {"layers": 2, "ranks": [16]} and info["ffn_activation"] == "relu"


def test_sparse_predictor_sees_the_layer_input(tmp_path, spm_model_file):
    """A random predictor: it is fed the layer input (before any norm), and the sparse run equals transformers
    with the inactive neurons' activations zeroed (masks agree except within 1e-4 of the threshold, where
    rounding may flip a neuron; the reference then uses our masks so a flip cannot fail the comparison)."""
    hf = make_falcon(tmp_path / "hf", spm_model_file, **CASES["40b-grouped-kv"])
    write_predictors(tmp_path / "pred", 2, 64, 1280, seed=5)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    llm = hotcold.load(path, device="cpu")
    records = record_masks(llm)
    ids = random_ids(40, seed=4)
    ours = llm.logits(ids)

    preds = [torch.load(tmp_path / "pred" / f"model_{i}.pt") for i in range(2)]
    handles = []
    for layer, pred, record in zip(hf.transformer.h, preds, records):

        def check_input(module, args, kwargs, pred=pred, record=record):
            p = (args[0] if args else kwargs["hidden_states"]).reshape(-1, 64)  # [T, D] layer input
            assert torch.allclose(record["input"], p, atol=1e-5 * p.abs().max())
            logits = torch.relu(p @ pred["fc1.weight"].T) @ pred["fc2.weight"].T
            agree = (logits >= 0) == record["mask"]
            assert agree.all() or logits[~agree].abs().max() < 1e-4
            assert 0.2 < record["mask"].float().mean() < 0.8

        def masked(module, args, out, record=record):
            return out * record["mask"]

        handles.append(layer.register_forward_pre_hook(check_input, with_kwargs=True))
        handles.append(layer.mlp.act.register_forward_hook(masked))
    ref = hf_logits(hf, ids)
    for h in handles:
        h.remove()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_hybrid_placement_equals_cpu_sparse(tmp_path, spm_model_file):
    """Hot rows on a second device (the CPU standing in for the GPU), attention and head placed there too."""
    from hotcold.config import config_from_file
    from hotcold.loader import load_model
    from hotcold.placement.budget import scratch_bytes

    make_falcon(tmp_path / "hf", spm_model_file, **CASES["40b-grouped-kv"])
    write_predictors(tmp_path / "pred", 2, 64, 1280, seed=5)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "m.powerinfer.gguf", outtype="f32")
    (tmp_path / "activation").mkdir()
    for i in range(2):
        torch.save(torch.randint(0, 1000, (1280,)), tmp_path / "activation" / f"activation_{i}.pt")
    mf = ModelFile(path)
    dense_bytes = sum(
        e.n_bytes for e in mf.tensors.values() if "ffn_up" not in e.name and "ffn_down" not in e.name
    )
    budget = (scratch_bytes(config_from_file(mf)) + dense_bytes + 700_000) / 2**30
    ids = random_ids(40, seed=6)
    ref = hotcold.load(path, device="cpu").logits(ids)
    loaded = load_model(path, device="cpu", fast_device="cpu", vram_budget=budget)
    assert all(loaded.plan.layer_on_gpu) and 0 < sum(len(h) for h in loaded.hot) < 2 * 1280
    got = hotcold.Model(loaded).logits(ids)
    assert torch.allclose(got, ref, atol=1e-5 * ref.abs().max(), rtol=0)


def test_alibi_falcon_is_refused(tmp_path, spm_model_file):
    from hotcold.convert.checkpoint import ConvertError

    make_falcon(tmp_path / "hf", spm_model_file, alibi=True)
    with pytest.raises(ConvertError, match="alibi"):
        convert(tmp_path / "hf", None, tmp_path / "x.gguf", outtype="f32")
    assert not (tmp_path / "x.gguf").exists()
