"""The LLaMA family's variants against Hugging Face transformers: Mistral (ReLU, sliding window), TurboSparse-Mistral
(dReLU, flagged in config.json), Bamboo (relu on gate and up, arch `bamboo`) and ProSparse (llama layout, threshold
from the predictor folder's config.json)."""

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
    make_llama,
    random_ids,
    record_masks,
    run_family_checks,
    save_checkpoint,
    scale_matrices,
    write_predictors,
)


def use_drelu(model) -> None:
    """transformers' LLaMA/Mistral MLP with relu on both branches: down(relu(gate x) * relu(up x))."""
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, m=mlp: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x)))


def edit_config(hf_dir: Path, **changes) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


def make_mistral(hf_dir: Path, spm_model: Path, *, seed: int = 0, drelu: bool = False, **overrides):
    from transformers import MistralConfig, MistralForCausalLM

    settings = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=1280,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        hidden_act="relu",
        rms_norm_eps=1e-5,
        sliding_window=8,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(**settings)).eval()
    scale_matrices(model)
    save_checkpoint(model, hf_dir, spm_model)
    if drelu:  # TurboSparse: config.json says relu, custom code does dReLU; the flag tells the converter
        edit_config(hf_dir, hotcold_ffn_kind="gated_both")
        use_drelu(model)
    return model


def make_bamboo(hf_dir: Path, spm_model: Path, *, seed: int = 0):
    model = make_llama(hf_dir, spm_model, seed=seed, num_key_value_heads=2)
    edit_config(hf_dir, model_type="bamboo")
    use_drelu(model)
    return model


CASES = {
    "mistral-relu-window8": lambda d, spm: make_mistral(d, spm),
    "mistral-silu-dense": lambda d, spm: make_mistral(d, spm, hidden_act="silu", sliding_window=None),
    "turbosparse-mistral-drelu": lambda d, spm: make_mistral(d, spm, drelu=True),
    "bamboo": lambda d, spm: make_bamboo(d, spm),
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = CASES[request.param](folder / "hf", spm_model_file)
    return request.param, hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    case, hf, path = converted
    # the dense SiLU case's greedy run is covered by the SiLU LLaMA cases of test_llama.py
    run_family_checks(path, hf, greedy=case != "mistral-silu-dense")


def test_file_keys(converted):
    case, hf, path = converted
    meta = ModelFile(path).metadata
    arch = "bamboo" if case == "bamboo" else "llama"
    info = describe(str(path))
    assert info["architecture"] == arch and info["n_head_kv"] == 2
    assert meta.get("hotcold.ffn_kind") == ("gated_both" if case.startswith("turbosparse") else None)
    assert meta.get(f"{arch}.attention.sliding_window") == getattr(hf.config, "sliding_window", None)
    assert info["ffn_activation"] == ("silu" if "silu" in case else "relu")


@pytest.mark.parametrize("case", ["turbosparse-mistral-drelu", "bamboo"])
def test_sparse_all_firing_equals_transformers(tmp_path, spm_model_file, case):
    hf = CASES[case](tmp_path / "hf", spm_model_file)
    write_predictors(tmp_path / "pred", 2, 64, 1280, all_fire=True)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    llm = hotcold.load(path, device="cpu")
    assert not llm.loaded.dense
    ids = random_ids(40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_prosparse_threshold_from_predictor_config(tmp_path, spm_model_file, monkeypatch):
    """ProSparse = llama layout + the predictor folder's sparse_threshold: neuron i fires iff its predictor logit
    >= 0.25. The sparse run equals transformers with the inactive neurons' activations zeroed (masks agree with
    ones computed from transformers' residual except within 1e-4 of the threshold; the reference uses ours)."""
    for var in ("HOTCOLD_SPARSE_THRESHOLD", "LLAMA_SPARSE_PRED_THRESHOLD"):
        monkeypatch.delenv(var, raising=False)
    hf = make_llama(tmp_path / "hf", spm_model_file, num_key_value_heads=2)
    edit_config(tmp_path / "hf", hidden_act="fatrelu")  # ProSparse's config; it runs as relu + threshold
    write_predictors(tmp_path / "pred", 2, 64, 1280, seed=3, threshold=0.25)
    for i in range(2):  # LLaMA's residual is small at init: scale fc1 so logits spread around the threshold
        state = torch.load(tmp_path / "pred" / f"model_{i}.pt")
        torch.save(
            {"fc1.weight": 20 * state["fc1.weight"], "fc2.weight": state["fc2.weight"]},
            tmp_path / "pred" / f"model_{i}.pt",
        )
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    assert ModelFile(path).metadata["powerinfer.sparse_threshold"] == pytest.approx(0.25)
    llm = hotcold.load(path, device="cpu")
    assert (
        llm.config.sparse_threshold == pytest.approx(0.25) and describe(str(path))["sparse_threshold"] == 0.25
    )
    records = record_masks(llm)
    ids = random_ids(40, seed=4)
    ours = llm.logits(ids)

    preds = [torch.load(tmp_path / "pred" / f"model_{i}.pt") for i in range(2)]
    handles = []
    for layer, pred, record in zip(hf.model.layers, preds, records):

        def check_input(module, args, pred=pred, record=record):
            p = args[0].reshape(-1, 64)  # [T, D]: the residual after attention, before the FFN norm
            assert torch.allclose(record["input"], p, atol=1e-5 * p.abs().max())
            logits = torch.relu(p @ pred["fc1.weight"].T) @ pred["fc2.weight"].T
            agree = (logits >= 0.25) == record["mask"]
            assert agree.all() or (logits[~agree] - 0.25).abs().max() < 1e-4
            assert 0.1 < record["mask"].float().mean() < 0.7

        def masked(module, args, out, record=record):
            return out * record["mask"]

        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(check_input))
        handles.append(layer.mlp.act_fn.register_forward_hook(masked))
    ref = hf_logits(hf, ids)
    for h in handles:
        h.remove()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
