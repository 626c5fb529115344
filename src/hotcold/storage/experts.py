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
from hotcold.sparse.ffn import DenseFFN
from hotcold.sparse.moe import runs_relu_rows
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
                 resident: np.ndarray, slots: int, stats: StorageStats, *, counts_tokens: bool = False):  # fmt: skip
        if any(type(e) is not DenseFFN for e in mapped):
            raise ValueError(
                f"layer {layer}: --ram-budget reads whole experts: experts with predictors are not supported"
            )
        self.reader, self.layer, self.mapped, self.matrices = reader, layer, mapped, matrices
        self.fields = expert_fields(mapped[0])
        self.relu_rows = runs_relu_rows(mapped[0])  # before _packs is asked
        self.stats, self.counts_tokens = stats, counts_tokens
        self.expert_bytes = sum(m.rows * m.row_bytes for m in matrices[0])
        # a slot: the expert's bytes as read, then the packed copies of those an unlimited load packs
        w = mapped[0].weights
        self.packed_at, at = {}, self.expert_bytes
        for name in self.fields:
            n = cpu.packed_nbytes(getattr(w, name)) if self._packs(name) else 0
            if n:
                self.packed_at[name], at = (at, at + n), at + n
        self.slot_bytes = at
        self.resident = {int(e): self._resident(int(e)) for e in resident}
        self.capacity = int(slots)
        self.cached: OrderedDict[int, DenseFFN] = OrderedDict()  # least recently used first
        self.pending: dict[int, tuple[Pending, torch.Tensor]] = {}
        self._free: list[torch.Tensor] = []
        self._allocated = 0

    def __len__(self) -> int:
        return len(self.mapped)

    def __iter__(self):
        return iter(self.mapped)

    def _packs(self, name: str) -> bool:
        """Whether an unlimited load keeps this matrix packed: every matrix of an expert multiplied whole, the gate
        of a ReLU expert computed over its live rows (moe.relu_rows_apply gathers up and down)."""
        return not self.relu_rows or name == "gate"

    def _resident(self, e: int) -> DenseFFN:
        """Expert e copied out of the file's pages as an unlimited load keeps it (packed where it packs: cpu.pack,
        which drops the file's pages; the rest copied as they are)."""
        w = self.mapped[e].weights

        def copy(name: str, weight):
            packed = cpu.pack(weight) if self._packs(name) else weight
            if packed is not weight:
                return packed
            if isinstance(weight, QuantTensor):
                return QuantTensor(weight.data.clone(), weight.qtype, weight.shape)
            return weight.clone()

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
            if e not in keep:
                old = self.cached.pop(e)
                return old.slot
        return None

    def prefetch(self, experts: list[int]) -> None:
        """Start reading every expert of `experts` that is neither resident, cached nor on its way (as many as
        there are slots for; the rest are read when asked for)."""
        keep = set(experts)
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
            self.pending[e] = (self.reader.submit(jobs), block)

    def __getitem__(self, e: int) -> DenseFFN:
        if e in self.resident:
            self.stats.add(hot_selected=1)
            return self.resident[e]
        if e in self.cached:
            self.cached.move_to_end(e)
            self.stats.add(cold_selected=1, cache_hits=1)
            return self.cached[e]
        if e not in self.pending:
            self.prefetch([e])
        if e not in self.pending:  # every slot busy with experts of this token: give back the oldest
            oldest = next(iter(self.cached))
            self._free.append(self.cached.pop(oldest).slot)
            self.prefetch([e])
        pending, block = self.pending.pop(e)
        self.reader.check()
        n_bytes = pending.wait()
        self.stats.add(cold_selected=1, bytes_read=n_bytes, reads=len(self.matrices[e]))
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
