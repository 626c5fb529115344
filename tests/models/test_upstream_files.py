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
from hotcold.gguf.io import ModelFile
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


def make_model(kind: str, hf_dir: Path, spm_model: Path, **wide):
    """A tiny transformers model of `kind` saved to hf_dir; `wide` overrides its sizes (K-quants need rows of
    256 values)."""
    if kind == "llama3":
        params = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)  # fmt: skip
        return make_llama(
            hf_dir, spm_model, hidden_act="silu", num_key_value_heads=2, rope_parameters=params, **wide
        )
    if kind in ("phi3", "phi3-longrope"):
        from tests.models.test_phi3 import CASES, LONGROPE, make_phi3

        if kind == "phi3":
            hf = make_phi3(hf_dir, spm_model, **{**CASES["phi4mini-gqa-partial-tied"], **wide})
        else:  # Phi-3.5-mini / Phi-4-mini's long-context RoPE, scaled down
            params = dict(rope_theta=10000.0, partial_rotary_factor=1.0, **LONGROPE)
            hf = make_phi3(hf_dir, spm_model, num_key_value_heads=2, original_max_position_embeddings=64,
                           rope_parameters=params, **wide)  # fmt: skip
        # upstream's Phi-3 vocabulary step reads the tokenizer class from tokenizer_config.json
        config = hf_dir / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.exists() else {}
        config.write_text(json.dumps({**settings, "tokenizer_class": "LlamaTokenizer"}))
        return hf
    gemma_wide = dict(wide, head_dim=64, query_pre_attn_scalar=64) if wide else {}
    if kind == "gemma2":
        from tests.models.test_gemma2 import CASES, make_gemma2

        return make_gemma2(hf_dir, spm_model, **{**CASES["gqa-window8"], **gemma_wide})
    from tests.models.test_gemma3 import CASES, make_gemma3

    return make_gemma3(hf_dir, spm_model, **{**CASES["gqa-window8"], **gemma_wide})


@pytest.mark.parametrize("kind", ["llama3", "phi3", "phi3-longrope", "gemma2", "gemma3"])
def test_upstream_files_match_transformers(tmp_path, spm_model_file, kind):
    hf = make_model(kind, tmp_path / "hf", spm_model_file)
    path = upstream_convert(tmp_path / "hf", tmp_path / "upstream.gguf")
    # longrope within its original context: the short factors, as transformers uses them for 40 tokens
    llm = hotcold.load(path, device="cpu", ctx_size=64 if kind == "phi3-longrope" else None)
    ids = random_ids(120 if kind == "llama3" else 40, seed=3)
    ours, ref = llm.logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (kind, float((ours - ref).abs().max()))


@pytest.mark.parametrize("kind", ["llama3", "phi3", "phi3-longrope", "gemma2", "gemma3"])
def test_hotcold_convert_writes_what_upstream_writes(tmp_path, spm_model_file, kind):
    """The same checkpoint through `hotcold convert` and upstream's converter: the same tensors (names, shapes and
    F32 values) and the same model keys ({arch}.*)."""
    from hotcold.convert import convert

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


BIN = Path(os.environ.get("HOTCOLD_LLAMA_BIN", SOURCE / "build" / "bin"))
WIDE = dict(hidden_size=256, intermediate_size=512)  # rows of 256 values: K-quants and Q4_K_M's mixture apply


@pytest.mark.skipif(
    not (BIN / "llama-perplexity").is_file() or not (BIN / "llama-quantize").is_file(),
    reason=f"no llama-quantize / llama-perplexity in {BIN} (../shared/anchors/build-llama-cpp.sh builds them)",
)
@pytest.mark.parametrize("kind", ["llama3", "phi3", "gemma2", "gemma3"])
def test_llama_quantize_files_perplexity_matches_llama_perplexity(tmp_path, spm_model_file, kind):
    """Upstream's converter, then `llama-quantize` Q4_K_M (K-quants, Q6_K where its mixture says): hotcold's
    perplexity on that file within 0.5% of `llama-perplexity`'s on the same text, context and chunks."""
    from tests.fixtures import hotcold_perplexity, llama_perplexity, training_text

    make_model(kind, tmp_path / "hf", spm_model_file, **WIDE)
    f32 = upstream_convert(tmp_path / "hf", tmp_path / "f32.gguf")
    q4km = tmp_path / "q4km.gguf"
    res = subprocess.run(
        [str(BIN / "llama-quantize"), str(f32), str(q4km), "Q4_K_M"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = tmp_path / "text.txt"
    text.write_text(training_text())
    ctx, chunks = 128, 4
    theirs = llama_perplexity(BIN / "llama-perplexity", q4km, text, ctx=ctx, chunks=chunks)
    ours = hotcold_perplexity(q4km, text, ctx=ctx, chunks=chunks)
    print(f"{kind}: hotcold {ours:.4f}, llama-perplexity {theirs:.4f}")
    assert abs(ours / theirs - 1) <= 0.005, (kind, ours, theirs)
    types = {e.qtype.name for e in ModelFile(q4km).tensors.values()}
    assert {"Q4_K", "Q6_K"} <= types, types  # the K-quant kernels ran, not a fallback type
