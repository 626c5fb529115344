"""hotcold place: clear errors for budgets that are not numbers of GiB, and a failed write is a failure."""

from __future__ import annotations

import shutil

import pytest
import torch

from hotcold.cli import main
from hotcold.placement.profile import write_activation_files


@pytest.fixture
def placed_model(tmp_path, tiny_sparse_gguf):
    model = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny_sparse_gguf, model)
    gen = torch.Generator().manual_seed(0)
    write_activation_files(
        [torch.randint(0, 100, (1280,), generator=gen) for _ in range(2)], tmp_path / "activation"
    )
    return model


@pytest.mark.parametrize("budget", ["inf", "1e12", "nan", "-1", "-inf"])
def test_bad_budget_is_a_clear_error(placed_model, capsys, budget):
    code = main(["place", "-m", str(placed_model), f"--vram-budget={budget}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "--vram-budget must be a finite number in [0, 1048576]" in err


def test_place_writes_its_file(placed_model, capsys):
    assert main(["place", "-m", str(placed_model), "--vram-budget", "0.05"]) == 0
    assert (placed_model.parent / (placed_model.name + ".generated.gpuidx")).is_file()


def test_place_fails_when_it_cannot_write_its_file(placed_model, capsys):
    (placed_model.parent / (placed_model.name + ".generated.gpuidx")).mkdir()  # in the way
    code = main(["place", "-m", str(placed_model), "--vram-budget", "0.05"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    assert "was not written" in err
    assert "could not write the placement cache" in out  # the reason, from the loader's notes
