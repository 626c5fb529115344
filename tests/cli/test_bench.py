"""hotcold bench: a test longer than the model's training context runs, with a warning saying so."""

from __future__ import annotations

import json

from hotcold.cli import main


def test_prompt_beyond_the_training_context_warns(tiny_dense_gguf, capsys):
    # the tiny model was trained for 256 positions
    assert main(["bench", "-m", str(tiny_dense_gguf), "-p", "300", "-n", "0", "-r", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["test"] == "pp300"
    assert "warning: the test runs 301 positions, past the model's training context of 256 tokens" in err
    assert main(["bench", "-m", str(tiny_dense_gguf), "-p", "8", "-n", "4", "-r", "1", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_bad_numbers(tiny_dense_gguf, capsys):
    for argv, message in [(["-p=-1"], "-p/--n-prompt must be"), (["-r", "0"], "-r/--repetitions must be")]:
        assert main(["bench", "-m", str(tiny_dense_gguf), *argv]) == 1
        assert message in capsys.readouterr().err


def test_depth_times_decode_after_that_many_cached_tokens(tiny_dense_gguf, capsys, monkeypatch):
    """-d as llama-bench's: the timed tg tokens decode at positions depth + 1 onwards (the context's prefill is
    not timed), one row per depth, labelled as llama-bench labels it."""
    from hotcold.runtime.engine import Engine

    positions = []
    forward = Engine.forward

    def spy(self, ids, pos, **kwargs):
        positions.append(pos)
        return forward(self, ids, pos, **kwargs)

    monkeypatch.setattr(Engine, "forward", spy)
    argv = ["bench", "-m", str(tiny_dense_gguf), "-p", "0", "-n", "4", "-d", "0,16", "-r", "1", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["depth"]) for r in rows] == [("tg4", 0), ("tg4 @ d16", 16)]
    assert positions[-4:] == [17, 18, 19, 20]  # the last run: 16 context tokens after BOS, then 4 timed
    assert main(["bench", "-m", str(tiny_dense_gguf), "-d", "8,x"]) == 1
    assert "-d/--n-depth must be comma-separated depths >= 0" in capsys.readouterr().err


def test_batched_rows_report_sparse_over_dense_with_the_union(tiny_sparse_gguf, capsys):
    """-b: a tgNxB row per batch size and mode, and under the table each test's sparse / dense ratio with the
    sparse run's union firing rate, as the JSON rows give them."""
    argv = ["bench", "-m", str(tiny_sparse_gguf), "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-b", "1,3"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["mode"], r["test"]) for r in rows) == [
        ("dense", "tg4"),
        ("dense", "tg4x3"),
        ("sparse", "tg4"),
        ("sparse", "tg4x3"),
    ]
    sparse3 = next(r for r in rows if r["mode"] == "sparse" and r["test"] == "tg4x3")
    assert sparse3["firing_rate"] <= sparse3["union_firing_rate"] <= 1.0
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "sparse / dense" in line]
    assert [line.split(",")[0] for line in lines] == ["tg4", "tg4x3"]
    assert all("1 thread(s)" in line and "union" in line for line in lines)
