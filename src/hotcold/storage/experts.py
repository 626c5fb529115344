"""A mixture-of-experts layer's experts under a RAM budget (`--ram-budget` on an MoE file): the plan's resident
experts copied into memory at load (packed where the kernels have a packed form), a cache of recently used experts
in slots, and every other expert read from the file when the router picks it.

An expert is the unit: its up, gate and down matrices are slices of the stacked `ffn_*_exps` tensors, each one
contiguous run of bytes in the file, so an expert is three long reads (split at the reader's MAX_READ and run
`depth` at a time). As soon as the router has chosen a token's experts, `prefetch` starts the reads of every chosen
expert that is not in memory (MoEFFN calls it before computing any of them), so the first expert's products overlap
the other experts' reads. The products are the same as an unlimited load's (same bytes, same kernels): where the
rows come from changes, not the arithmetic (the resident experts' packed copies are the load's own packed form).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np
import torch

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from hotcold.kernels.pages import page_out
from hotcold.sparse.ffn import DenseFFN
from hotcold.storage.reader import Pending, RowReader
from hotcold.storage.rows import StorageStats, StoredMatrix


def expert_fields(expert: DenseFFN) -> tuple[str, str, str]:
    """The FFNWeights fields an expert reads from the file: up, gate and down (down_t in the PowerInfer fork's
    SmallThinker files, whose ffn_down_exps is stored transposed)."""
    return ("up", "gate", "down" if expert.weights.down is not None else "down_t")


class ExpertStore:
    """Experts of one layer, indexable as the list MoEFFN holds (`store[e]` is an FFN whose weights are in memory),
    iterable over the experts as mapped from the file (their types and shapes, for the layer's checks)."""

    def __init__(self, reader: RowReader, layer: int, mapped: list[DenseFFN], matrices: list[list[StoredMatrix]],
                 resident: np.ndarray, slots: int, stats: StorageStats, *, packs, counts_tokens: bool = False):  # fmt: skip
        if any(type(e) is not DenseFFN for e in mapped):
            raise ValueError(
                f"layer {layer}: --ram-budget reads whole experts: experts with predictors are not supported"
            )
        self.reader, self.layer, self.mapped, self.matrices = reader, layer, mapped, matrices
        self.fields = expert_fields(mapped[0])
        # the matrices a load without storage packs (the family's decision, TensorSource.pack_expert), by field
        self.packed_fields = {f for f in self.fields if packs(getattr(mapped[0].weights, f))}
        self.stats, self.counts_tokens = stats, counts_tokens
        self.expert_bytes = sum(m.rows * m.row_bytes for m in matrices[0])
        # a slot: the expert's bytes as read, then the packed copies of those an unlimited load packs
        w = mapped[0].weights
        self.packed_at, at = {}, self.expert_bytes
        for name in self.fields:
            n = cpu.packed_nbytes(getattr(w, name)) if name in self.packed_fields else 0
            if n:
                self.packed_at[name], at = (at, at + n), at + n
        self.slot_bytes = at
        self.resident = {int(e): self._resident(int(e)) for e in resident}
        self.capacity = int(slots)
        self.cached: OrderedDict[int, DenseFFN] = OrderedDict()  # least recently used first
        self.pending: dict[
            int, tuple[Pending, torch.Tensor, int]
        ] = {}  # reads in flight, their slot, how many
        self._free: list[torch.Tensor] = []
        self._wanted: set[int] = set()  # the last prefetch's experts not asked for yet: kept in their slots
        self._allocated = 0

    def __len__(self) -> int:
        return len(self.mapped)

    def __iter__(self):
        return iter(self.mapped)

    def _resident(self, e: int) -> DenseFFN:
        """Expert e copied out of the file's pages as an unlimited load keeps it (packed where it packs: cpu.pack,
        which drops the file's pages; the rest copied as they are)."""
        w = self.mapped[e].weights

        def copy(name: str, weight):
            packed = cpu.pack(weight) if name in self.packed_fields else weight
            if packed is not weight:
                return packed
            data = weight.data if isinstance(weight, QuantTensor) else weight
            copied = data.clone()
            page_out(data.data_ptr(), data.numel() * data.element_size())  # one copy in RSS, not two
            return (
                QuantTensor(copied, weight.qtype, weight.shape) if isinstance(weight, QuantTensor) else copied
            )

        return self._ffn(e, replace(w, **{m: copy(m, getattr(w, m)) for m in self.fields}))

    def _ffn(self, e: int, weights) -> DenseFFN:
        return DenseFFN(weights, layer=self.layer, norm=None, expert=e)

    def _buffer(self, keep: set[int]) -> torch.Tensor | None:
        """A slot's bytes: a free one, a new one within the capacity, or the least recently used cached expert's
        (not one in `keep`); None when every slot holds an expert in `keep` or a read in flight."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            self._allocated += 1
            return torch.empty(self.slot_bytes, dtype=torch.uint8)
        for e in self.cached:
            if e not in keep and e not in self._wanted:
                old = self.cached.pop(e)
                return old.slot
        return None

    def prefetch(self, experts: list[int]) -> None:
        """Start reading every expert of `experts` that is neither resident, cached nor on its way (as many as
        there are slots for; the rest are read when asked for)."""
        keep = set(experts)
        self._wanted = set(experts)
        for e in experts:
            if e in self.resident or e in self.cached or e in self.pending:
                continue
            block = self._buffer(keep)
            if block is None:
                return
            jobs, at = [], 0
            for m in self.matrices[e]:
                n = m.rows * m.row_bytes
                rows = np.arange(m.rows, dtype=np.int64)
                jobs += m.jobs(rows, rows, block[at : at + n].view(m.rows, m.row_bytes))
                at += n
            try:
                self.pending[e] = (self.reader.submit(jobs), block, len(jobs))
            except BaseException:
                self._free.append(block)  # the slot stays the cache's
                raise

    def __getitem__(self, e: int) -> DenseFFN:
        self._wanted.discard(e)
        if e in self.resident:
            self.stats.add(hot_selected=1)
            return self.resident[e]
        if e in self.cached:
            self.cached.move_to_end(e)
            self.stats.add(cold_selected=1, cache_hits=1)
            return self.cached[e]
        if e not in self.pending:
            self.prefetch([e])
        if e not in self.pending:  # every slot busy with these tokens' experts: free the oldest computed one
            if self.cached:
                self._free.append(self.cached.pop(next(iter(self.cached))).slot)
            else:  # every slot is a read in flight for a later expert (callers go in prefetch's order: not seen)
                self._allocated += 1
                self._free.append(torch.empty(self.slot_bytes, dtype=torch.uint8))
            self.prefetch([e])
        pending, block, n_reads = self.pending.pop(e)
        try:
            self.reader.check()
            n_bytes = pending.wait()
        except BaseException:
            self._free.append(block)  # the slot stays the cache's (the reads have all stopped: Pending.wait)
            raise
        self.stats.add(cold_selected=1, bytes_read=n_bytes, reads=n_reads)
        for m in self.matrices[e]:  # the page cache need not keep a second copy (no readahead either)
            self.reader.drop_cached(m.offset, m.rows * m.row_bytes)
        weights, at = self.mapped[e].weights, 0
        parts = {}
        for name, m in zip(self.fields, self.matrices[e]):
            n = m.rows * m.row_bytes
            parts[name] = m.weight(block[at : at + n].view(m.rows, m.row_bytes))
            if (
                name in self.packed_at
            ):  # into the slot's packed part, as an unlimited load packs it: the same bits
                lo, hi = self.packed_at[name]
                parts[name] = cpu.pack(parts[name], out=block[lo:hi])
            at += n
        ffn = self._ffn(e, replace(weights, **parts))
        ffn.slot = block  # the bytes it reads, handed to the next expert when it is given up
        self.cached[e] = ffn
        return ffn

    def count_tokens(self, n: int) -> None:
        if self.counts_tokens:
            self.stats.add(tokens=n)
