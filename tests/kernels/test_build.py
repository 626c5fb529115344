"""The first build of the C kernels says so (once, on stderr: a person waits ~30 s), and a missing compiler
says what it costs and how to fix it (#47 newcomer item)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from hotcold.kernels import build


def test_the_first_build_is_announced_once(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HOTCOLD_NO_CEXT", raising=False)
    monkeypatch.delenv("HOTCOLD_CFLAGS", raising=False)
    monkeypatch.setenv("HOTCOLD_CACHE_DIR", str(tmp_path))  # an empty cache: nothing built yet
    builds, works = [], [False]

    def compiler(cmd, **kwargs):  # a stand-in C compiler: fails, or writes a (useless) library
        if "-o" not in cmd:  # cc --version (bytes), uname -p (text)
            out = "cc 1.0" if kwargs.get("text") else b"cc 1.0"
            return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr=out)
        builds.append(cmd)
        if works[0]:
            Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0 if works[0] else 1, stdout="", stderr="no")

    monkeypatch.setattr(build.subprocess, "run", compiler)
    assert build._build_and_load() is None  # every flag set failed: the torch kernels
    err = capsys.readouterr().err
    assert len(builds) == len(build._FLAG_SETS)  # three attempts, one message
    assert err.count("compiling the C CPU kernels") == 1 and "once (about 30 s" in err
    assert "need a C compiler" in err and "slower torch kernels" in err and str(tmp_path) in err
    works[0] = True
    monkeypatch.setattr(build.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError("not a library")))
    build._build_and_load()  # built now (stand-in files in the cache)
    capsys.readouterr()
    builds.clear()
    build._build_and_load()
    assert builds == [] and "compiling" not in capsys.readouterr().err  # never announced again


def test_no_compiler_says_how_to_get_the_fast_kernels(monkeypatch, caplog):
    monkeypatch.delenv("HOTCOLD_NO_CEXT", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="hotcold.kernels.build"):
        assert build._build_and_load() is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert "no C compiler" in message and "slower torch" in message and "install gcc or clang" in message
