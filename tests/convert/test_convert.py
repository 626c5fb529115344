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
