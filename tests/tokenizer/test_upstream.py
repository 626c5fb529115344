"""The tokenizer against upstream llama.cpp's reference ids: each `models/ggml-vocab-NAME.gguf` (a real vocabulary)
with its `.inp` texts and the `.out` ids llama.cpp's reference tokenizers give (no BOS, as its test-tokenizer-0
runs them). The llama.cpp source is the one `../shared/anchors/build-llama-cpp.sh` unpacks (`HOTCOLD_LLAMA_CPP`,
default ~/.cache/hotcold-anchors/llama.cpp); without it these tests skip, saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hotcold.gguf.io import ModelFile
from hotcold.tokenizer.vocab import Tokenizer

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


# The end-of-generation ids upstream llama.cpp stops on for each vocabulary (src/llama-vocab.cpp, special_eog_ids),
# worked out by hand from its rules: the file's EOS / EOT / EOM ids; the FIM pad, repo and file-separator tokens
# (by key, else by text: "<PAD>", "<fim_pad>", "<reponame>"...); every token whose text is on its list ("</s>",
# "<|endoftext|>", "<|im_end|>", "<|end|>", "<|eot_id|>", "<|end_of_text|>", "<eos>", "<turn|>",
# "<|tool_response>", ...) of any type (Qwen2's "</s>" is a normal token; Phi-3's a user-defined one); less "</s>"
# where "<|tool_response>" is in the set (Gemma 4).
UPSTREAM_EOG = {
    "aquila": {0: "<|endoftext|>", 100007: "</s>"},
    "baichuan": {2: "</s>"},
    "command-r": {0: "<PAD>", 255001: "<|END_OF_TURN_TOKEN|>"},  # <PAD> is its FIM pad token by text
    "deepseek-coder": {32014: "<｜end▁of▁sentence｜>"},
    "deepseek-llm": {100001: "<｜end▁of▁sentence｜>"},
    "falcon": {11: "<|endoftext|>"},
    "gpt-2": {50256: "<|endoftext|>"},
    "gpt-neox": {0: "<|endoftext|>"},
    "llama-bpe": {128001: "<|end_of_text|>", 128009: "<|eot_id|>"},
    "llama-spm": {2: "</s>"},
    "mpt": {0: "<|endoftext|>"},
    "phi-3": {2: "</s>", 32000: "<|endoftext|>", 32007: "<|end|>"},
    "qwen2": {128247: "</s>", 151643: "<|endoftext|>", 151645: "<|im_end|>"},
    "qwen35": {128247: "</s>", 151643: "<|endoftext|>", 151645: "<|im_end|>"},
    "refact": {0: "<|endoftext|>", 4: "<fim_pad>", 18: "<reponame>"},
    "starcoder": {0: "<|endoftext|>", 4: "<fim_pad>"},
}
# tokenizer.ggml.model "gemma4", which hotcold cannot tokenize yet: its EOG rule is checked on its own
GEMMA4_EOG = {1: "<eos>", 50: "<|tool_response>", 106: "<turn|>"}  # "</s>" (212) is ordinary text there


def _vocab(name: str) -> Path:
    vocab = MODELS / f"ggml-vocab-{name}.gguf"
    if not vocab.is_file():
        pytest.skip(
            f"no {vocab} (../shared/anchors/build-llama-cpp.sh unpacks the llama.cpp source; HOTCOLD_LLAMA_CPP)"
        )
    return vocab


@pytest.mark.parametrize("name", sorted(UPSTREAM_EOG))
def test_end_of_generation_tokens_equal_upstreams(name):
    """Issue #44: hotcold stopped only on control tokens of a shorter list (missing Phi-3's "</s>", Qwen2's "</s>",
    StarCoder's <fim_pad>, Command R's <PAD>...)."""
    vocab = _vocab(name)
    tok = Tokenizer.from_metadata(ModelFile(vocab).metadata, source=str(vocab))
    assert {i: tok.piece(i) for i in sorted(tok.eog_ids)} == UPSTREAM_EOG[name]
    assert all(tok.is_eog(i) for i in UPSTREAM_EOG[name])


def test_gemma4_end_of_generation_tokens_equal_upstreams():
    from hotcold.tokenizer.eog import derive_eog_ids

    meta = ModelFile(_vocab("gemma-4")).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    ids = derive_eog_ids(tokens, eos_id=meta["tokenizer.ggml.eos_token_id"])
    assert {i: tokens[i] for i in sorted(ids)} == GEMMA4_EOG
