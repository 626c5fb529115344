"""A sparse FFN whose cold rows live in the model file (`--ram-budget`): the hot neurons' up, gate and down_t
rows are resident (read once at load), a cache keeps recently read cold neurons, and after the predictor's mask
is known the selected cold rows are read from the file (storage/reader.py). The selected rows, resident and
just read, are gathered in neuron order into one small matrix per projection, and the step is the one every
sparse CPU layer runs (sparse/ffn.sparse_step) on those rows with the mask's columns: the gathers are per row and
the axpy sums the live rows in ascending order in blocks of the live list, so the bits equal an unbudgeted run.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from hotcold.ops import LinearGroup, Weight
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import CPU, SparseFFN, dense_step, row_plan, sparse_step
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.storage.reader import MAX_READ, Job, RowReader, runs

log = logging.getLogger(__name__)


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
        """Bytes read from storage per token and the neuron cache's hit rate (of cold neurons selected) for
        counts (a snapshot, or the difference of two)."""
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
        flat = memoryview(block.view(-1).numpy())
        rb, out = self.row_bytes, []
        step = max(1, MAX_READ // rb)
        for pos, first, length in runs(rows):
            for k in range(0, length, step):
                n = min(step, length - k)
                p0 = (int(positions[pos]) + k) * rb
                what = f"tensor {self.name} rows {first + k}..{first + k + n - 1}"
                out.append(Job(self.offset + (first + k) * rb, flat[p0 : p0 + n * rb], what))
        return out


class LayerStore:
    """A layer's FFN rows under a RAM budget: the hot neurons' rows resident, a cache of `cache_slots` cold
    neurons (least recently used out first), the rest read from the file when selected."""

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
        self._drop(self.hot)
        self.cap = int(cache_slots)
        self.slot_of = np.full(f, -1, dtype=np.int64)
        self.owner = np.full(self.cap, -1, dtype=np.int64)
        self.last = np.zeros(self.cap, dtype=np.int64)
        self.cache_rows = [torch.empty(self.cap, m.row_bytes, dtype=torch.uint8) for m in matrices]
        self._tick = 0
        self._lock = threading.Lock()

    def _drop(self, rows: np.ndarray) -> None:
        """The page cache need not keep what was just read (one range per matrix)."""
        if len(rows):
            for m in self.matrices:
                start = m.offset + int(rows[0]) * m.row_bytes
                self.reader.drop_cached(start, (int(rows[-1]) + 1 - int(rows[0])) * m.row_bytes)

    def gather(self, sel: np.ndarray) -> list[torch.Tensor]:
        """The rows of the neurons `sel` (sorted) of every matrix, in that order: uint8 [len(sel), row_bytes]."""
        n = len(sel)
        blocks = [torch.empty(n, m.row_bytes, dtype=torch.uint8) for m in self.matrices]
        slot = self.hot_slot[sel]
        hot_pos = np.flatnonzero(slot >= 0)
        cold_pos = np.flatnonzero(slot < 0)
        if len(hot_pos):
            src, dst = torch.from_numpy(slot[hot_pos]), torch.from_numpy(hot_pos)
            for block, rows in zip(blocks, self.hot_rows):
                block[dst] = rows[src]
        with self._lock:
            self._tick += 1
            cold = sel[cold_pos]
            cslot = self.slot_of[cold]
            hit = cslot >= 0
            if hit.any():
                src, dst = torch.from_numpy(cslot[hit]), torch.from_numpy(cold_pos[hit])
                for block, rows in zip(blocks, self.cache_rows):
                    block[dst] = rows[src]
                self.last[cslot[hit]] = self._tick
            miss, miss_pos = cold[~hit], cold_pos[~hit]
            got, n_jobs = 0, 0
            if len(miss):
                self.reader.check()
                # a run of adjacent neurons sits at adjacent positions of sel: one read per matrix into the block
                jobs = [j for m, block in zip(self.matrices, blocks) for j in m.jobs(miss, miss_pos, block)]
                got, n_jobs = self.reader.read(jobs), len(jobs)
                self._drop(miss)
                self._insert(miss, miss_pos, blocks)
        self.stats.add(
            bytes_read=got, reads=n_jobs, rows_read=len(miss) * len(self.matrices), cold_selected=len(cold),
            cache_hits=int(hit.sum()), hot_selected=len(hot_pos),
        )  # fmt: skip
        return blocks

    def _insert(self, miss: np.ndarray, miss_pos: np.ndarray, blocks: list[torch.Tensor]) -> None:
        """Keep the rows just read in the cache, in the least recently used slots (those hit in this call were
        copied out already, so any slot may go)."""
        k = min(len(miss), self.cap)
        if k == 0:
            return
        keep, keep_pos = miss[-k:], miss_pos[-k:]
        victims = np.arange(self.cap) if k == self.cap else np.argpartition(self.last, k - 1)[:k]
        old = self.owner[victims]
        self.slot_of[old[old >= 0]] = -1
        self.owner[victims], self.slot_of[keep], self.last[victims] = keep, victims, self._tick
        dst, src = torch.from_numpy(victims), torch.from_numpy(keep_pos)
        for block, rows in zip(blocks, self.cache_rows):
            rows[dst] = block[src]


class StoredFFN(SparseFFN):
    """SparseFFN over a LayerStore: predictor -> mask, the selected rows gathered (resident, cached or read),
    sparse_step on them. Layer by layer only (no decode tail, no C tail: decoders.py picks the eager decoder
    for a model with such layers and says why)."""

    reads_storage = True

    def __init__(
        self, weights: FFNWeights, predictor, store: LayerStore, *, layer: int, norm=None, threads=None
    ):
        super().__init__(weights, predictor, layer=layer, norm=norm, threads=threads)
        self.store = store
        self.fused_plan = None  # the one-call plans would read the mapped file's rows: never used here
        self.rows_plan = None

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        out_device, x = x.device, x.to(CPU)
        h = self.norm(x) if self.norm is not None else x
        return self._apply(h, x, ctx, fuses=False, norm=None).to(out_device)

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx) -> torch.Tensor:
        return self._apply(h.to(CPU), p, ctx, fuses=False, norm=None).to(h.device)

    def decode_tail(self, attn, x, wo, ctx):
        return None

    def c_tail(self, wo, *, dense: bool, norm=None):
        return None

    def _rows(self, sel: np.ndarray) -> FFNWeights:
        """FFNWeights over the rows of neurons `sel` only (row k = neuron sel[k])."""
        w = self.weights
        blocks = self.store.gather(sel)
        mats = [m.weight(b) for m, b in zip(self.store.matrices, blocks)]
        up, gate, down_t = mats if len(mats) == 3 else (mats[0], None, mats[1])
        bias = None if w.up_bias is None else w.up_bias[torch.from_numpy(sel)]
        return FFNWeights(up=up, gate=gate, down_t=down_t, up_bias=bias, kind=w.kind, activation=w.activation)

    def _count_tokens(self, h: torch.Tensor) -> None:
        if self.layer == 0:
            self.store.stats.add(tokens=h.shape[0] if h.dim() == 2 else 1)

    def _apply(self, h: torch.Tensor, p: torch.Tensor, ctx, *, fuses: bool, norm=None):
        self._count_tokens(h)
        if ctx.dense:
            return self._dense(h, p, ctx, None)
        mask = self.predictor(p).to(CPU)  # [T, F] bool
        mask2 = mask if mask.dim() == 2 else mask[None]
        sel = np.flatnonzero(mask2.any(0).numpy())
        if len(sel) == 0:  # no neuron fires: the axpy over no rows is exactly 0
            out = torch.zeros(mask2.shape[0], self.store.matrices[0].cols, dtype=torch.float32)
            out = out if mask.dim() == 2 else out[0]
        else:
            w = self._rows(sel)
            out = sparse_step(w, h, mask[..., torch.from_numpy(sel)], row_plan(w), self.threads)
        self._record(ctx, p, mask, int(mask.sum()))
        return self.weights.add_down_bias(out)

    def _dense(self, h: torch.Tensor, p: torch.Tensor, ctx, up_gate):
        """Every neuron (a dense reference forward): the whole layer gathered, as DenseFFN computes it."""
        w = self._rows(np.arange(self.n_ff, dtype=np.int64))
        group = LinearGroup([w.up, w.gate]) if w.gate is not None else None
        out, a = dense_step(w, h, group)
        if ctx.observe is not None:
            ctx.observe(self.layer, h, p, a)
        ctx.count_all(self.layer, a)
        return self.weights.add_down_bias(out)


__all__ = ["StorageStats", "StoredMatrix", "LayerStore", "StoredFFN"]
