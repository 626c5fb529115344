"""Session fixtures shared by the test modules (builders live in tests/fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import TOKENIZER_VOCAB, training_text


@pytest.fixture(scope="session")
def spm_model_file(tmp_path_factory) -> Path:
    """A SentencePiece BPE tokenizer.model (byte fallback, LLaMA special ids) trained on local text."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text(training_text())
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=TOKENIZER_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        character_coverage=1.0,
        minloglevel=2,
    )
    return folder / "tokenizer.model"
