"""atomic: the one rule set for every writer: never over an input, no half files, no temp files left."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hotcold import atomic
from hotcold.atomic import OutputError, atomic_output, check_output, remove_stale_temps


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
