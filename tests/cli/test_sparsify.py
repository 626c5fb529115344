"""The sparsify command and the commands that run its output: generate --sparsity, bench, perplexity, info."""

from __future__ import annotations

import json

from hotcold.cli import main


def test_sparsify_then_run(tiny_swiglu, tmp_path, capsys):
    out = tmp_path / "s.gguf"
    argv = ["sparsify", "-m", str(tiny_swiglu.dense["f16"]), "-f", str(tiny_swiglu.corpus), "-o", str(out)]
    assert main([*argv, "--sparsity", "0.4", "--max-tokens", "600", "-t", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sparsity"] == 0.4 and result["ffn_down_t_type"] == "Q8_0" and out.exists()
    assert result["gate_probe"] == "q4_0"  # auto: an F16 gate gets a Q4_0 probe

    assert (
        main(["generate", "-m", str(out), "-p", "Line 3", "-n", "4", "--temp", "0", "--sparsity", "0.6"]) == 0
    )
    err = capsys.readouterr().err
    assert "skipping 60% of FFN neurons" in err and "calibrated for 40%" in err

    assert main(["bench", "-m", str(out), "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["mode"] for r in rows} == {"sparse", "dense"}
    tg = {r["mode"]: r for r in rows if r["test"] == "tg4"}
    assert 0.4 < tg["sparse"]["firing_rate"] < 0.8 and tg["dense"]["firing_rate"] == 1.0

    ppl = ["perplexity", "-m", str(out), "-f", str(tiny_swiglu.corpus), "--max-tokens", "600", "-c", "128"]
    assert main([*ppl, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["mode"] == "sparse" and r["dense_perplexity"] > 0 and 0.4 < r["firing_rate"] < 0.8

    assert main(["info", "-m", str(out), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)["sparsify"]
    assert described.startswith("wina, target sparsity 0.4")  # the default
    assert described.endswith("Q8_0 row copies for the decode (ffn_up_rows, ffn_gate_rows)")  # F16 + probe


def test_bad_arguments(tiny_swiglu, tmp_path, capsys):
    dense, corpus = str(tiny_swiglu.dense["f16"]), str(tiny_swiglu.corpus)
    assert main(["generate", "-m", dense, "-n", "2", "--sparsity", "0.4"]) == 1
    assert "hotcold sparsify" in capsys.readouterr().err
    assert main(["generate", "-m", str(tiny_swiglu.sparse["f16"]), "-n", "2", "--sparsity", "1.5"]) == 1
    assert "--sparsity" in capsys.readouterr().err
    out = str(tmp_path / "x.gguf")
    assert main(["sparsify", "-m", dense, "-f", corpus, "-o", out, "--sparsity", "0"]) == 1
    assert "--sparsity must be a number in (0, 1)" in capsys.readouterr().err
    assert main(["sparsify", "-m", dense, "-f", corpus, "-o", dense]) == 1
    assert "overwritten" in capsys.readouterr().err
    for flag in ("--transpose-type", "--down-type"):  # the older name stays an alias
        assert main(["sparsify", "-m", dense, "-f", corpus, "-o", out, flag, "q3"]) == 1
        assert "--transpose-type must be one of" in capsys.readouterr().err


def test_sparsify_input_rules_then_run(tiny_swiglu, tmp_path, capsys):
    out = tmp_path / "inputs.gguf"
    argv = ["sparsify", "-m", str(tiny_swiglu.dense["f16"]), "-f", str(tiny_swiglu.corpus), "-o", str(out)]
    assert (
        main([*argv, "--attention", "--gate-probe", "inputs", "--max-tokens", "600", "-t", "1", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["attention_inputs"] is True and result["gate_probe"] == "inputs"
    assert (
        main(["generate", "-m", str(out), "-p", "Line 3", "-n", "4", "--temp", "0", "--sparsity", "0.3"]) == 0
    )
    assert "skipping 30% of FFN neurons and of attention inputs" in capsys.readouterr().err
    assert main(["info", "-m", str(out), "--json"]) == 0
    line = json.loads(capsys.readouterr().out)["sparsify"]
    assert "attention inputs too" in line and "the gate from its input channels" in line
