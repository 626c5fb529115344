"""LLaMA family against Hugging Face transformers: converted by `hotcold convert`, loaded by `hotcold.load`."""

from __future__ import annotations

import pytest
import torch

import hotcold
from hotcold.convert import convert
from tests.fixtures import hf_logits, make_llama, run_family_checks, write_predictors

CASES = {
    "relu-mha-1e4": dict(hidden_act="relu"),
    "silu-gqa-1e6": dict(hidden_act="silu", num_key_value_heads=2, rope_theta=1e6),
    "relu-gqa-1e6": dict(hidden_act="relu", num_key_value_heads=1, rope_theta=1e6),
    "silu-mha-linear-scaling": dict(hidden_act="silu", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Llama 3.1's RoPE scaling: per-dimension factors, written as rope_freqs.weight (an original context of 32
    # puts this head size's wavelengths below, inside and above the blended band)
    "silu-gqa-llama3-scaling": dict(
        hidden_act="silu",
        num_key_value_heads=2,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_llama(folder / "hf", spm_model_file, **CASES[request.param])
    out = convert(folder / "hf", None, folder / "model.gguf", outtype="f32")
    return hf, out


def test_family_runner(converted):
    hf, path = converted
    run_family_checks(path, hf)


def test_sparse_file_with_all_firing_predictors_equals_transformers(tmp_path, spm_model_file):
    hf = make_llama(tmp_path / "hf", spm_model_file, hidden_act="relu")
    write_predictors(tmp_path / "pred", 2, 64, 1280, all_fire=True)
    path = convert(tmp_path / "hf", tmp_path / "pred", tmp_path / "sparse.gguf", outtype="f32")
    assert path.read_bytes()[:4] == b"PWRI"
    llm = hotcold.load(path, device="cpu")
    assert not llm.loaded.dense
    ids = list(range(5, 45))
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_sparse_prefill_batch_equals_token_by_token(tiny_sparse_gguf):
    llm = hotcold.load(tiny_sparse_gguf, device="cpu")
    ids = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    full = llm.logits(ids)
    engine = llm.engine
    engine.cached_ids = []
    steps = [engine.prefill(ids[:1])]
    for pos in range(1, 20):
        steps.append(engine.forward([ids[pos]], pos, last_only=True)[-1])
    assert torch.allclose(torch.stack(steps), full, atol=1e-4 * full.abs().max())
    computed, total = llm.engine.seq.neuron_totals()
    rate = computed / total
    assert 0.05 < rate < 0.95  # the predictors really skip neurons


def test_llama3_rope_factors_are_upstreams(tmp_path, spm_model_file):
    """The converter writes rope_freqs.weight as upstream llama.cpp's does (1 below the band, `factor` above, the
    blend between; every kind present here) and the loader divides each pair's frequency by it: without the
    factors the logits would be those of plain RoPE, which transformers' llama3 model does not give."""
    import math

    from hotcold.gguf.io import ModelFile

    case = CASES["silu-gqa-llama3-scaling"]
    hf = make_llama(tmp_path / "hf", spm_model_file, **case)
    path = convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")
    factors = ModelFile(path).tensor("rope_freqs.weight").double()
    head_dim, p = 16, case["rope_parameters"]
    want = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * p["rope_theta"] ** (i / head_dim)
        if wavelen < p["original_max_position_embeddings"] / p["high_freq_factor"]:
            want.append(1.0)
        elif wavelen > p["original_max_position_embeddings"] / p["low_freq_factor"]:
            want.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / p["factor"] + smooth))
    assert torch.allclose(factors, torch.tensor(want, dtype=torch.float64), rtol=1e-6)
    assert {1.0, 8.0} <= set(factors.tolist()) and any(1 < f < 8 for f in factors.tolist())
    ids = list(range(5, 125))  # positions past the original context, where the factors matter
    llm = hotcold.load(path, device="cpu")
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    plain = make_llama(tmp_path / "plain", spm_model_file, **{**case, "rope_parameters": None})
    assert (hf_logits(plain, ids) - ref).abs().max() > 1e-2 * ref.abs().max()  # the factors change the logits
