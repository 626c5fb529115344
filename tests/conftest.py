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


@pytest.fixture(scope="session")
def tiny_dense_gguf(tmp_path_factory, spm_model_file) -> Path:
    """A converted tiny ReLU LLaMA in the dense GGUF layout (F32)."""
    from hotcold.convert import convert
    from tests.fixtures import make_llama

    folder = tmp_path_factory.mktemp("tiny_dense")
    make_llama(folder / "hf", spm_model_file)
    return convert(folder / "hf", None, folder / "tiny.gguf", outtype="f32")


@pytest.fixture(scope="session")
def tiny_sparse_gguf(tmp_path_factory, spm_model_file) -> Path:
    """The same kind of model in the PowerInfer layout with random predictors (F32)."""
    from hotcold.convert import convert
    from tests.fixtures import make_llama, write_predictors

    folder = tmp_path_factory.mktemp("tiny_sparse")
    make_llama(folder / "hf", spm_model_file)
    write_predictors(folder / "pred", 2, 64, 1280, threshold=0.0)
    return convert(folder / "hf", folder / "pred", folder / "tiny.powerinfer.gguf", outtype="f32")


@pytest.fixture(scope="session")
def tiny_swiglu(tmp_path_factory, spm_model_file):
    """A tiny random SwiGLU LLaMA (hidden_act silu), converted dense to F16 and Q8_0, and each sparsified
    by `hotcold sparsify` at 0.5 on the test corpus (tests/fixtures.swiglu_files)."""
    from tests.fixtures import swiglu_files

    return swiglu_files(tmp_path_factory.mktemp("tiny_swiglu"), spm_model_file)
