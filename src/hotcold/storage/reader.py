"""Rows of a model file read with `os.preadv` from a small thread pool (preadv releases the GIL, so the reads
of one layer are in flight together), adjacent rows coalesced into one read by the caller, the page cache told
to drop what was read (`POSIX_FADV_DONTNEED`) so it does not hold a second copy of the rows, and the file
checked against what was loaded (a file changed or truncated since: a clear error, never other rows)."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hotcold.gguf.io import GGUFError, ModelFile

log = logging.getLogger(__name__)

DEFAULT_DEPTH = 16  # reads in flight (threads); HOTCOLD_READ_DEPTH overrides
PAGE = 4096
MAX_READ = 8 << 20  # one read at most this long (long runs of hot rows at load are split)

Pread = Callable[[int, Sequence[memoryview], int], int]  # os.preadv's signature


def read_depth() -> int:
    value = os.environ.get("HOTCOLD_READ_DEPTH", "")
    try:
        return max(1, int(value)) if value else DEFAULT_DEPTH
    except ValueError:
        raise ValueError(f"HOTCOLD_READ_DEPTH must be a whole number >= 1, got {value!r}") from None


def tensor_offset(model_file: ModelFile, name: str) -> tuple[Path, int]:
    """(file, byte offset) of a tensor's data: its memory-mapped view's address less its mapping's start."""
    view = model_file.entry(name).data
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root.base, mmap.mmap) or getattr(root, "filename", None) is None:
        raise GGUFError(
            f"{model_file.path}: tensor {name} is not mapped from a file: it cannot be read on demand"
        )
    return Path(root.filename), int(view.ctypes.data - root.ctypes.data) + int(getattr(root, "offset", 0))


class Pending:
    """Reads in flight (RowReader.submit): wait() -> bytes read, or the first error once every read stopped."""

    def __init__(self, *, futures: list | None = None, done: int = 0):
        self._futures, self._done = futures or [], done

    def wait(self) -> int:
        errors = [f.exception() for f in self._futures]
        for exc in errors:
            if exc is not None:
                raise exc
        return self._done + sum(f.result() for f in self._futures)


class Job(NamedTuple):
    """One read: len(dest) bytes at `offset` into `dest` (a writable byte view); `what` names them in errors: a
    text, or (tensor, first row, last row), formatted only if the read fails (a token makes thousands of jobs)."""

    offset: int
    dest: memoryview
    what: str | tuple


def _describe(what: str | tuple) -> str:
    return what if isinstance(what, str) else f"tensor {what[0]} rows {what[1]}..{what[2]}"


class RowReader:
    """Reads of one model file. `read(jobs)` runs them, `depth` at a time, each to its end: short reads go on
    where they stopped, EINTR is retried, end of file is an error naming the tensor. `check()` raises if the file
    on disk is no longer the one opened (size, modification time, inode)."""

    def __init__(self, path: str | os.PathLike[str], *, depth: int | None = None, pread: Pread | None = None):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._identity = self._stat_identity(os.fstat(self.fd))
        if hasattr(os, "posix_fadvise"):  # no readahead: rows are scattered, a neighbour is rarely wanted
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._pread = pread or os.preadv
        self.depth = depth or read_depth()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _stat_identity(st: os.stat_result) -> tuple[int, int, int, int]:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self) -> None:
        """GGUFError if the file was changed, truncated or replaced since it was opened: its rows read now would
        not be the rows of the model that was loaded."""
        try:
            now = self._stat_identity(os.stat(self.path))
        except OSError as exc:
            raise GGUFError(
                f"{self.path}: the model file is gone since it was loaded ({exc.strerror})"
            ) from exc
        if now != self._identity or self._stat_identity(os.fstat(self.fd)) != self._identity:
            size = now[2]
            raise GGUFError(
                f"{self.path}: the model file changed on disk since it was loaded (size {self._identity[2]} -> "
                f"{size} bytes, or modified or replaced): its FFN rows are read from it on demand (--ram-budget), so "
                "the model cannot go on; load it again"
            )

    def read(self, jobs: Sequence[Job]) -> int:
        """Run every job (bytes into its dest); returns the bytes read (submit(jobs).wait())."""
        return self.submit(jobs).wait()

    def submit(self, jobs: Sequence[Job]) -> Pending:
        """Start the jobs, split among up to `depth` threads in groups of about equal bytes; the returned
        Pending's wait() gives the bytes read, or raises the first error once all have stopped."""
        groups = min(self.depth, len(jobs))
        if groups <= 1:
            return Pending(done=self._run(jobs))
        per_group = [jobs[g::groups] for g in range(groups)]  # interleaved: equal sizes, rows spread out
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="hotcold-read")
            return Pending(futures=[self._pool.submit(self._run, g) for g in per_group])

    def _run(self, jobs: Sequence[Job]) -> int:
        total = 0
        for job in jobs:
            self._read_exact(job)
            total += len(job.dest)
        return total

    def _read_exact(self, job: Job) -> None:
        offset, dest, _ = job
        want = len(dest)
        try:
            done = self._pread(self.fd, [dest], offset)
        except InterruptedError:  # a signal arrived before any byte: ask again below
            done = 0
        while 0 <= done < want:  # a short read (or an interrupted one) goes on where it stopped
            try:
                n = self._pread(self.fd, [dest[done:]], offset + done)
            except InterruptedError:
                continue
            if n <= 0:
                raise GGUFError(
                    f"{self.path}: {_describe(job.what)}: the file ends at byte {offset + done}, the rows need bytes "
                    f"up to {offset + want} (truncated since it was loaded?)"
                )
            done += n

    def drop_cached(self, offset: int, length: int) -> None:
        """Tell the kernel the page cache need not keep this range (the rows are copied where they are used)."""
        if length > 0 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):  # a model dropped without close(): the descriptor goes with it
        try:
            self.close()
        except Exception:
            pass


def runs(indices: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted row indices as runs of adjacent rows: (position of the run's first index, first row, length)."""
    if len(indices) == 0:
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(indices)]))
    return [(int(s), int(indices[s]), int(e - s)) for s, e in zip(starts, ends)]


def misaligned(offsets: list[int], row_bytes: list[int], page: int = PAGE) -> bool:
    """Whether rows whose size is a multiple of the page start off a page boundary (each then spans a page more):
    storage/align.py writes the file aligned."""
    return any(rb % page == 0 and off % page for off, rb in zip(offsets, row_bytes))
