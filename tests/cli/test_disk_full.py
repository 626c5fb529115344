"""A full disk (ENOSPC / EDQUOT) while any writer writes: one line naming the cause and the file, exit 1, no
file under the final name and no temporary file left (#47 D8). The failure is simulated where the bytes go:
the GGUF writer's tensor data (every GGUF writer), torch.save (activation statistics)."""

from __future__ import annotations

import errno
import shutil

import gguf
import pytest
import torch

from hotcold import atomic
from hotcold.cli import main
from hotcold.placement.profile import write_activation_files
from tests.fixtures import make_llama, training_text


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def quota(*args, **kwargs):
    raise OSError(errno.EDQUOT, "Disk quota exceeded")


def short_write(*args, **kwargs):  # numpy's tofile on a full disk: no errno
    raise OSError("4096 requested and 0 written")


@pytest.fixture
def stats_model(tmp_path, tiny_sparse_gguf):
    model = tmp_path / "in" / "m.powerinfer.gguf"
    model.parent.mkdir()
    shutil.copy(tiny_sparse_gguf, model)
    gen = torch.Generator().manual_seed(0)
    write_activation_files(
        [torch.randint(0, 100, (1280,), generator=gen) for _ in range(2)], model.parent / "activation"
    )
    return model


def check_one_line(capsys, code: int, out, *, extra: str = "") -> None:
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hotcold: error")]
    assert lines == [f"hotcold: error: no space left on device{extra} writing {out}"], err
    assert not out.exists()
    assert not list(out.parent.glob(".*.tmp")) and not list(out.parent.glob(".*.tmpdir"))


@pytest.mark.parametrize(
    "fail, extra", [(full_disk, ""), (quota, " (disk quota exceeded)"), (short_write, "")]
)
def test_convert(tmp_path, tiny_dense_gguf, monkeypatch, capsys, fail, extra):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_dense_gguf.parent / "hf", hf)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fail)
    if fail is short_write:  # the folder is probed: make it answer as a full disk does
        monkeypatch.setattr(atomic, "_probe_no_space", lambda folder: errno.ENOSPC)
    out = tmp_path / "out.gguf"
    check_one_line(capsys, main(["convert", str(hf), "-o", str(out), "--outtype", "f32"]), out, extra=extra)


def test_quantize(tmp_path, tiny_dense_gguf, monkeypatch, capsys):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    out = tmp_path / "q.gguf"
    check_one_line(capsys, main(["quantize", str(tiny_dense_gguf), str(out), "q8_0"]), out)


def test_reorder(stats_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    out = tmp_path / "out" / "m.hot.gguf"
    out.parent.mkdir()
    check_one_line(capsys, main(["reorder", str(stats_model), str(out)]), out)
    assert not (out.parent / "activation").exists()  # the statistics never land without their model


def test_place(stats_model, monkeypatch, capsys):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    out = stats_model.parent / (stats_model.name + ".generated.gpuidx")
    check_one_line(capsys, main(["place", "-m", str(stats_model), "--vram-budget", "0.05"]), out)


def test_profile(tmp_path, tiny_dense_gguf, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    out = tmp_path / "act"
    monkeypatch.setattr(torch, "save", full_disk)
    code = main(
        ["profile", "-m", str(tiny_dense_gguf), "-f", str(corpus), "-o", str(out), "--max-tokens", "50"]
    )
    check_one_line(capsys, code, out / "activation_0.pt")
    assert not out.exists() and list(tmp_path.iterdir()) == [corpus]


def test_sparsify(tmp_path, spm_model_file, monkeypatch, capsys):
    from hotcold.convert import convert

    make_llama(tmp_path / "hf", spm_model_file, hidden_act="silu")
    dense = convert(tmp_path / "hf", None, tmp_path / "dense.gguf", outtype="f32")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(training_text())
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    out = tmp_path / "s.gguf"
    argv = ["sparsify", "-m", str(dense), "-f", str(corpus), "-o", str(out), "--max-tokens", "200", "-t", "1"]
    check_one_line(capsys, main(argv), out)


def test_the_progress_bar_ends_its_line_before_the_error(tmp_path, tiny_dense_gguf, monkeypatch):
    """The writer closes its progress bar when a write fails, so the error starts a line of its own (an open
    tqdm bar on a terminal would have the error printed after it, on the same line)."""
    from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file

    class Bar:
        def __init__(self, items):
            self.items, self.closed = list(items), False

        def __iter__(self):
            return iter(self.items)

        def close(self):
            self.closed = True

    bars = []

    def progress(items):
        bars.append(Bar(items))
        return bars[-1]

    mf = ModelFile(tiny_dense_gguf)
    specs = [TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data) for e in mf.tensors.values()]
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    with pytest.raises(atomic.DiskFullError):
        write_model_file(tmp_path / "o.gguf", mf.architecture, metadata_items(mf), specs, progress=progress)
    assert bars[0].closed
