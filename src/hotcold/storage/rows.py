"""Where a stored layer's FFN rows come from (`--ram-budget`): resident hot rows, a cache of recently read cold
rows, or the model file (storage/reader.py), and the counters of what was read (`StorageStats`)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from hotcold.gguf.quants import QuantTensor
from hotcold.ops import Weight
from hotcold.storage.reader import MAX_READ, Job, RowReader, runs


class StorageStats:
    """What the stored layers did since load, for `timings`, `/metrics` and benchmarks (thread-safe)."""

    FIELDS = ("tokens", "bytes_read", "reads", "rows_read", "cold_selected", "cache_hits", "hot_selected")

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._values[k] += int(v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    @staticmethod
    def figures(counts: dict[str, int]) -> dict:
        """For counts (a snapshot, or the difference of two): bytes read from storage per token forwarded, the
        neuron cache's hit rate (of the cold rows asked for, per matrix: cold_selected and cache_hits count rows),
        and the share of the rows asked for that were resident or cached."""
        tokens, cold = counts["tokens"], counts["cold_selected"]
        return {
            "storage_bytes_read": counts["bytes_read"],
            "storage_reads": counts["reads"],
            "storage_bytes_per_token": counts["bytes_read"] / tokens if tokens else 0.0,
            "neuron_cache_hit_rate": counts["cache_hits"] / cold if cold else None,
            "resident_share_of_selected": (
                (counts["hot_selected"] + counts["cache_hits"]) / (counts["hot_selected"] + cold)
                if counts["hot_selected"] + cold
                else None
            ),
        }


class StoredMatrix:
    """One FFN matrix [F, D] of a layer as stored: file offset, bytes per row, and how a block of its rows
    (uint8 [n, row_bytes]) becomes a weight the kernels take."""

    def __init__(self, name: str, offset: int, weight: Weight):
        self.name, self.offset = name, offset
        if isinstance(weight, QuantTensor):
            self.qtype, self.dtype = weight.qtype, None
            self.row_bytes = int(weight.data.shape[1])
        else:
            self.qtype, self.dtype = None, weight.dtype
            self.row_bytes = int(weight.shape[1]) * weight.element_size()
        self.rows, self.cols = int(weight.shape[0]), int(weight.shape[1])

    def weight(self, block: torch.Tensor) -> Weight:
        n = block.shape[0]
        if self.qtype is not None:
            return QuantTensor(block, self.qtype, (n, self.cols))
        return block.view(self.dtype).view(n, self.cols)

    def jobs(self, rows: np.ndarray, positions: np.ndarray, block: torch.Tensor) -> list[Job]:
        """Reads of `rows` (sorted) into block's rows `positions` (consecutive where the rows are): each run of
        adjacent rows one read (split at MAX_READ)."""
        if len(rows) == 0:
            return []
        flat = memoryview(block.view(-1).numpy())
        rb, step = self.row_bytes, max(1, MAX_READ // self.row_bytes)
        r = runs(rows)
        start, first, length = (np.array(c, dtype=np.int64) for c in zip(*r))
        if int(length.max()) > step:  # long runs (hot rows at load): split
            pieces = [(p + k, f + k, min(step, n - k)) for p, f, n in r for k in range(0, n, step)]
            start, first, length = (np.array(c, dtype=np.int64) for c in zip(*pieces))
        dst = positions[start] * rb
        off = self.offset + first * rb
        name = self.name
        return [
            Job(o, flat[d : d + n * rb], (name, f, f + n - 1))
            for o, d, f, n in zip(off.tolist(), dst.tolist(), first.tolist(), length.tolist())
        ]


class _RowCache:
    """Recently read rows of one matrix: `cap` slots, the least recently used one given up first."""

    def __init__(self, rows: int, cap: int, row_bytes: int):
        self.cap = cap
        self.slot_of = np.full(rows, -1, dtype=np.int64)
        self.owner = np.full(cap, -1, dtype=np.int64)
        self.last = np.zeros(cap, dtype=np.int64)
        self.rows = torch.empty(cap, row_bytes, dtype=torch.uint8)  # pages taken as slots fill

    def insert(self, neurons: np.ndarray, block: torch.Tensor, positions: np.ndarray, tick: int) -> None:
        """Keep block's rows `positions` (neurons `neurons`) in the least recently used slots (rows hit in this
        call were copied out already, so any slot may go)."""
        k = min(len(neurons), self.cap)
        if k == 0:
            return
        keep, keep_pos = neurons[-k:], positions[-k:]
        victims = np.arange(self.cap) if k == self.cap else np.argpartition(self.last, k - 1)[:k]
        old = self.owner[victims]
        self.slot_of[old[old >= 0]] = -1
        self.owner[victims], self.slot_of[keep], self.last[victims] = keep, victims, tick
        self.rows.numpy()[victims] = block.numpy()[
            keep_pos
        ]  # numpy's row copies: torch's uint8 indexing is ~50x slower


class LayerStore:
    """A layer's FFN rows under a RAM budget: the hot neurons' rows resident, a cache of `cache_slots` rows per
    matrix (least recently used out first), the rest read from the file when asked for."""

    def __init__(self, reader: RowReader, matrices: list[StoredMatrix], hot: np.ndarray, cache_slots: int,
                 stats: StorageStats):  # fmt: skip
        self.reader, self.matrices, self.stats = reader, matrices, stats
        f = matrices[0].rows
        self.hot = np.asarray(hot, dtype=np.int64)
        self.hot_slot = np.full(f, -1, dtype=np.int64)
        self.hot_slot[self.hot] = np.arange(len(self.hot))
        self.hot_rows = [torch.empty(len(self.hot), m.row_bytes, dtype=torch.uint8) for m in matrices]
        at = np.arange(len(self.hot))
        jobs = [j for m, b in zip(matrices, self.hot_rows) for j in m.jobs(self.hot, at, b)]
        reader.read(jobs)  # at load: not counted as a token's reads
        for m in matrices:
            self._drop(m, self.hot)
        self.caches = [_RowCache(f, int(cache_slots), m.row_bytes) for m in matrices]
        self._tick = 0
        self._lock = threading.Lock()

    def _drop(self, m: StoredMatrix, rows: np.ndarray) -> None:
        """The page cache need not keep what was just read (one range)."""
        if len(rows):
            start = m.offset + int(rows[0]) * m.row_bytes
            self.reader.drop_cached(start, (int(rows[-1]) + 1 - int(rows[0])) * m.row_bytes)

    def gather(self, sel: np.ndarray, which: list[int]) -> Gathered:
        """The rows of neurons `sel` (sorted) of the matrices `which` (indices into self.matrices), in that order,
        as uint8 [len(sel), row_bytes] blocks: resident and cached rows copied now, the rest read in the
        background until the result's wait()."""
        n = len(sel)
        blocks = [torch.empty(n, self.matrices[i].row_bytes, dtype=torch.uint8) for i in which]
        slot = self.hot_slot[sel]
        hot_pos = np.flatnonzero(slot >= 0)
        cold_pos = np.flatnonzero(slot < 0)
        cold = sel[cold_pos]
        if len(hot_pos):
            src = slot[hot_pos]
            for block, i in zip(blocks, which):
                block.numpy()[hot_pos] = self.hot_rows[i].numpy()[src]
        hits, jobs, misses, ready = 0, [], [], []
        with self._lock:
            self._tick += 1
            for block, i in zip(blocks, which):
                cache = self.caches[i]
                cslot = cache.slot_of[cold]
                hit = cslot >= 0
                if hit.any():
                    block.numpy()[cold_pos[hit]] = cache.rows.numpy()[cslot[hit]]
                    cache.last[cslot[hit]] = self._tick
                    hits += int(hit.sum())
                miss, miss_pos = cold[~hit], cold_pos[~hit]
                misses.append((i, miss, miss_pos))
                here = np.ones(n, dtype=bool)
                here[miss_pos] = False
                ready.append(here)
                # a run of adjacent neurons sits at adjacent positions of sel: one read into the block
                jobs += self.matrices[i].jobs(miss, miss_pos, block)
            tick = self._tick
        if jobs:
            self.reader.check()
        pending = self.reader.submit(jobs)
        counts = dict(reads=len(jobs), rows_read=sum(len(m[1]) for m in misses), cold_selected=len(cold) * len(which),
                      cache_hits=hits, hot_selected=len(hot_pos) * len(which))  # fmt: skip
        return Gathered(self, blocks, ready, pending, misses, tick, counts)

    def _finish(self, got: Gathered, n_bytes: int) -> None:
        """The reads of `got` arrived: the page cache told to drop them, the rows kept in the cache, counted."""
        with self._lock:
            for block, (i, miss, miss_pos) in zip(got.blocks, got.misses):
                if len(miss):
                    self._drop(self.matrices[i], miss)
                    self.caches[i].insert(miss, block, miss_pos, got.tick)
        self.stats.add(bytes_read=n_bytes, **got.counts)


class Gathered:
    """A gather's blocks; ready[k][j]: whether row j of blocks[k] is there already (resident or cached), the
    others arrive by wait() (which raises a read's error)."""

    def __init__(self, store: LayerStore, blocks, ready, pending, misses, tick: int, counts: dict):
        self.store, self.blocks, self.ready, self._pending = store, blocks, ready, pending
        self.misses, self.tick, self.counts = misses, tick, counts
        self._done = False

    @property
    def complete(self) -> bool:
        return self._done or all(r.all() for r in self.ready)

    def wait(self) -> list[torch.Tensor]:
        if not self._done:
            n_bytes = self._pending.wait()
            self._done = True
            self.store._finish(self, n_bytes)
        return self.blocks
