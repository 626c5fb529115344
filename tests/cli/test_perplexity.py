"""hotcold perplexity: llama.cpp's protocol (chunks, BOS, scored positions) re-implemented here from its
source and run on hotcold's own logits and on transformers'; sparse figures."""

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


def llama_cpp_perplexity(logits_of, ids: list[int], bos: int | None, ctx: int) -> tuple[float, int, int]:
    """llama.cpp's perplexity() written out as its source reads: tokens = tokenize(text, add_special) (BOS
    first when the vocabulary adds it), n_chunk = len(tokens) // ctx, each chunk's first token replaced by
    BOS while it is evaluated, and for j in ctx/2 .. ctx-2 the NLL of tokens[start + j + 1]."""
    tokens = ([bos] if bos is not None else []) + list(ids)
    n_chunk = len(tokens) // ctx
    first = ctx // 2
    nll, count = 0.0, 0
    for i in range(n_chunk):
        start = i * ctx
        batch = list(tokens[start : start + ctx])
        if bos is not None:
            batch[0] = bos
        logits = logits_of(batch).double()
        for j in range(first, ctx - 1):
            nll -= float(torch.log_softmax(logits[j], -1)[tokens[start + j + 1]])
            count += 1
    return math.exp(nll / count), count, n_chunk


def transformers_logits(hf_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def logits_of(batch: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([batch])).logits[0]

    return logits_of


def test_dense_perplexity_follows_llama_cpp(tiny_dense_gguf, text_file, capsys):
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
    assert llm.tokenizer.add_bos and llm.tokenizer.bos_id is not None
    ids = corpus_tokens(llm.tokenizer, training_text(), max_tokens=TOKENS)
    bos = llm.tokenizer.bos_id
    ours, count, n_chunk = llama_cpp_perplexity(llm.logits, ids, bos, CTX)
    hf, hf_count, _ = llama_cpp_perplexity(transformers_logits(tiny_dense_gguf.parent / "hf"), ids, bos, CTX)
    assert result["mode"] == "dense"
    assert n_chunk == (TOKENS + 1) // CTX and result["chunks"] == n_chunk and result["ctx"] == CTX
    assert result["tokens_scored"] == count == hf_count == n_chunk * (CTX - 1 - CTX // 2)
    assert result["perplexity"] == pytest.approx(ours, rel=1e-9)  # the same windows of the same logits
    assert result["perplexity"] == pytest.approx(hf, rel=1e-5)
    assert "firing_rate" not in result


def test_chunks_are_llama_cpps():
    from hotcold.cli.perplexity import scoring_chunks

    ids = list(range(10, 30))  # 20 text tokens
    # with BOS: the stream is BOS + 20 tokens = 21 -> 2 chunks of 8, token 10+7 (chunk 1's first) replaced
    chunks = scoring_chunks(ids, 8, bos_id=1)
    assert chunks == [[1, *range(10, 17)], [1, *range(18, 25)]]
    # no BOS in the vocabulary: plain cuts, nothing replaced, the 4 left over dropped
    assert scoring_chunks(ids, 8, bos_id=None) == [list(range(10, 18)), list(range(18, 26))]
    with pytest.raises(ValueError, match="too few to score"):
        scoring_chunks(ids[:6], 8, bos_id=1)
    with pytest.raises(ValueError, match=">= 3"):
        scoring_chunks(ids, 2, bos_id=1)


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


BIBLE = """And it came to pass in the days when the judges ruled, that there was a famine in the land.
And a certain man went to sojourn in the country of Moab, he, and his wife, and his two sons.
Then the LORD answered out of the whirlwind, and said, Who is this that darkeneth counsel by words
without knowledge? Gird up now thy loins like a man; for I will demand of thee, and answer thou me.
Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that mourn:
for they shall be comforted. Blessed are the meek: for they shall inherit the earth.
"""


def test_bundled_demo_model(tmp_path, capsys):
    """The shipped model: sparse with activation statistics beside it, and its predictors good enough that
    sparse perplexity stays within 2% of dense on a short Bible text."""
    from hotcold.loader import demo_model_path

    path = demo_model_path()
    if not path.exists():
        pytest.skip("the demo model is not built (scripts/demo_model/build_sparse.py)")
    llm = hotcold.load()
    assert llm.config.sparse and llm.config.n_ff == 1024
    for i in range(llm.config.n_layer):
        stats = torch.load(path.parent / "activation" / f"activation_{i}.pt")
        assert stats.shape == (1024,) and stats.dtype == torch.int64 and stats.sum() > 0
    text = tmp_path / "bible.txt"
    text.write_text(BIBLE * 3)
    result = run_json(capsys, ["perplexity", "-f", str(text), "-c", "128", "--json"])
    assert result["mode"] == "sparse"
    assert abs(result["perplexity_increase"]) < 0.02
    assert result["recall_mean"] > 0.95 and result["selection_ratio"] < 1.6
