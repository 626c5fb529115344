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
- A disk that fills up (ENOSPC, EDQUOT, or numpy's short write, which carries no errno: the folder is probed)
  is one DiskFullError naming the output: "no space left on device writing FILE", the temporary file removed.

Sets of files (a model's activation statistics, one file per layer) go through `atomic_directory`: written
into a temporary folder `.<name>.<random>.tmpdir` beside the target, which then replaces the target folder
as a whole (an atomic exchange where the kernel has one), so a reader sees the old set or the new one, never
a mix, and a failure partway leaves the old set as it was.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
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


DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
PROBE_BYTES = 1 << 16


class DiskFullError(OSError):
    """No space (or quota) left on the device while writing `path`; str() is the line people read."""

    def __init__(self, code: int, path: PathLike):
        quota = " (disk quota exceeded)" if code != errno.ENOSPC else ""
        super().__init__(code, f"no space left on device{quota} writing {path}")
        self.path = Path(path)

    def __str__(self) -> str:
        return self.strerror


def _probe_no_space(folder: Path) -> int | None:
    """ENOSPC / EDQUOT when `folder`'s device takes no more bytes (an unlinked scratch file), else None."""
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            for _ in range(2):  # a first write may be short without an error; the second then fails
                os.write(f.fileno(), bytes(PROBE_BYTES))
    except OSError as exc:
        return exc.errno if exc.errno in DISK_FULL else None
    return None


def no_space(exc: BaseException, folder: Path) -> int | None:
    """The errno when `exc` is the device running out of space or quota while writing into `folder`, else None.
    numpy's tofile reports a short write as an OSError without errno: then the folder is probed."""
    if not isinstance(exc, OSError) or isinstance(exc, DiskFullError):
        return None
    if exc.errno in DISK_FULL:
        return exc.errno
    if not exc.errno:
        return _probe_no_space(folder)
    return None


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
    except OSError as exc:
        code = no_space(exc, folder)  # probed before the temporary file frees its space
        tmp.unlink(missing_ok=True)
        if code is not None:
            raise DiskFullError(code, out) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# Sets of files: a folder replaced as a whole
# ------------------------------------------------------------------------------------------------

TEMP_DIR_SUFFIX = ".tmpdir"
RENAME_EXCHANGE = 2  # renameat2 flag (Linux >= 3.15): swap two paths in one step


def check_directory(
    out_dir: PathLike,
    inputs: Iterable[PathLike] = (),
    *,
    owns: Callable[[str], bool],
    what: str = "output folder",
) -> Path:
    """Refuse (OutputError, naming why) a folder that `atomic_directory` must not replace: a file, the current
    folder or one above it, a folder that holds one of `inputs`, or one holding entries the set does not own
    (`owns(name)` is False: they would be removed with the old set). Cheap: call it before a long run."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{what} {out_dir} is a file; give a folder")
    target = out_dir.resolve()
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was removed: nothing to protect
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        raise OutputError(
            f"{what} {out_dir} is the current folder (or holds it): it is replaced as a whole; give a new folder"
        )
    for source in inputs:
        resolved = Path(source).resolve()
        if resolved == target or target in resolved.parents:
            raise OutputError(
                f"{what} {out_dir} holds {source}, which is the input: the folder is replaced as a whole, "
                "so it would be lost; choose another folder"
            )
    if out_dir.is_dir():
        foreign = sorted(p.name for p in target.iterdir() if not owns(p.name))
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputError(
                f"{what} {out_dir} holds other files ({shown}): the folder is replaced as a whole; "
                "give an empty or new folder"
            )
    return out_dir


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the kernel or filesystem cannot."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def remove_stale_temp_dirs(out_dir: PathLike) -> list[Path]:
    """Remove the temporary folders for `out_dir` left by runs that died (older than this run, unlocked)."""
    out_dir = Path(out_dir)
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    removed = []
    try:
        candidates = list(parent.glob(f".{glob.escape(out_dir.name)}.*{TEMP_DIR_SUFFIX}"))
    except OSError:
        return removed
    for tmp in candidates:
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_mtime >= RUN_STARTED or _locked_by_someone(fd):
                continue
            if fcntl is None and time.time() - info.st_mtime < STALE_WITHOUT_LOCKS_S:
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    for tmp in removed:
        log.info("removed %s, left by an interrupted earlier run", tmp)
    return removed


def _put_in_place(staging: Path, target: Path) -> None:
    """Move the filled `staging` folder to `target`, replacing an old folder there as a whole."""
    if not target.exists():
        os.rename(staging, target)
        return
    os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
    if _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old set
        return
    # no atomic exchange here: the old folder steps aside for the time of one rename, then goes
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TEMP_DIR_SUFFIX, dir=target.parent))
    os.rmdir(aside)
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(
    out_dir: PathLike,
    inputs: Iterable[PathLike] = (),
    *,
    owns: Callable[[str], bool],
    what: str = "output folder",
) -> Iterator[Path]:
    """Yields an empty temporary folder beside `out_dir` to fill (each file through `atomic_output`, or any
    writer); on success it replaces `out_dir` as a whole, on any exception it is removed and `out_dir` is left
    as it was. A disk-full error while filling it names the file under `out_dir`. check_directory's refusals
    apply (inputs, foreign files, the current folder)."""
    out_dir = check_directory(out_dir, inputs, owns=owns, what=what)
    target = Path(os.path.realpath(out_dir)) if out_dir.is_symlink() else out_dir
    parent = target.parent if str(target.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TEMP_DIR_SUFFIX, dir=parent))
    fd = os.open(staging, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # ours until we close it (or die): see remove_stale_temp_dirs
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes the folder private; our outputs are not
        yield staging
        _put_in_place(staging, target)
    except OSError as exc:
        code = no_space(exc, parent)
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, DiskFullError) and staging in exc.path.parents:
            raise DiskFullError(exc.errno, out_dir / exc.path.relative_to(staging)) from exc
        if code is not None:
            raise DiskFullError(code, out_dir) from exc
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(fd)
