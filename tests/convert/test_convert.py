"""hotcold convert never writes over what it reads (the checkpoint's weights, a predictor file), however the
output is named (the path itself, a symlink, a hard link), and leaves no temporary files behind."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from hotcold.cli import main
from tests.fixtures import write_predictors


def digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


@pytest.fixture
def checkpoint(tmp_path, tiny_dense_gguf):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_dense_gguf.parent / "hf", hf)
    pred = write_predictors(tmp_path / "pred", 2, 64, 1280, threshold=0.0)
    return hf, pred


def weights_file(hf):
    return next(hf.glob("*.safetensors"))


@pytest.mark.parametrize(
    "target",
    ["weights", "config", "predictor", "predictor_config", "symlink_to_weights", "hardlink_to_predictor"],
)
def test_output_over_an_input_is_refused(checkpoint, tmp_path, capsys, target):
    hf, pred = checkpoint
    out = {
        "weights": weights_file(hf),
        "config": hf / "config.json",
        "predictor": pred / "model_0.pt",
        "predictor_config": pred / "config.json",
    }.get(target)
    if target == "symlink_to_weights":
        out = tmp_path / "out.gguf"
        out.symlink_to(weights_file(hf))
    elif target == "hardlink_to_predictor":
        out = tmp_path / "out.gguf"
        os.link(pred / "model_1.pt", out)
    before = digest(hf), digest(pred)
    code = main(["convert", str(hf), str(pred), "-o", str(out), "--outtype", "f32"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "it would be overwritten" in err and str(out) in err
    assert (digest(hf), digest(pred)) == before
    assert not list(tmp_path.rglob(".*.tmp"))


def test_writing_into_the_checkpoint_folder_again_is_allowed(checkpoint, capsys):
    """An earlier output in the checkpoint folder is not an input (PowerInfer's convert.py writes there)."""
    hf, _ = checkpoint
    out = hf / "model.gguf"
    assert main(["convert", str(hf), "-o", str(out), "--outtype", "f32"]) == 0
    first = out.read_bytes()
    assert main(["convert", str(hf), "-o", str(out), "--outtype", "f32"]) == 0
    assert out.read_bytes() == first
    assert not list(hf.glob(".*.tmp"))


def _torn(data: bytes, how: str) -> bytes:
    if how == "garbage":
        return b"\x00" * 100
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "header":  # the 8-byte header length, then no JSON
        return data[:8] + b"{not json" + data[17:]
    return b""  # empty


@pytest.mark.parametrize("how", ["garbage", "truncated", "header", "empty"])
def test_a_corrupt_safetensors_file_is_one_line_naming_it(checkpoint, tmp_path, capsys, how):
    hf, _ = checkpoint
    weights = weights_file(hf)
    weights.write_bytes(_torn(weights.read_bytes(), how))
    out = tmp_path / "out.gguf"
    code = main(["convert", str(hf), "-o", str(out), "--outtype", "f32"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.count("\n") == 1 and str(weights) in err and "torn or corrupt" in err, err
    assert not out.exists() and not list(tmp_path.rglob(".*.tmp"))


def test_a_corrupt_pytorch_bin_is_one_line_naming_it(checkpoint, tmp_path, capsys):
    hf, _ = checkpoint
    weights_file(hf).unlink()
    torn = hf / "pytorch_model.bin"
    torn.write_bytes(b"PK\x03\x04 not a zip")
    code = main(["convert", str(hf), "-o", str(tmp_path / "out.gguf"), "--outtype", "f32"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.count("\n") == 1 and str(torn) in err, err
