"""The default CPU thread count: the cores this process may run on that other processes are not keeping
busy right now.

On a 2-core machine with one other busy process, two threads are several times slower than one: every
kernel call splits its work over the threads and waits at its end for the one the OS has descheduled
(a whole time slice, milliseconds, against a fraction of a millisecond of work). So the default counts
the cores' worth of CPU time other processes used over a short window (/proc/stat minus this process's
own time) and leaves those cores to them. Niced time is not counted: a process at a lower priority
yields to ours. Where /proc is not there, the default is every available core. `-t` / `threads=`
always wins.
"""

from __future__ import annotations

import logging
import os
import time

from hotcold.validate import available_cores

log = logging.getLogger(__name__)

_SAMPLE_SECONDS = 0.2


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, busy without idle, iowait and nice time."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, idle, iowait, irq, softirq = (int(v) for v in fields[1:8])
    steal = int(fields[8]) if len(fields) > 8 else 0
    return user + system + irq + softirq + steal, user + nice + system + idle + iowait + irq + softirq + steal


def _own_jiffies() -> int | None:
    """Clock ticks this process has run (user + system)."""
    try:
        with open("/proc/self/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces: fields after ")"
        return int(rest[11]) + int(rest[12])
    except (OSError, IndexError, ValueError):
        return None


def busy_elsewhere(window: float = _SAMPLE_SECONDS) -> float | None:
    """Cores' worth of CPU time other processes (not niced) used over `window` seconds; None where the
    kernel does not say."""
    a, own_a = _cpu_jiffies(), _own_jiffies()
    if a is None or own_a is None:
        return None
    time.sleep(window)
    b, own_b = _cpu_jiffies(), _own_jiffies()
    if b is None or own_b is None or b[1] <= a[1]:
        return None
    ncpu = os.cpu_count() or 1
    busy = max(0, (b[0] - a[0]) - (own_b - own_a))
    return ncpu * busy / (b[1] - a[1])


_REUSE_SECONDS = 30.0  # loads within this long reuse the last sample (a test suite loads hundreds of models)
_last: tuple[float, int] | None = None


def default_threads() -> int:
    """Available cores minus those other processes keep busy (rounded), at least 1."""
    global _last
    now = time.monotonic()
    if _last is not None and now - _last[0] < _REUSE_SECONDS:
        return _last[1]
    cores = available_cores()
    busy = busy_elsewhere()
    threads = cores if busy is None else max(1, min(cores, int(cores - busy + 0.5)))
    if threads < cores:
        log.info(
            "other processes keep %.1f of %d cores busy: using %d thread(s) (-t to override)",
            busy,
            cores,
            threads,
        )
    _last = (now, threads)
    return threads
