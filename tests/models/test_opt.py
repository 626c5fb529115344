"""OPT against Hugging Face transformers: converted by `hotcold convert`, loaded by `hotcold.load`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hotcold
from hotcold.cli.info import describe
from hotcold.convert import convert
from hotcold.convert.checkpoint import ConvertError
from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file
from tests.fixtures import (
    TOKENIZER_VOCAB,
    hf_logits,
    random_ids,
    record_masks,
    run_family_checks,
    save_checkpoint,
    write_predictors,
)


def make_opt(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import OPTConfig, OPTForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        word_embed_proj_dim=64,
        ffn_dim=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        activation_function="relu",
        do_layer_norm_before=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = OPTForCausalLM(OPTConfig(**settings)).eval()
    with torch.no_grad():  # random init is too tame (and has zero biases): make every term matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    save_checkpoint(model, hf_dir, spm_model)
    return model


@pytest.fixture(scope="module")
def dense(tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp("opt")
    hf = make_opt(folder / "hf", spm_model_file)
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(dense):
    hf, path = dense
    run_family_checks(path, hf)


def test_info_reports_opt(dense):
    _, path = dense
    info = describe(str(path))
    assert info["architecture"] == "opt" and info["ffn_activation"] == "relu"
    assert (info["n_layer"], info["n_embd"], info["n_ff"], info["n_head"], info["n_head_kv"]) == (
        2,
        64,
        1280,
        4,
        4,
    )
    assert info["context_length"] == 256
    mf = ModelFile(path)
    assert mf.metadata["opt.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert "output.weight" not in mf.tensors  # tied to token_embd
    assert mf.tensors["position_embd.weight"].shape == (258, 64)  # the two offset rows included


def test_powerinfer_style_file_without_eps_defaults_to_1e5(dense, tmp_path):
    """PowerInfer's converter stores no LayerNorm eps and context_length 2050: we default eps to HF's 1e-5."""
    hf, path = dense
    mf = ModelFile(path)
    meta = [m for m in metadata_items(mf) if m[0] != "opt.attention.layer_norm_epsilon"]
    specs = [TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data) for e in mf.tensors.values()]
    stripped = write_model_file(tmp_path / "no-eps.gguf", "opt", meta, specs)
    llm = hotcold.load(stripped, device="cpu")
    assert llm.config.norm_eps == pytest.approx(1e-5)
    ids = random_ids(40, seed=2)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_sparse_all_firing_equals_transformers(tmp_path, spm_model_file):
    hf = make_opt(tmp_path / "hf", spm_model_file, seed=1)
    write_predictors(tmp_path / "pred", 2, 64, 1280, all_fire=True)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    mf = ModelFile(path)
    assert mf.is_sparse and "blk.0.ffn_down_t.bias" in mf.tensors and "blk.0.ffn_down.bias" not in mf.tensors
    llm = hotcold.load(path, device="cpu")
    assert not llm.loaded.dense
    ids = random_ids(40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_sparse_random_predictor_equals_masked_reference(tmp_path, spm_model_file):
    """Inactive neurons contribute exactly 0, although relu(b_up) > 0 for many of them: the reference is
    transformers with the activations of inactive neurons zeroed after fc1 + bias + relu. The predictor is fed
    the residual after attention; masks agree with one computed from transformers' residual except within
    1e-4 of the threshold (the reference then uses our masks, so a rounding flip cannot fail the comparison)."""
    hf = make_opt(tmp_path / "hf", spm_model_file, seed=2)
    write_predictors(tmp_path / "pred", 2, 64, 1280, seed=7)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    llm = hotcold.load(path, device="cpu")
    records = record_masks(llm)
    ids = random_ids(40, seed=4)
    ours = llm.logits(ids)

    preds = [torch.load(tmp_path / "pred" / f"model_{i}.pt") for i in range(2)]
    handles, leaked = [], []
    for layer, pred, record in zip(hf.model.decoder.layers, preds, records):

        def check_input(module, args, pred=pred, record=record):
            p = args[0].reshape(-1, 64)  # [T, D]: the residual after attention, before final_layer_norm
            assert torch.allclose(record["input"], p, atol=1e-5 * p.abs().max())
            logits = torch.relu(p @ pred["fc1.weight"].T) @ pred["fc2.weight"].T
            agree = (logits >= 0) == record["mask"]
            assert agree.all() or logits[~agree].abs().max() < 1e-4
            assert 0.2 < record["mask"].float().mean() < 0.8

        def masked(module, args, out, record=record):
            leaked.append(float((out * ~record["mask"]).abs().sum()))
            return out * record["mask"]

        handles.append(layer.final_layer_norm.register_forward_pre_hook(check_input))
        handles.append(layer.activation_fn.register_forward_hook(masked))
    ref = hf_logits(hf, ids)
    for h in handles:
        h.remove()
    assert min(leaked) > 1.0, (
        "inactive neurons should have nonzero relu(up + b) for this test to mean anything"
    )
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_unsupported_opt_variants_are_refused(tmp_path, spm_model_file):
    make_opt(tmp_path / "hf", spm_model_file, do_layer_norm_before=False)
    with pytest.raises(ConvertError, match="do_layer_norm_before"):
        convert(tmp_path / "hf", None, tmp_path / "x.gguf", outtype="f32")
    assert not (tmp_path / "x.gguf").exists()


def test_hybrid_placement_equals_cpu_sparse(tmp_path, spm_model_file):
    """Hot rows on a second device (the CPU standing in for the GPU), attention and head placed there too."""
    from hotcold.config import config_from_file
    from hotcold.loader import load_model
    from hotcold.placement.budget import scratch_bytes

    make_opt(tmp_path / "hf", spm_model_file, seed=3)
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
