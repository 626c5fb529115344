"""hotcold perplexity: exp(mean NLL) of the documented windows, against transformers; sparse figures."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hotcold
from hotcold.cli import main
from hotcold.placement.profile import corpus_tokens
from tests.fixtures import training_text

CTX = 64
TOKENS = 600


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(training_text())
    return path


def run_json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def transformers_perplexity(hf_dir, ids: list[int], bos: int) -> tuple[float, int]:
    """The documented rule, written out: windows of BOS + CTX-1 tokens (a shorter last one dropped), the
    predictions at positions CTX/2 .. CTX-2 scored."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for s in range(0, len(ids) - (CTX - 1) + 1, CTX - 1):
        window = [bos] + ids[s : s + CTX - 1]
        with torch.no_grad():
            logits = model(torch.tensor([window])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        for j in range(CTX // 2, CTX - 1):
            nll -= float(logp[j, window[j + 1]])
            count += 1
    return math.exp(nll / count), count


def test_dense_perplexity_equals_transformers(tiny_dense_gguf, text_file, capsys):
    result = run_json(
        capsys,
        [
            "perplexity",
            "-m",
            str(tiny_dense_gguf),
            "-f",
            str(text_file),
            "-c",
            str(CTX),
            "--max-tokens",
            str(TOKENS),
            "--json",
        ],
    )
    llm = hotcold.load(tiny_dense_gguf)
    ids = corpus_tokens(llm.tokenizer, training_text(), max_tokens=TOKENS)
    want, count = transformers_perplexity(tiny_dense_gguf.parent / "hf", ids, llm.tokenizer.bos_id)
    assert result["mode"] == "dense"
    assert result["tokens_scored"] == count == (TOKENS // (CTX - 1)) * (CTX - 1 - CTX // 2)
    assert result["perplexity"] == pytest.approx(want, rel=1e-5)
    assert "firing_rate" not in result


def test_sparse_with_all_firing_predictors_equals_dense(tiny_dense_gguf, text_file, tmp_path, capsys):
    from hotcold.convert import convert
    from tests.fixtures import write_predictors

    pred = write_predictors(tmp_path / "pred", 2, 64, 1280, all_fire=True, threshold=0.0)
    model = convert(tiny_dense_gguf.parent / "hf", pred, tmp_path / "all.powerinfer.gguf", outtype="f32")
    argv = ["perplexity", "-m", str(model), "-f", str(text_file), "-c", str(CTX), "--max-tokens", str(TOKENS)]
    sparse = run_json(capsys, argv + ["--json"])
    dense = run_json(capsys, argv + ["--json", "--dense"])
    assert sparse["mode"] == "sparse"
    assert sparse["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-5)
    assert sparse["dense_perplexity"] == pytest.approx(dense["perplexity"], rel=1e-6)
    assert sparse["firing_rate"] == 1.0 and sparse["recall_mean"] == 1.0
    for layer in sparse["layers"]:
        assert layer["selected_rate"] == layer["computed_rate"] == 1.0
        assert 0 < layer["true_firing_rate"] < 1
        assert layer["precision"] == pytest.approx(layer["true_firing_rate"])
        assert layer["selection_ratio"] == pytest.approx(1 / layer["true_firing_rate"])


def test_sparse_text_report(tiny_sparse_gguf, text_file, capsys):
    argv = [
        "perplexity",
        "-m",
        str(tiny_sparse_gguf),
        "-f",
        str(text_file),
        "-c",
        str(CTX),
        "--max-tokens",
        "200",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sparse perplexity" in out and "dense perplexity" in out and "predictor recall" in out
    result = run_json(capsys, argv + ["--json"])
    assert 0 < result["firing_rate"] < 1 and 0 < result["recall_mean"] < 1
    assert len(result["layers"]) == 2
    assert result["perplexity_increase"] == pytest.approx(
        result["perplexity"] / result["dense_perplexity"] - 1
    )


@pytest.mark.parametrize(
    "content, message",
    [(None, "no such file"), ("", "the corpus is empty"), ("a", "too few to score")],
)
def test_bad_text(tiny_dense_gguf, tmp_path, capsys, content, message):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_text(content)
    code = main(["perplexity", "-m", str(tiny_dense_gguf), "-f", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err
