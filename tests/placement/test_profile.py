"""hotcold profile: activation counts equal an independent count from the Hugging Face model's hooks."""

from __future__ import annotations

import shutil

import pytest
import torch

import hotcold
from hotcold.cli import main
from hotcold.placement.profile import (
    corpus_tokens,
    profile_activations,
    token_windows,
    write_activation_files,
)
from tests.fixtures import training_text

CTX = 64


def hf_counts(hf_dir, windows: list[list[int]]) -> list[torch.Tensor]:
    """Per layer, tokens where each neuron's input to down_proj (act(gate) * up) is nonzero, from transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    counts = [torch.zeros(model.config.intermediate_size, dtype=torch.int64) for _ in model.model.layers]

    def counter(i):
        def hook(_module, inputs):  # a pre-hook that returns nothing leaves the input alone
            counts[i].add_((inputs[0][0] != 0).sum(0))

        return hook

    hooks = [
        layer.mlp.down_proj.register_forward_pre_hook(counter(i))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    for h in hooks:
        h.remove()
    return counts


def test_counts_equal_transformers_hooks(tiny_dense_gguf):
    llm = hotcold.load(tiny_dense_gguf, dense=True)
    ids = corpus_tokens(llm.tokenizer, training_text(), max_tokens=1000)
    counts = profile_activations(llm, ids, ctx=CTX)
    windows = token_windows(ids, CTX, llm.tokenizer.bos_id)
    assert sum(len(w) for w in windows) == len(ids) + len(windows)  # every token once, plus a BOS per window
    assert windows[0][0] == llm.tokenizer.bos_id and len(windows[0]) == CTX
    expected = hf_counts(tiny_dense_gguf.parent / "hf", windows)
    assert len(counts) == len(expected) == 2
    for got, want in zip(counts, expected):
        assert got.dtype == torch.int64 and got.shape == (1280,)
        # fp32 on both sides: a pre-activation within rounding of 0 may flip; allow a handful in ~2.6 M
        assert (got - want).abs().sum() <= 5, (got - want).abs().sum()
        assert 0 < got.sum() < got.numel() * sum(len(w) for w in windows)


def test_cli_writes_activation_files_next_to_the_model(tiny_dense_gguf, tmp_path, capsys):
    model = tmp_path / "tiny.gguf"
    shutil.copy(tiny_dense_gguf, model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    code = main(["profile", "-m", str(model), "-f", str(corpus), "-c", str(CTX), "--max-tokens", "300"])
    assert code == 0
    files = sorted(p.name for p in (tmp_path / "activation").iterdir())
    assert files == ["activation_0.pt", "activation_1.pt"]  # no temporary files left behind
    llm = hotcold.load(model, dense=True)
    ids = corpus_tokens(llm.tokenizer, training_text(), max_tokens=300, spread=True)
    direct = profile_activations(llm, ids, ctx=CTX)  # the CLI samples with spread=True
    for i, want in enumerate(direct):
        got = torch.load(tmp_path / "activation" / f"activation_{i}.pt")
        assert torch.equal(got, want)
    assert "profiled 300 tokens" in capsys.readouterr().err

    out = tmp_path / "elsewhere"
    assert main(["profile", "-m", str(model), "-f", str(corpus), "-o", str(out), "--max-tokens", "50"]) == 0
    assert (out / "activation_1.pt").exists()


@pytest.mark.parametrize(
    "content, message",
    [(None, "no such file"), ("", "the corpus is empty"), ("  \n\n", "the corpus is empty")],
)
def test_bad_corpus(tiny_dense_gguf, tmp_path, capsys, content, message):
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_text(content)
    code = main(["profile", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(tmp_path / "act")])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "corpus.txt" in err and "Traceback" not in err
    assert not (tmp_path / "act").exists()


def test_silu_model_is_refused(tmp_path, spm_model_file, capsys):
    from hotcold.convert import convert
    from tests.fixtures import make_llama

    make_llama(tmp_path / "hf", spm_model_file, hidden_act="silu", num_hidden_layers=1)
    model = convert(tmp_path / "hf", None, tmp_path / "silu.gguf", outtype="f32")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning")
    assert main(["profile", "-m", str(model), "-f", str(corpus)]) == 1
    assert "not ReLU" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["profile", "perplexity", "generate", "train-predictors"])
def test_non_utf8_text_is_refused_the_same_way(tiny_dense_gguf, tmp_path, capsys, command):
    """profile, perplexity, train-predictors and generate -f read text files by one rule: the first bad
    byte is named with its offset (profile and perplexity used to replace it silently)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(training_text().encode()[:500] + b"caf\xe9 au lait\n")
    argv = [command, "-m", str(tiny_dense_gguf), "-f", str(corpus)]
    if command in ("profile", "train-predictors"):
        argv += ["-o", str(tmp_path / "out")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "corpus.txt: not UTF-8 text (invalid continuation byte at byte 503" in err
    assert not (tmp_path / "out").exists()


def test_profile_never_writes_over_its_corpus(tiny_dense_gguf, tmp_path, capsys):
    out = tmp_path / "act"
    out.mkdir()
    corpus = out / "activation_1.pt"  # contrived, but the rule is the same for every writer
    corpus.write_text(training_text())
    code = main(
        ["profile", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(out), "--max-tokens", "50"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "is the input" in err
    assert corpus.read_text() == training_text()
    assert sorted(p.name for p in out.iterdir()) == ["activation_1.pt"]  # none written, not even layer 0


def _failing_save(monkeypatch, after: int):
    """torch.save that fails on its call number `after` (0-based), as a full disk or a kill would."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError("simulated failure writing a statistics file")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_statistics_are_written_as_one_set(tmp_path, monkeypatch):
    """A failure after layer 0's file leaves the old statistics whole (it used to leave new 0, old 1..);
    a new set with fewer layers leaves none of the old set's files behind."""
    out = tmp_path / "activation"
    old = [torch.full((8,), 1), torch.full((8,), 2), torch.full((8,), 3)]
    write_activation_files(old, out)
    _failing_save(monkeypatch, after=1)
    with pytest.raises(RuntimeError, match="simulated"):
        write_activation_files([torch.zeros(8, dtype=torch.int64)] * 3, out)
    monkeypatch.undo()
    assert [torch.load(out / f"activation_{i}.pt").tolist() for i in range(3)] == [c.tolist() for c in old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activation"]
    write_activation_files([torch.zeros(8, dtype=torch.int64)] * 2, out)
    assert sorted(p.name for p in out.iterdir()) == ["activation_0.pt", "activation_1.pt"]


def test_profile_refuses_a_folder_it_cannot_replace_before_the_run(tiny_dense_gguf, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not statistics")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    code = main(["profile", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "holds other files (notes.txt)" in err
    assert "profiling" not in err  # refused before the model ran
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_profile_of_the_bundled_model_writes_to_the_user_cache_and_is_used_from_there(
    tmp_path, monkeypatch, capsys
):
    """`hotcold profile` without -m wrote into the installed package's data/activation (#47). It writes to
    activation/ in the user cache; the loader's statistics folder, `info` and the placement cache's inputs
    then point there. Only the package's own folder is untouched."""
    import json
    import os

    from hotcold.kernels import build
    from hotcold.loader import demo_model_path
    from hotcold.placement import profile as profile_mod
    from hotcold.placement.gpuidx import model_inputs

    demo = demo_model_path()
    bundled = demo.parent / "activation"
    build.get_lib()  # built (or found) in the usual cache before the cache folder moves for this test
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "cache"))
    # before anything runs (the old code would write into the package): the target is in the cache
    target = profile_mod.activation_output_dir(demo)
    assert tmp_path / "cache" in target.parents
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundled.iterdir()}
    assert profile_mod.default_activation_dir(demo) == bundled  # nothing profiled yet: the bundled statistics
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    assert main(["profile", "-f", str(corpus), "-c", "64", "--max-tokens", "200", "-t", "1"]) == 0
    err = capsys.readouterr().err
    assert f"wrote 8 files to {target}" in err and "user cache" in err
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundled.iterdir()} == before
    assert sorted(os.listdir(target)) == [f"activation_{i}.pt" for i in range(8)]
    assert profile_mod.default_activation_dir(demo) == target  # where the loader and placement read
    assert model_inputs(demo)[1:] == [target / f"activation_{i}.pt" for i in range(8)]
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["activation_stats"] == str(target)
