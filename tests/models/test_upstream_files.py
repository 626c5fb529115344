"""Files written by upstream llama.cpp's own converter (`convert_hf_to_gguf.py`, the one that writes the files users
download) from tiny transformers models: hotcold reads each and matches transformers' logits. The llama.cpp source
is the one `../shared/anchors/build-llama-cpp.sh` unpacks (`HOTCOLD_LLAMA_CPP`, default
~/.cache/hotcold-anchors/llama.cpp); without it these tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hotcold
from tests.fixtures import hf_logits, make_llama, random_ids

SOURCE = Path(os.environ.get("HOTCOLD_LLAMA_CPP", Path.home() / ".cache" / "hotcold-anchors" / "llama.cpp"))
CONVERTER = SOURCE / "convert_hf_to_gguf.py"
pytestmark = pytest.mark.skipif(
    not CONVERTER.is_file(),
    reason=f"no llama.cpp source at {SOURCE} (../shared/anchors/build-llama-cpp.sh unpacks it; HOTCOLD_LLAMA_CPP)",
)


def upstream_convert(hf_dir: Path, out: Path) -> Path:
    """hf_dir converted by upstream's converter in its own process (its gguf-py is newer than the pip gguf)."""
    env = dict(os.environ, PYTHONPATH=str(SOURCE / "gguf-py"), NO_LOCAL_GGUF="")
    cmd = [sys.executable, str(CONVERTER), str(hf_dir), "--outfile", str(out), "--outtype", "f32"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def make_model(kind: str, hf_dir: Path, spm_model: Path):
    if kind == "llama3":
        params = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)  # fmt: skip
        return make_llama(hf_dir, spm_model, hidden_act="silu", num_key_value_heads=2, rope_parameters=params)
    if kind in ("phi3", "phi3-longrope"):
        from tests.models.test_phi3 import CASES, LONGROPE, make_phi3

        if kind == "phi3":
            hf = make_phi3(hf_dir, spm_model, **CASES["phi4mini-gqa-partial-tied"])
        else:  # Phi-3.5-mini / Phi-4-mini's long-context RoPE, scaled down
            params = dict(rope_theta=10000.0, partial_rotary_factor=1.0, **LONGROPE)
            hf = make_phi3(hf_dir, spm_model, num_key_value_heads=2, original_max_position_embeddings=64,
                           rope_parameters=params)  # fmt: skip
        # upstream's Phi-3 vocabulary step reads the tokenizer class from tokenizer_config.json
        config = hf_dir / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.exists() else {}
        config.write_text(json.dumps({**settings, "tokenizer_class": "LlamaTokenizer"}))
        return hf
    from tests.models.test_gemma3 import CASES, make_gemma3

    return make_gemma3(hf_dir, spm_model, **CASES["gqa-window8"])


@pytest.mark.parametrize("kind", ["llama3", "phi3", "phi3-longrope", "gemma3"])
def test_upstream_files_match_transformers(tmp_path, spm_model_file, kind):
    hf = make_model(kind, tmp_path / "hf", spm_model_file)
    path = upstream_convert(tmp_path / "hf", tmp_path / "upstream.gguf")
    # longrope within its original context: the short factors, as transformers uses them for 40 tokens
    llm = hotcold.load(path, device="cpu", ctx_size=64 if kind == "phi3-longrope" else None)
    ids = random_ids(120 if kind == "llama3" else 40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (kind, float((ours - ref).abs().max()))


@pytest.mark.parametrize("kind", ["llama3", "phi3", "phi3-longrope", "gemma3"])
def test_hotcold_convert_writes_what_upstream_writes(tmp_path, spm_model_file, kind):
    """The same checkpoint through `hotcold convert` and upstream's converter: the same tensors (names, shapes and
    F32 values) and the same model keys ({arch}.*)."""
    from hotcold.convert import convert
    from hotcold.gguf_io import ModelFile

    make_model(kind, tmp_path / "hf", spm_model_file)
    theirs = ModelFile(upstream_convert(tmp_path / "hf", tmp_path / "upstream.gguf"))
    ours = ModelFile(convert(tmp_path / "hf", None, tmp_path / "ours.gguf", outtype="f32"))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name in ours.tensors:
        a, b = ours.tensor(name).float(), theirs.tensor(name).float()
        assert a.shape == b.shape and bool((a == b).all()), name
    arch = theirs.architecture
    assert ours.architecture == arch
    keys = {k for k in theirs.metadata if k.startswith(f"{arch}.")}
    assert {k: ours.metadata.get(k) for k in keys} == {k: theirs.metadata[k] for k in keys}
