"""Page residency of memory-mapped weights: read a weight in ahead of use, release the file's pages of a
matrix that a copy now serves, and the anonymous memory such copies (and the KV caches) live in."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from hotcold.gguf.quants import QuantTensor

Weight = torch.Tensor | QuantTensor

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MAP_MIN_BYTES = 1 << 20  # smaller tensors (tests' tiny models) are not worth a map each


def anonymous(shape: tuple[int, ...], dtype: torch.dtype, *, huge: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous memory map: the OS hands out zero pages as they are first
    written, so nothing is written at allocation (torch.zeros writes every byte; numpy's calloc avoids it
    only until glibc serves freed blocks from its heap and clears them). huge asks for transparent huge
    pages (MADV_HUGEPAGE, where the system allows it "on madvise"): for matrices whose rows are read a
    few at a time in no order, one TLB entry covers 2 MiB of rows instead of one. The tensor holds the
    map; it is unmapped with it. Under 1 MiB, or without such maps: torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _MAP_MIN_BYTES:
        try:
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (AttributeError, OSError, ValueError):  # no such map on this platform
            buf = None
        if buf is not None:
            if huge and hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    buf.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # a kernel without transparent huge pages: plain pages
                    pass
            return torch.frombuffer(buf, dtype=dtype).view(shape)
    return torch.zeros(shape, dtype=dtype)


def rows_in_order(weight: Weight, order: torch.Tensor) -> Weight:
    """A CPU matrix with row i = `weight`'s row order[i], copied into anonymous memory with huge pages asked
    for; the file's pages of the source leave this process's RSS (page_out), so the model is held once.
    A QuantTensor keeps its type (its rows are whole quantized rows)."""
    quant = isinstance(weight, QuantTensor)
    data = weight.data if quant else weight
    if data.dim() != 2 or not data.is_cpu or order.shape != (data.shape[0],):
        raise ValueError(f"rows_in_order: a CPU matrix of {order.numel()} rows, got {tuple(data.shape)}")
    out = anonymous(tuple(data.shape), data.dtype, huge=True)
    nbytes = data.shape[0] * data.stride(0) * data.element_size()
    torch.index_select(data, 0, order.to(torch.int64), out=out)
    page_out(data.data_ptr(), nbytes)
    return QuantTensor(out, weight.qtype, weight.shape) if quant else out


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
