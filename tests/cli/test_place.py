"""hotcold place: clear errors for budgets that are not numbers of GiB, and a failed write is a failure."""

from __future__ import annotations

import shutil

import pytest
import torch

from hotcold.cli import main
from hotcold.placement.gpuidx import read_gpuidx
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
    blocker = placed_model.parent / (placed_model.name + ".generated.gpuidx")
    blocker.mkdir()  # in the way
    code = main(["place", "-m", str(placed_model), "--vram-budget", "0.05"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert (
        err.strip().splitlines()[-1] == f"hotcold: error: output file {blocker} is a folder; give a file name"
    )


def test_a_model_in_the_installed_package_gets_its_cache_in_the_user_cache(
    tmp_path, tiny_sparse_gguf, monkeypatch, capsys
):
    """`place` on the bundled model wrote into the installed package; the cache goes to the user cache folder
    (HOTCOLD_CACHE_DIR here, else ~/.cache/hotcold), and the loader and info find it there."""
    import hotcold
    from hotcold.loader import load_model

    package = tmp_path / "site-packages" / "hotcold"
    (package / "data").mkdir(parents=True)
    model = package / "data" / "m.powerinfer.gguf"
    shutil.copy(tiny_sparse_gguf, model)
    gen = torch.Generator().manual_seed(0)
    write_activation_files(
        [torch.randint(0, 100, (1280,), generator=gen) for _ in range(2)], package / "data" / "activation"
    )
    from hotcold.kernels import build

    build.get_lib()  # built (or found) in the usual cache before the cache folder moves for this test
    monkeypatch.setattr(hotcold, "__file__", str(package / "__init__.py"))
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["place", "-m", str(model), "--vram-budget", "0.05"]) == 0
    out, err = capsys.readouterr()
    assert sorted(p.name for p in (package / "data").iterdir()) == ["activation", "m.powerinfer.gguf"]
    caches = list((tmp_path / "cache" / "gpuidx").iterdir())
    assert len(caches) == 1 and caches[0].name.startswith("m.powerinfer.gguf.")
    assert caches[0].name.endswith(".generated.gpuidx") and f"wrote {caches[0]}" in err
    assert read_gpuidx(caches[0]).n_layer == 2
    for _ in range(
        2
    ):  # the loader writes its own cache there too (its plan differs from place's), and finds it
        loaded = load_model(model, device="cpu", fast_device="cpu", vram_budget=0.04)
    assert any(f"placement from {caches[0].name}" in n for n in loaded.notes), "\n".join(loaded.notes)
    assert sorted(p.name for p in (package / "data").iterdir()) == ["activation", "m.powerinfer.gguf"]
    assert main(["info", "-m", str(model)]) == 0
    assert f"{caches[0].name}: " in capsys.readouterr().out


def place_json(capsys, *args) -> dict:
    import json

    assert main(["place", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_larger_budget_holds_no_fewer_hot_neurons_unless_it_says_why(tmp_path, monkeypatch, capsys):
    """#47: the demo model held 100% of its FFN neurons hot at 0.05 GiB and 0% at 0.06, where the first GPU
    layer's attention scratch took the budget. Now 0.06 holds fewer only to put the output head on the GPU,
    and says so with both figures; the value kept off the CPU grows with the budget."""
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path / "cache"))
    runs = {b: place_json(capsys, "--vram-budget", b) for b in ("0.05", "0.06", "0.1")}
    assert runs["0.05"]["hot_fraction"] == 1.0 and runs["0.1"]["hot_fraction"] == 1.0
    at_006 = runs["0.06"]
    assert at_006["hot_fraction"] > 0.25 and at_006["displaced_hot_neurons"] > 0
    assert any("output head on the GPU: read every token" in c for c in at_006["choice"])
    assert any("output head on the GPU" in n for n in at_006["notes"])  # the text output says it too
    values = [runs[b]["value_bytes_per_token"] for b in ("0.05", "0.06", "0.1")]
    assert values == sorted(values) and values[0] < values[1] < values[2]


def test_the_loaders_plan_reuses_the_cache_place_wrote(placed_model, capsys):
    """The plan is chosen by value in plan_budget itself, so the loader (which calls it as here) and `place`
    agree on the bytes left for hot rows, which key the cache."""
    from hotcold.config import config_from_file
    from hotcold.gguf.io import ModelFile
    from hotcold.placement.budget import GIB, plan_budget
    from hotcold.placement.gpuidx import resolve_placement

    mf = ModelFile(placed_model)
    config = config_from_file(mf)
    budget = int(0.05 * GIB)
    data = place_json(capsys, "-m", str(placed_model), "--vram-budget", "0.05", "-c", "512")
    assert data["value_bytes_per_token"] is not None  # chosen by value: statistics lie beside the model
    plan = plan_budget(mf, config, budget, ctx_size=512)  # what the loader plans at the same budget
    notes: list[str] = []
    hot = resolve_placement(placed_model, mf, config, plan, False, notes)
    assert any(n.startswith("placement from ") for n in notes), notes
    assert [len(h) for h in hot] == data["hot_neurons_per_layer"]
