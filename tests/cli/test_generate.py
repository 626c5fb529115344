"""The CLI as a person uses it: text on stdout, timings on stderr, clear errors with exit code 1."""

from __future__ import annotations

import pytest

from hotcold.cli import main
from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file


def rewrite(src, dst, *, meta_change=None, drop=None, reshape=None):
    """Copy a model file with one thing broken."""
    mf = ModelFile(src)
    meta = [m for m in metadata_items(mf)]
    if meta_change:
        meta = [(k, meta_change.get(k, v), t, s) for k, v, t, s in meta]
    specs = []
    for e in mf.tensors.values():
        if e.name == drop:
            continue
        shape = e.shape
        if e.name == reshape:
            shape = (shape[1], shape[0])
        specs.append(TensorSpec(e.name, shape, e.qtype, lambda e=e: e.data))
    write_model_file(
        dst,
        meta_change.get("general.architecture", "llama") if meta_change else "llama",
        meta,
        specs,
        sparse=mf.is_sparse,
    )
    return dst


def test_generate_prints_text_and_timings(tiny_dense_gguf, capsys):
    code = main(
        [
            "generate",
            "-m",
            str(tiny_dense_gguf),
            "-p",
            "Line 1: the quick",
            "-n",
            "16",
            "--temp",
            "0",
            "--ignore-eos",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert len(out.strip()) > 0
    assert "tokens/s" in err and "load" in err


def test_generate_sparse_reports_firing_rate(tiny_sparse_gguf, capsys):
    code = main(
        ["generate", "-m", str(tiny_sparse_gguf), "-p", "Line 2", "-n", "8", "--ignore-eos", "--seed", "3"]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert "FFN neurons computed" in err
    rate = float(err.split("FFN neurons computed")[1].split("%")[0])
    assert 0 < rate < 100


def run_error(capsys, argv):
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in err
    return err


def test_missing_file(capsys, tmp_path):
    err = run_error(capsys, ["generate", "-m", str(tmp_path / "none.gguf"), "-p", "x"])
    assert "none.gguf: no such file" in err


def test_wrong_magic(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 64)
    assert "not a GGUF file" in run_error(capsys, ["generate", "-m", str(bad), "-p", "x"])


def test_truncated_file(capsys, tmp_path, tiny_dense_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_dense_gguf.read_bytes()[:-1000])
    assert "truncated" in run_error(capsys, ["generate", "-m", str(cut), "-p", "x"])


def test_unknown_architecture_lists_supported(capsys, tmp_path, tiny_dense_gguf):
    bad = rewrite(tiny_dense_gguf, tmp_path / "gpt9.gguf", meta_change={"general.architecture": "gpt9"})
    err = run_error(capsys, ["generate", "-m", str(bad), "-p", "x"])
    assert "unknown architecture 'gpt9'" in err and "llama" in err


def test_missing_tensor_named(capsys, tmp_path, tiny_dense_gguf):
    bad = rewrite(tiny_dense_gguf, tmp_path / "m.gguf", drop="blk.1.ffn_up.weight")
    assert "missing tensor blk.1.ffn_up.weight" in run_error(capsys, ["generate", "-m", str(bad), "-p", "x"])


def test_wrong_shape_named(capsys, tmp_path, tiny_dense_gguf):
    bad = rewrite(tiny_dense_gguf, tmp_path / "m.gguf", reshape="blk.0.ffn_up.weight")
    assert "blk.0.ffn_up.weight has shape (64, 1280), expected (1280, 64)" in run_error(
        capsys, ["generate", "-m", str(bad), "-p", "x"]
    )


def test_prompt_longer_than_context(capsys, tiny_dense_gguf):
    err = run_error(capsys, ["generate", "-m", str(tiny_dense_gguf), "-p", "word " * 200, "-c", "32"])
    assert "longer than the context size 32" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "-3"], "-n/--n-predict must be >= 0, got -3"),
        (["-t", "0"], "-t/--threads must be >= 1, got 0"),
        (["--temp", "-1"], "--temp must be a finite number >= 0, got -1.0"),
        (["--temp", "nan"], "--temp must be a finite number >= 0, got nan"),
        (["--repeat-penalty", "nan"], "--repeat-penalty must be a finite number > 0, got nan"),
        (["--repeat-penalty=-1"], "--repeat-penalty must be a finite number > 0, got -1.0"),
        (["--top-p", "nan"], "--top-p must be a finite number in (0, 1], got nan"),
        (["--min-p", "inf"], "--min-p must be a finite number in [0, 1], got inf"),
        (["--seed", str(2**64)], "--seed must be in [0, 2**64), got 18446744073709551616"),
        (["--seed=-5"], "--seed must be in [0, 2**64), got -5"),
        (["-c=-1"], "-c/--ctx-size must be >= 0, got -1"),
        (["--vram-budget", "inf"], "--vram-budget must be a finite number in [0, 1048576], got inf"),
        (["-ngl=-1"], "-ngl/--n-gpu-layers must be >= 0, got -1"),
    ],
)
def test_bad_numbers(capsys, tiny_dense_gguf, argv, message):
    assert message in run_error(capsys, ["generate", "-m", str(tiny_dense_gguf), "-p", "x", *argv])


def test_more_threads_than_cores_warns(capsys, monkeypatch, tiny_dense_gguf):
    from hotcold import validate

    monkeypatch.setattr(validate, "available_cores", lambda: 1)
    code = main(["generate", "-m", str(tiny_dense_gguf), "-p", "x", "-n", "2", "-t", "2", "--temp", "0"])
    _, err = capsys.readouterr()
    assert code == 0
    assert "hotcold: warning: -t/--threads 2 is more than the 1 CPU core(s) available" in err


def test_info(capsys, tiny_sparse_gguf):
    assert main(["info", "-m", str(tiny_sparse_gguf)]) == 0
    out, _ = capsys.readouterr()
    assert "PWRI" in out and "llama" in out and "ranks" in out


def test_prompt_file_not_utf8_named(capsys, tmp_path, tiny_dense_gguf):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe bad")
    assert "prompt.txt: not UTF-8 text" in run_error(
        capsys, ["generate", "-m", str(tiny_dense_gguf), "-f", str(bad)]
    )


def test_prompt_file_missing(capsys, tmp_path, tiny_dense_gguf):
    assert "nope.txt" in run_error(
        capsys, ["generate", "-m", str(tiny_dense_gguf), "-f", str(tmp_path / "nope.txt")]
    )


def test_generate_json_schema_and_grammar_files(tiny_sparse_gguf, tmp_path, capsys):
    import json

    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3})
    )
    base = ["generate", "-m", str(tiny_sparse_gguf), "-p", "x", "-n", "40", "--seed", "1"]
    assert main([*base, "--json-schema", str(schema)]) == 0
    value = json.loads(capsys.readouterr().out)
    assert isinstance(value, list) and 1 <= len(value) <= 3 and all(isinstance(v, bool) for v in value)
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    assert main([*base, "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_generate_bad_schema_names_the_flag(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nonsense"}')
    err = run_error(capsys, ["generate", "--json-schema", str(bad)])
    assert "--json-schema" in err and "bad.json" in err
    err = run_error(capsys, ["generate", "--grammar", str(tmp_path / "missing.gbnf")])
    assert "no such file" in err


def test_generate_reads_a_piped_prompt(tmp_path, tiny_dense_gguf):
    import subprocess
    import sys

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Line 7: the quick brown fox")
    with open(prompt) as stdin:
        result = subprocess.run(
            [sys.executable, "-m", "hotcold", "generate", "-m", str(tiny_dense_gguf), "-n", "2", "--temp", "0", "--echo"],
            stdin=stdin, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Line 7: the quick brown fox")


def test_generate_warns_past_the_training_context(capsys, tiny_dense_gguf):
    # the tiny model trains on 256 positions (tests/fixtures.make_llama)
    assert main(["generate", "-m", str(tiny_dense_gguf), "-p", "x", "-n", "1", "-c", "300"]) == 0
    assert "past the model's training context of 256 tokens" in capsys.readouterr().err
    assert main(["generate", "-m", str(tiny_dense_gguf), "-p", "x", "-n", "1", "-c", "200"]) == 0
    assert "training context" not in capsys.readouterr().err
