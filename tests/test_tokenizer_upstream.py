"""The tokenizer against upstream llama.cpp's reference ids: each `models/ggml-vocab-NAME.gguf` (a real vocabulary)
with its `.inp` texts and the `.out` ids llama.cpp's reference tokenizers give (no BOS, as its test-tokenizer-0
runs them). The llama.cpp source is the one `../shared/anchors/build-llama-cpp.sh` unpacks (`HOTCOLD_LLAMA_CPP`,
default ~/.cache/hotcold-anchors/llama.cpp); without it these tests skip, saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hotcold.gguf_io import ModelFile
from hotcold.tokenizer import Tokenizer

MODELS = (
    Path(os.environ.get("HOTCOLD_LLAMA_CPP", Path.home() / ".cache" / "hotcold-anchors" / "llama.cpp"))
    / "models"
)
SEPARATOR = "\n__ggml_vocab_test__\n"

# the vocabularies of the families hotcold runs: Llama 3 (llama-bpe), Qwen2/Qwen3 (qwen2), Phi-3 (phi-3), Llama 2 /
# Mistral / Gemma-style SentencePiece (llama-spm), GPT-2 and Falcon byte-level BPE
VOCABS = ["llama-bpe", "qwen2", "phi-3", "llama-spm", "gpt-2", "falcon"]


@pytest.mark.parametrize("name", VOCABS)
def test_ids_equal_upstream_reference(name):
    vocab = MODELS / f"ggml-vocab-{name}.gguf"
    if not vocab.is_file():
        pytest.skip(
            f"no {vocab} (../shared/anchors/build-llama-cpp.sh unpacks the llama.cpp source; HOTCOLD_LLAMA_CPP)"
        )
    tok = Tokenizer.from_metadata(ModelFile(vocab).metadata, source=str(vocab))
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = [
        [int(i) for i in line.split()]
        for line in Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    ]
    assert len(texts) <= len(ids) and len(texts) > 20
    wrong = [(t, tok.encode(t, add_bos=False, add_eos=False), want) for t, want in zip(texts, ids)]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ; first: {wrong[0]}"
