"""Page residency of memory-mapped weights: read a weight in ahead of use, or release the file's pages
of a matrix that a packed copy now serves."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

from hotcold.quants import QuantTensor

Weight = torch.Tensor | QuantTensor

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4


def prefetch_pages(weight: Weight) -> Weight:
    """Ask the OS to read a CPU weight's pages in ahead of use (MADV_WILLNEED, asynchronous; no RSS until
    touched) and return it. For matrices read a few rows at a time in no order, the embedding: without
    it every new token's row can wait for the disk (about 1 ms) when the file is not in the page cache,
    where a matrix read whole is brought in by the kernel's own read-ahead. Linux only; a no-op
    elsewhere, or off the CPU."""
    data = weight.data if isinstance(weight, QuantTensor) else weight
    if not sys.platform.startswith("linux") or not data.is_cpu or data.numel() == 0:
        return weight
    page = mmap.PAGESIZE
    addr = data.data_ptr()
    start = addr // page * page
    end = addr + data.numel() * data.element_size()
    step = 4 << 20  # the kernel reads ahead at most a few MiB a call (measured: 8 MiB of a 200 MiB range)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for lo in range(start, end, step):
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(min(step, end - lo)), _MADV_WILLNEED)
    except (OSError, AttributeError):
        pass
    return weight


def page_out(addr: int, nbytes: int) -> None:
    """Drop this process's mapping of the pages wholly inside [addr, addr + nbytes) when they belong to
    a memory-mapped model file (MADV_DONTNEED: the pages stay in the page cache for anyone else and are
    mapped again from the file if touched; RSS counts them no more). Anonymous memory is left alone
    (DONTNEED would zero it), and so are shared writable mappings. Linux only; a no-op elsewhere."""
    page = mmap.PAGESIZE
    start, end = (addr + page - 1) // page * page, (addr + nbytes) // page * page
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= start and end <= hi:
                    # a file's pages: read-only, or private (the model reader maps files copy-on-write and
                    # nothing writes through them, so each page is the file's and comes back from it)
                    perms = fields[1]
                    if len(fields) >= 6 and fields[4] != "0" and ("w" not in perms or perms.endswith("p")):
                        libc = ctypes.CDLL(None, use_errno=True)
                        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
                    return
    except (OSError, ValueError, AttributeError):
        pass
