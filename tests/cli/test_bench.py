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
