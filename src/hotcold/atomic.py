"""Every file hotcold writes goes through `atomic_output`: one set of rules for all writers (convert,
quantize, the placement cache, activation statistics, predictors).

- The output must not be one of the writer's inputs: the same path, or a name that resolves to the same
  file (a symlink or a hard link: same st_dev and st_ino). Refused before anything is written.
- The bytes go to a temporary file `.<name>.<random>.tmp` in the output's folder, renamed over the
  output when complete: an interrupted writer never leaves a half file under the final name.
- On any exception (KeyboardInterrupt included) the temporary file is removed.
- A writer that was killed (kill -9, power loss) cannot clean up, so each writer, before it starts,
  removes the temporary files of earlier runs for the same output: files matching the pattern, older than
  this run, and not locked. A writer holds an advisory lock (flock) on its temporary file while it writes,
  so another process's write in progress is never removed; the lock dies with its process.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: fall back to the age rule alone
    fcntl = None

log = logging.getLogger(__name__)

RUN_STARTED = time.time()  # temporary files older than this are from an earlier run
STALE_WITHOUT_LOCKS_S = 24 * 3600  # without flock, a temporary file is stale only when this old

PathLike = str | os.PathLike[str]


class OutputError(OSError, ValueError):
    """An output that must not be written (it is an input, or a folder); the message names both.
    An OSError, so callers that carry on when a file cannot be written (the placement cache) do."""


def temp_pattern(path: Path) -> str:
    """The glob our writers' temporary files for `path` match (the name's own glob characters escaped)."""
    return f".{glob.escape(path.name)}.*.tmp"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(out: PathLike, inputs: Iterable[PathLike] = (), *, what: str = "output") -> Path:
    """Refuse `out` when it is a folder or is, or resolves to, one of `inputs` (OutputError naming both)."""
    out = Path(out)
    try:
        out_stat = os.stat(out)  # follows symlinks: a link to an input is the input
    except FileNotFoundError:
        out_stat = None
    except OSError as exc:
        raise OutputError(f"{what} {out}: cannot be checked ({exc.strerror or exc})") from exc
    if out_stat is not None and stat.S_ISDIR(out_stat.st_mode):
        raise OutputError(f"{what} {out} is a folder; give a file name")
    out_resolved = out.resolve()
    for source in inputs:
        source = Path(source)
        if out_resolved == source.resolve():
            raise OutputError(
                f"{what} {out} is the input {source}: it would be overwritten; choose another name"
            )
        if out_stat is None:
            continue
        try:
            in_stat = os.stat(source)
        except OSError:
            continue
        if _same_file(out_stat, in_stat):
            raise OutputError(
                f"{what} {out} is the same file as the input {source} (a link to it): it would be overwritten; "
                "choose another name"
            )
    return out


def _locked_by_someone(fd: int) -> bool:
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    return False


def remove_stale_temps(out: PathLike) -> list[Path]:
    """Remove our temporary files for `out` left by runs that died; returns what was removed."""
    out = Path(out)
    folder = out.parent if str(out.parent) else Path(".")
    removed = []
    try:
        candidates = list(folder.glob(temp_pattern(out)))
    except OSError:
        return removed
    for tmp in candidates:
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # gone already, a symlink, or not ours to read
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_mtime >= RUN_STARTED:
                continue
            if fcntl is None and time.time() - info.st_mtime < STALE_WITHOUT_LOCKS_S:
                continue
            if _locked_by_someone(fd):
                continue  # another process is writing it right now
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
        except OSError:
            continue
        finally:
            os.close(fd)
    for tmp in removed:
        log.info("removed %s, left by an interrupted earlier run", tmp)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(out: PathLike, inputs: Iterable[PathLike] = (), *, what: str = "output") -> Iterator[Path]:
    """Yields a temporary path to write; on success it is renamed over `out`, on any exception removed.

    `inputs`: every file the writer reads; an output that is one of them is refused (OutputError)."""
    out = check_output(out, inputs, what=what)
    folder = out.parent if str(out.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=folder)
    tmp = Path(name)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours until we close it (or die): see remove_stale_temps
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; our outputs are not
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
