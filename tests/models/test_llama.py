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
