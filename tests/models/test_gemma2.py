"""Gemma 2 against Hugging Face transformers: converted by `hotcold convert` as upstream llama.cpp writes arch gemma2
(norms stored as 1 + w, sandwich norms, no q/k norms, NeoX RoPE, tied output, the two soft-caps as keys), loaded as
llama layers whose description says so: embeddings times sqrt(width), GELU-tanh gated FFN, even layers in a sliding
window and odd ones global, attention scores and output logits soft-capped (small caps here, so that tanh bends)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hotcold
from hotcold.convert import convert
from hotcold.gguf.io import ModelFile
from tests.fixtures import run_family_checks
from tests.models.test_gemma3 import make_gemma

CASES = {
    # 5 layers: local, global, local, global, local; a window of 8 over 40-token checks
    "gqa-window8": dict(num_hidden_layers=5, num_key_value_heads=2, sliding_window=8),
}


def make_gemma2(hf_dir: Path, spm_model: Path, *, seed: int = 0, **overrides):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Gemma 2 ships caps of 50 and 30: small ones make tanh matter on a tiny model
    caps = dict(attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    return make_gemma(Gemma2ForCausalLM, Gemma2Config, hf_dir, spm_model, seed=seed, **{**caps, **overrides})


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory, spm_model_file):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_gemma2(folder / "hf", spm_model_file, **CASES[request.param])
    return hf, convert(folder / "hf", None, folder / "model.gguf", outtype="f32")


def test_family_runner(converted):
    """Logits and greedy tokens against transformers; the one-call decoder (soft-capped scores in the C attention,
    which the eager layers' decode rows call too) equal to the eager one on the F16 copy."""
    hf, path = converted
    run_family_checks(path, hf)


def test_soft_caps_are_read_and_change_the_logits(converted, tmp_path):
    """The caps come from the file's keys, and they matter: without them the logits move (so the match with
    transformers above is not a coincidence of caps too loose to bend anything)."""
    hf, path = converted
    mf = ModelFile(path)
    assert mf.architecture == "gemma2" and "output.weight" not in mf.tensors
    assert mf.metadata["gemma2.attn_logit_softcapping"] == pytest.approx(1.5)
    assert mf.metadata["gemma2.final_logit_softcapping"] == pytest.approx(3.0)
    assert "blk.0.attn_q_norm.weight" not in mf.tensors and "blk.0.post_ffw_norm.weight" in mf.tensors
    llm = hotcold.load(path, device="cpu")
    layers = llm.loaded.model.layers
    assert [layer.spec.sliding_window for layer in layers] == [8, 0, 8, 0, 8]
    assert all(layer.spec.attn_softcap == pytest.approx(1.5) for layer in layers)
    ids = list(range(3, 40))
    capped = llm.logits(ids)
    assert capped.abs().max() < 3.0  # every logit inside the final cap
    for layer in layers:  # the same model without its attention cap
        object.__setattr__(layer, "spec", type(layer.spec)(**{**layer.spec.__dict__, "attn_softcap": 0.0}))
    assert (llm.logits(ids) - capped).abs().max() > 1e-3


def test_bad_softcap_key_is_refused(converted, tmp_path):
    from hotcold.gguf.io import GGUFError
    from tests.models.test_gpt_oss import rewrite

    _, path = converted
    bad = rewrite(
        ModelFile(path), tmp_path / "bad.gguf", meta={"gemma2.attn_logit_softcapping": float("nan")}
    )
    with pytest.raises(GGUFError, match="gemma2.attn_logit_softcapping"):
        hotcold.load(bad, device="cpu")


def test_a_file_without_the_cap_and_window_keys_runs_as_llama_cpp_runs_it(converted, tmp_path):
    """llama.cpp caps every gemma2 file (50 and 30 where the keys are absent) and windows it at 4096: so does
    hotcold. A checkpoint without caps is refused by the converter (llama.cpp would run its file capped)."""
    import json
    import shutil

    from hotcold.config import config_from_file
    from hotcold.convert.checkpoint import ConvertError
    from tests.models.test_gpt_oss import rewrite

    hf, path = converted
    keys = (
        "gemma2.attn_logit_softcapping",
        "gemma2.final_logit_softcapping",
        "gemma2.attention.sliding_window",
    )
    bare = rewrite(ModelFile(path), tmp_path / "bare.gguf", meta=dict.fromkeys(keys))
    c = config_from_file(ModelFile(bare))
    assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (50.0, 30.0, 4096)
    shutil.copytree(Path(path).parent / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": None}))
    with pytest.raises(ConvertError, match="final_logit_softcapping is None"):
        convert(tmp_path / "hf", None, tmp_path / "m.gguf", outtype="f32")


def test_sparsify_reaches_gemma2_files(tmp_path, spm_model_file):
    """`hotcold sparsify` on a Gemma 2 file (GeGLU thresholds, sandwich norms, input-sparse attention with its
    soft-capped scores): about half the FFN neurons skipped, sparsity 0 gives the dense file's logits, and the
    one-call decoder (the soft-cap in the C attention of the input-sparse head) gives the eager decoder's tokens."""
    from tests.fixtures import check_sparsify_reaches

    make_gemma2(tmp_path / "hf", spm_model_file, **CASES["gqa-window8"])
    dense = convert(tmp_path / "hf", None, tmp_path / "m.f16.gguf", outtype="f16")
    check_sparsify_reaches(dense, tmp_path, attention=True, decoder="cpu_one_call", max_tokens=600)
