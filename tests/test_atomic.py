"""atomic: the one rule set for every writer: never over an input, no half files, no temp files left."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from hotcold import atomic
from hotcold.atomic import (
    DiskFullError,
    OutputError,
    atomic_directory,
    atomic_output,
    check_output,
    remove_stale_temps,
)


def test_writes_through_a_temp_file_and_renames(tmp_path):
    out = tmp_path / "sub" / "out.bin"
    with atomic_output(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.bin.") and tmp.name.endswith(".tmp")
        tmp.write_bytes(b"data")
        assert not out.exists()
    assert out.read_bytes() == b"data"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.bin"]
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_any_exception_removes_the_temp_file(tmp_path, error):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(type(error)), atomic_output(out) as tmp:
        tmp.write_bytes(b"half")
        raise error
    assert out.read_bytes() == b"old"  # the previous file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_refuses_an_output_that_is_an_input(tmp_path):
    source = tmp_path / "model.safetensors"
    source.write_bytes(b"weights")
    link = tmp_path / "link.gguf"
    link.symlink_to(source)
    hard = tmp_path / "hard.gguf"
    os.link(source, hard)
    for out, what in [(source, "is the input"), (tmp_path / "." / "model.safetensors", "is the input")]:
        with pytest.raises(OutputError, match=what):
            check_output(out, [source])
    for out in (link, hard):  # a symlink resolves to the input; a hard link is the same inode
        with pytest.raises(OutputError, match="model.safetensors"):
            check_output(out, [source])
    with pytest.raises(OutputError, match="is the input"), atomic_output(source, [source]):
        pytest.fail("must not get here")
    assert source.read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.gguf", "link.gguf", "model.safetensors"]
    check_output(tmp_path / "new.gguf", [source])  # a new name is fine
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path, [])


def _stale(tmp_path, name: str, age_s: float = 3600):
    path = tmp_path / name
    path.write_bytes(b"x" * 100)
    old = atomic.RUN_STARTED - age_s
    os.utime(path, (old, old))
    return path


def test_stale_temp_files_of_earlier_runs_are_removed(tmp_path):
    out = tmp_path / "m.gguf"
    stale = _stale(tmp_path, ".m.gguf.abc123.tmp")
    other = _stale(tmp_path, ".other.gguf.abc123.tmp")  # another output's: not ours to judge
    fresh = tmp_path / ".m.gguf.new456.tmp"  # written during this run: maybe in progress
    fresh.write_bytes(b"y")
    unrelated = _stale(tmp_path, "m.gguf.tmp")
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"new")
    assert not stale.exists()
    assert other.exists() and fresh.exists() and unrelated.exists()
    assert out.read_bytes() == b"new"


def test_a_temp_file_being_written_is_kept(tmp_path):
    """Another writer holds the lock on its temp file: even when it looks old, it is not removed."""
    import fcntl

    busy = _stale(tmp_path, ".m.gguf.busy.tmp")
    fd = os.open(busy, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_stale_temps(tmp_path / "m.gguf") == []
        assert busy.exists()
    finally:
        os.close(fd)
    assert remove_stale_temps(tmp_path / "m.gguf") == [busy]


WRITER = textwrap.dedent(
    """
    import sys, time
    from hotcold.atomic import atomic_output
    with atomic_output(sys.argv[1]) as tmp:
        tmp.write_bytes(b"half" * 1000)
        if sys.argv[2] == "hang":
            print("writing", flush=True)
            time.sleep(3600)  # until killed: the test never waits for it
    """
)


def test_kill_9_leftover_is_removed_by_the_next_run(tmp_path):
    """kill -9 during a write leaves the temp file (nothing can remove it then); the next run does."""
    out = tmp_path / "model.gguf"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), "hang"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        leftovers = list(tmp_path.glob(".model.gguf.*.tmp"))
        assert len(leftovers) == 1
        # while the writer lives its temp file is locked: a concurrent run leaves it alone
        subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "model.gguf"), "done"], check=True)
        assert leftovers[0].exists()
    finally:
        child.kill()
        child.wait()
    assert leftovers[0].exists()  # killed: nothing removed it
    out.unlink()
    time.sleep(0.05)  # the next run starts after the leftover was last written
    subprocess.run([sys.executable, "-c", WRITER, str(out), "done"], check=True)
    assert list(tmp_path.glob(".model.gguf.*.tmp")) == []
    assert out.read_bytes() == b"half" * 1000


def test_names_with_glob_characters(tmp_path):
    out = tmp_path / "m[1]*.gguf"
    stale = _stale(tmp_path, ".m[1]*.gguf.abc.tmp")
    lookalike = _stale(tmp_path, ".m1x.gguf.abc.tmp")  # what the unescaped pattern would also match
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"ok")
    assert out.read_bytes() == b"ok" and not stale.exists() and lookalike.exists()


# ------------------------------------------------------------------------------------------------
# A full disk (#47 D8)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, extra", [(errno.ENOSPC, ""), (errno.EDQUOT, " (disk quota exceeded)")])
def test_a_full_disk_names_the_output(tmp_path, code, extra):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(DiskFullError) as caught, atomic_output(out) as tmp:
        tmp.write_bytes(b"half")
        raise OSError(code, os.strerror(code))
    assert str(caught.value) == f"no space left on device{extra} writing {out}"
    assert caught.value.errno == code and isinstance(caught.value, OSError)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_a_short_write_without_errno_is_probed(tmp_path, monkeypatch):
    """numpy's tofile reports a full disk as 'N requested and 0 written', no errno: the folder is probed."""
    out = tmp_path / "out.bin"
    monkeypatch.setattr(atomic, "_probe_no_space", lambda folder: errno.ENOSPC)
    with pytest.raises(DiskFullError, match=f"^no space left on device writing {out}$"), atomic_output(out):
        raise OSError("1048576 requested and 0 written")
    monkeypatch.undo()  # a disk with room: the short write stays what it was
    with pytest.raises(OSError, match="requested and 0 written") as caught, atomic_output(out):
        raise OSError("1048576 requested and 0 written")
    assert not isinstance(caught.value, DiskFullError)
    assert list(tmp_path.iterdir()) == []


def test_the_probe_reads_a_real_full_device(monkeypatch, tmp_path):
    real_write = os.write

    def full(fd, data):
        if os.fstat(fd).st_nlink == 0:  # the probe's unlinked scratch file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    assert atomic._probe_no_space(tmp_path) is None
    monkeypatch.setattr(os, "write", full)
    assert atomic._probe_no_space(tmp_path) == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# Sets of files: a folder replaced as a whole (#47 D4)
# ------------------------------------------------------------------------------------------------


def owns(name: str) -> bool:
    return name.startswith("part_")


def _set(folder, values: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in values.items():
        (folder / name).write_bytes(data)


def _contents(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("exchange", [True, False])
def test_a_folder_is_replaced_as_a_whole(tmp_path, monkeypatch, exchange):
    if not exchange:  # a kernel or filesystem without renameat2's exchange: two renames
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "stats"
    _set(out, {"part_0": b"old0", "part_1": b"old1", "part_2": b"old2"})
    os.chmod(out, 0o750)
    with atomic_directory(out, owns=owns) as staging:
        assert (
            staging.parent == tmp_path
            and staging.name.startswith(".stats.")
            and staging.name.endswith(".tmpdir")
        )
        (staging / "part_0").write_bytes(b"new0")
        (staging / "part_1").write_bytes(b"new1")
        assert _contents(out)["part_0"] == b"old0"  # nothing visible until the set is complete
    assert _contents(out) == {"part_0": b"new0", "part_1": b"new1"}  # the old part_2 went with its set
    assert out.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]
    with atomic_directory(tmp_path / "fresh" / "set", owns=owns) as staging:  # a new folder, parents made
        (staging / "part_0").write_bytes(b"x")
    assert _contents(tmp_path / "fresh" / "set") == {"part_0": b"x"}
    assert (tmp_path / "fresh" / "set").stat().st_mode & 0o777 == 0o777 & ~_umask()


@pytest.mark.parametrize("error", [RuntimeError("layer 2 failed"), KeyboardInterrupt()])
def test_a_failure_partway_leaves_the_old_set(tmp_path, error):
    out = tmp_path / "stats"
    _set(out, {"part_0": b"old0", "part_1": b"old1"})
    with pytest.raises(type(error)), atomic_directory(out, owns=owns) as staging:
        (staging / "part_0").write_bytes(b"new0")
        raise error
    assert _contents(out) == {"part_0": b"old0", "part_1": b"old1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]


def test_a_full_disk_in_a_set_names_the_file_under_the_final_folder(tmp_path):
    out = tmp_path / "stats"
    with pytest.raises(DiskFullError) as caught, atomic_directory(out, owns=owns) as staging:
        with atomic_output(staging / "part_0") as tmp:
            tmp.write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(caught.value) == f"no space left on device writing {out / 'part_0'}"
    with pytest.raises(DiskFullError, match=f"writing {out}$"), atomic_directory(out, owns=owns):
        raise OSError(errno.ENOSPC, "No space left on device")  # a writer of its own: the folder is named
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_replaced_is_refused(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    _set(tmp_path / "act", {"part_0": b"0"})
    (tmp_path / "act" / "part_1").write_bytes(b"corpus")
    cases = [
        (tmp_path / "act", [tmp_path / "act" / "part_1"], "which is the input"),  # an input inside the set
        (model, [], "is a file"),
    ]
    _set(tmp_path / "mixed", {"part_0": b"0", "notes.txt": b"mine"})
    cases.append((tmp_path / "mixed", [], "holds other files (notes.txt)"))
    for out, inputs, message in cases:
        with pytest.raises(OutputError, match=re.escape(message)), atomic_directory(out, inputs, owns=owns):
            pytest.fail("must not get here")
    monkeypatch.chdir(tmp_path / "act")
    for out in (".", tmp_path):  # the current folder, or one holding it
        with pytest.raises(OutputError, match="current folder"), atomic_directory(out, owns=owns):
            pytest.fail("must not get here")
    assert model.read_bytes() == b"weights" and _contents(tmp_path / "mixed")["notes.txt"] == b"mine"
    assert not list(tmp_path.glob(".*"))


def test_a_symlinked_folder_is_replaced_where_it_points(tmp_path):
    real = tmp_path / "real"
    _set(real, {"part_0": b"old"})
    link = tmp_path / "link"
    link.symlink_to(real)
    with atomic_directory(link, owns=owns) as staging:
        (staging / "part_0").write_bytes(b"new")
    assert link.is_symlink() and _contents(real) == {"part_0": b"new"}


def test_stale_temp_folders_of_earlier_runs_are_removed(tmp_path):
    stale = tmp_path / ".stats.abc.tmpdir"
    _set(stale, {"part_0": b"killed"})
    old = atomic.RUN_STARTED - 3600
    os.utime(stale, (old, old))
    other = tmp_path / ".other.abc.tmpdir"
    _set(other, {"part_0": b"x"})
    os.utime(other, (old, old))
    with atomic_directory(tmp_path / "stats", owns=owns) as staging:
        (staging / "part_0").write_bytes(b"new")
    assert not stale.exists() and other.exists()
