"""hotcold train-predictors: predictors that reach their recall target, in PowerInfer's folder format."""

from __future__ import annotations

import json

import pytest
import torch

import hotcold
from hotcold.cli import main
from hotcold.gguf.io import ModelFile
from hotcold.placement.profile import corpus_tokens, run_windows, token_windows
from hotcold.training.predictors import SPARSE_THRESHOLD, pack_mask, unpack_mask
from tests.fixtures import training_text

CTX = 64
TOKENS = 4000
RECALL = 0.95


@pytest.fixture(autouse=True, scope="module")
def keep_thread_count():
    """The runs below use -t 1 (tiny matrices: one thread is fastest), which sets torch's global count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(training_text())
    return path


@pytest.fixture(scope="module")
def trained(tiny_dense_gguf, corpus, tmp_path_factory):
    """Predictors trained from the Hugging Face folder (the converter path) of the tiny model."""
    out = tmp_path_factory.mktemp("pred") / "pred"
    hf_dir = tiny_dense_gguf.parent / "hf"
    argv = ["train-predictors", str(hf_dir), "-f", str(corpus), "-o", str(out), "--ranks", "32,128"]
    argv += [
        "--recall",
        str(RECALL),
        "--max-selection",
        "1.3",
        "-c",
        str(CTX),
        "--max-tokens",
        str(TOKENS),
        "-t",
        "1",
    ]
    assert main(argv) == 0
    return out


def test_pack_unpack_round_trip():
    mask = torch.rand(37, 1283) < 0.3
    packed = pack_mask(mask)
    assert packed.shape == (37, 161) and packed.dtype == torch.uint8
    assert torch.equal(unpack_mask(packed, 1283), mask)


def test_predictor_folder_format(trained):
    config = json.loads((trained / "config.json").read_text())
    assert config["sparse_threshold"] == SPARSE_THRESHOLD
    assert [s["layer"] for s in config["layers"]] == [0, 1]
    for i, stats in enumerate(config["layers"]):
        state = torch.load(trained / f"model_{i}.pt")
        assert sorted(state) == ["fc1.weight", "fc2.weight"]
        rank = stats["rank"]
        assert rank in (32, 128)
        assert state["fc1.weight"].shape == (rank, 64) and state["fc2.weight"].shape == (1280, rank)
        assert stats["recall"] >= RECALL  # on the held-out tokens, at the chosen threshold
        assert stats["selection_ratio"] < 1.6


def test_recall_on_the_training_distribution(tiny_dense_gguf, trained):
    """Independent of the trainer's bookkeeping: the saved predictors, applied with the file's rule
    (fc2 @ relu(fc1 @ p) >= sparse_threshold) to the residuals of a dense forward, find the firing neurons."""
    llm = hotcold.load(tiny_dense_gguf, dense=True)
    ids = corpus_tokens(llm.tokenizer, training_text(), max_tokens=TOKENS, spread=True)  # as the CLI samples
    states = [torch.load(trained / f"model_{i}.pt") for i in range(2)]
    hits, firing, selected = [0, 0], [0, 0], [0, 0]

    def observe(i, _x, p, a):
        logits = torch.relu(p @ states[i]["fc1.weight"].T) @ states[i]["fc2.weight"].T
        chosen, truth = logits >= SPARSE_THRESHOLD, a != 0
        hits[i] += int((chosen & truth).sum())
        firing[i] += int(truth.sum())
        selected[i] += int(chosen.sum())

    run_windows(llm, token_windows(ids, CTX, llm.tokenizer.bos_id), observe, desc="", progress=False)
    for i in range(2):
        assert hits[i] / firing[i] >= RECALL - 0.01, (i, hits[i] / firing[i])
        assert selected[i] / firing[i] < 1.6


def test_round_trip_through_convert(tiny_dense_gguf, trained, tmp_path):
    from hotcold.convert import convert

    out = convert(tiny_dense_gguf.parent / "hf", trained, tmp_path / "tiny.powerinfer.gguf", outtype="f32")
    mf = ModelFile(out)
    assert mf.is_sparse
    assert mf.metadata["powerinfer.sparse_threshold"] == SPARSE_THRESHOLD
    for i in range(2):
        state = torch.load(trained / f"model_{i}.pt")
        for name in ("fc1", "fc2"):
            assert torch.equal(mf.tensor(f"blk.{i}.{name}.weight"), state[f"{name}.weight"])
    llm = hotcold.load(out)
    assert llm.config.sparse_threshold == SPARSE_THRESHOLD
    assert llm.generate("Line 3: the quick", max_tokens=4, ignore_eos=True)


def test_resume_skips_finished_layers(tiny_dense_gguf, corpus, trained, tmp_path, capsys):
    import shutil

    folder = tmp_path / "pred"
    shutil.copytree(trained, folder)
    (folder / "model_1.pt").unlink()
    before = (folder / "model_0.pt").read_bytes()
    argv = ["train-predictors", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(folder)]
    argv += ["--rank", "32", "--recall", str(RECALL), "-c", str(CTX), "--max-tokens", "1500", "-t", "1"]
    assert main(argv) == 0
    assert (folder / "model_0.pt").read_bytes() == before
    assert torch.load(folder / "model_1.pt")["fc1.weight"].shape[0] == 32
    config = json.loads((folder / "config.json").read_text())
    assert [s["layer"] for s in config["layers"]] == [0, 1]
    assert config["layers"][0] == json.loads((trained / "config.json").read_text())["layers"][0]
    capsys.readouterr()


def run_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    return err


def test_bad_inputs(tiny_dense_gguf, corpus, tmp_path, capsys):
    out = str(tmp_path / "pred")
    model = str(tiny_dense_gguf)
    assert "no such file" in run_error(
        capsys, ["train-predictors", "-m", model, "-f", str(tmp_path / "x.txt"), "-o", out]
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty" in run_error(capsys, ["train-predictors", "-m", model, "-f", str(empty), "-o", out])
    assert "exactly one model" in run_error(capsys, ["train-predictors", "-f", str(corpus), "-o", out])
    assert "exactly one model" in run_error(
        capsys, ["train-predictors", str(tmp_path), "-m", model, "-f", str(corpus), "-o", out]
    )
    assert "--recall" in run_error(
        capsys, ["train-predictors", "-m", model, "-f", str(corpus), "-o", out, "--recall", "2"]
    )
    short = tmp_path / "short.txt"
    short.write_text("Line 1: the quick brown fox")
    assert "too few" in run_error(capsys, ["train-predictors", "-m", model, "-f", str(short), "-o", out])
    foreign = tmp_path / "foreign"  # PowerInfer's own folder: threshold 0, no config.json
    foreign.mkdir()
    torch.save({"fc1.weight": torch.zeros(8, 64), "fc2.weight": torch.zeros(1280, 8)}, foreign / "model_0.pt")
    assert "did not train" in run_error(
        capsys,
        ["train-predictors", "-m", model, "-f", str(corpus), "-o", str(foreign), "--max-tokens", "300"],
    )
    bad = tmp_path / "other"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"sparse_threshold": 0.0}))
    assert "empty folder" in run_error(
        capsys, ["train-predictors", "-m", model, "-f", str(corpus), "-o", str(bad), "--max-tokens", "300"]
    )


def test_predictors_are_written_as_one_set(tiny_dense_gguf, corpus, trained, tmp_path, monkeypatch, capsys):
    """A failure partway (here: training layer 1) left model_0.pt and a config.json for one layer in the folder
    (#47); the folder is replaced as a whole, so it stays as it was: absent, or the old set, byte for byte."""
    import shutil

    from hotcold.training import predictors as trainer

    def fake_layer(i, samples, n_train, cfg, *, device, progress):
        if i == 1:
            raise RuntimeError("simulated failure in layer 1")
        state = {"fc1.weight": torch.zeros(8, samples.inputs.shape[1]), "fc2.weight": torch.zeros(1280, 8)}
        return state, trainer.LayerResult(i, 8, -1.0, 1.0, 1.0, 1.0, 0.1, 1.0)

    monkeypatch.setattr(trainer, "train_layer", fake_layer)
    argv = ["train-predictors", "-m", str(tiny_dense_gguf), "-f", str(corpus), "--rank", "8"]
    argv += ["-c", str(CTX), "--max-tokens", "300", "-t", "1"]
    new = tmp_path / "new"
    assert "simulated failure in layer 1" in run_error(capsys, [*argv, "-o", str(new)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no temporary folder left

    old = (
        tmp_path / "old"
    )  # a finished set missing one layer (a run of an older hotcold, or one layer removed)
    shutil.copytree(trained, old)
    (old / "model_1.pt").unlink()
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    assert "simulated failure in layer 1" in run_error(capsys, [*argv, "-o", str(old)])
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_a_predictor_folder_with_other_files_is_refused_before_training(
    tiny_dense_gguf, corpus, tmp_path, capsys
):
    out = tmp_path / "pred"
    out.mkdir()
    (out / "README.md").write_text("mine")
    argv = ["train-predictors", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(out), "-t", "1"]
    err = run_error(capsys, argv)
    assert "holds other files (README.md)" in err and "training" not in err
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
