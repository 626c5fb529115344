"""The default thread count leaves cores that other processes keep busy to them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from hotcold import cores


def test_default_threads_counts_other_busy_processes(monkeypatch):
    monkeypatch.setattr(cores, "_last", None)
    monkeypatch.setattr(cores, "available_cores", lambda: 4)
    for busy, want in [(0.0, 4), (0.3, 4), (1.0, 3), (2.6, 1), (7.5, 1)]:
        monkeypatch.setattr(cores, "busy_elsewhere", lambda busy=busy: busy)
        monkeypatch.setattr(cores, "_last", None)
        assert cores.default_threads() == want, busy
    monkeypatch.setattr(cores, "busy_elsewhere", lambda: None)  # no /proc: every core
    monkeypatch.setattr(cores, "_last", None)
    assert cores.default_threads() == 4


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process `pid` has run, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _spinning_thread_and_process() -> tuple[float, float, float, float]:
    """busy_elsewhere: as the machine is, with a spinning thread of this process, with a spinning process;
    and the cores' worth of CPU the spinning process got while the last figure was taken."""
    base = cores.busy_elsewhere(0.3)
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinner.start()
    try:
        own = cores.busy_elsewhere(0.5)
    finally:
        stop.set()
        spinner.join()
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"]
    )
    try:
        time.sleep(0.3)
        cpu0, wall0 = _cpu_seconds(spin.pid), time.monotonic()
        other = cores.busy_elsewhere(0.5)
        spin_cores = (_cpu_seconds(spin.pid) - cpu0) / (time.monotonic() - wall0)
    finally:
        spin.kill()
        spin.wait()
    assert base is not None and own is not None and other is not None
    return base, own, other, spin_cores


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_elsewhere_sees_other_processes_not_this_one():
    """A spinning thread of this process is not counted; a spinning process (not niced) is, as all the CPU
    it got (about a core on a quiet machine). The spinner's own CPU time is the yardstick, not a rise over
    the machine's figure before it: where other work already keeps every core busy, the spinner takes its
    share from that work and the machine's figure cannot rise. Other work moves the figures, so the best
    of three tries must show it."""
    tries = [_spinning_thread_and_process() for _ in range(3)]
    assert any(own < base + 0.5 for base, own, _, _ in tries), tries
    # the spinner ran (at least a fifth of a core) and all of its time is in the figure (a tick's rounding)
    assert any(spin >= 0.2 and other >= spin - 0.15 for _, _, other, spin in tries), tries
