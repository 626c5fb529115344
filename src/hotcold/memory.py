"""How much memory this process can still take: the machine's (Linux's MemAvailable) and its memory cgroups' limits
(v2 memory.max, v1 memory.limit_in_bytes, less what each already holds), the smallest of them. A container or a
`systemd-run -p MemoryMax=` limit is the one that kills a process that passes it, so it counts as much as RAM."""

from __future__ import annotations

import os
from pathlib import Path

UNKNOWN = 1 << 62  # no figure to be had: do not hold anything back on its account


def machine_available() -> int:
    """Bytes the system can give without swapping (MemAvailable), else free pages, else UNKNOWN."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return UNKNOWN


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def cgroup_headroom(proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")) -> int:
    """The least (limit - usage) over this process's memory cgroup and its ancestors, or UNKNOWN without a limit.
    proc_cgroup: the text of /proc/self/cgroup (read when None); root: where the hierarchies are mounted."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return UNKNOWN
    least = UNKNOWN
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":  # v2
            base, limit_name, usage_name = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1's memory controller
            base, limit_name, usage_name = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        group = base / path.lstrip("/")
        while True:  # a parent's limit binds the children too
            limit, usage = _read_int(group / limit_name), _read_int(group / usage_name)
            if limit is not None and limit < UNKNOWN:
                least = min(least, max(0, limit - (usage or 0)))
            if group == base or base not in group.parents:
                break
            group = group.parent
    return least


def available_memory() -> int:
    """Bytes this process can still take: the machine's available memory or its cgroups' headroom, the smaller."""
    return min(machine_available(), cgroup_headroom())


GIB = 1 << 30
RESERVE = GIB  # kept beside the weights for the rest: Python and torch (~0.4 GiB), the KV cache, a forward's scratch


def weight_bytes(model_file) -> int:
    """The bytes of a model file's tensors (gguf.io.ModelFile)."""
    return sum(int(t.n_bytes) for t in model_file.tensors.values())


def fits_packed(weight_bytes: int, notes: list[str], *, available: int | None = None) -> bool:
    """Whether a model's weights may take the C kernels' packed copies (anonymous memory, which the system cannot
    drop under pressure: a model larger than memory would be killed): where they fit, with RESERVE to spare, in what
    this process can still take. Else they stay in the file's pages, which the system drops and reads back as
    needed (llama.cpp's mmap), and `notes` says so."""
    free = available_memory() if available is None else available
    if weight_bytes + RESERVE <= free:
        return True
    notes.append(
        f"the weights ({weight_bytes / GIB:.1f} GiB) do not fit in the {free / GIB:.1f} GiB this process can still "
        f"take with {RESERVE / GIB:.0f} GiB to spare: they stay in the file's pages, which the system drops and reads "
        "back as needed (as llama.cpp's mmap; slower), not in packed copies; for a sparse model, --ram-budget GIB keeps "
        "what every token reads resident and reads the rest from the file on demand"
    )
    return False
