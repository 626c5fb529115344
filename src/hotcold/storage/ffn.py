"""A sparse FFN whose cold rows live in the model file (`--ram-budget`): the hot neurons' up, gate and down_t
rows are resident (read once at load), a cache keeps recently read cold rows, and once the predictor's mask is
known the selected cold rows are read from the file (storage/rows.py, storage/reader.py): for a ReLU-gated FFN the
gate rows first, then up and down_t only for the neurons whose relu(gate) is not 0 (sparse_step's gate-first
rule: a predictor's false positives cost one row, not three). The rows, resident and just read, are gathered in
neuron order into small matrices and computed with the ops of every sparse CPU layer (sparse/ffn.sparse_step):
gathers are per row and the axpy sums the live rows in ascending order in blocks of the live list, so the bits
equal an unbudgeted run's."""

from __future__ import annotations

import logging

import numpy as np
import torch

from hotcold.kernels import cpu
from hotcold.ops import LinearGroup
from hotcold.sparse.ffn import CPU, SparseFFN, dense_step, row_plan, sparse_step
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.storage.plan import GATHER_SHARE
from hotcold.storage.rows import LayerStore, StorageStats, StoredMatrix

log = logging.getLogger(__name__)

__all__ = [
    "StoredFFN",
    "token_groups",
    "LayerStore",
    "StorageStats",
    "StoredMatrix",
]  # the last three: rows.py's


class StoredFFN(SparseFFN):
    """SparseFFN over a LayerStore: predictor -> mask, the selected rows gathered (resident, cached or read),
    sparse_step on them. Layer by layer only (no decode tail, no C tail: decoders.py picks the eager decoder
    for a model with such layers and says why)."""

    reads_storage = True
    tail_type = None  # no one-call tail: the predictor's rows come from storage between its calls

    def __init__(
        self, weights: FFNWeights, predictor, store: LayerStore, *, layer: int, norm=None, threads=None,
        counts_tokens: bool = False,
    ):  # fmt: skip
        super().__init__(weights, predictor, layer=layer, norm=norm, threads=threads)
        self.store = store
        self.counts_tokens = (
            counts_tokens  # the model's first stored layer counts the tokens (per-token figures)
        )
        self.fused_plan = None  # the one-call plans would read the mapped file's rows: never used here
        self.rows_plan = None

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        out_device, x = x.device, x.to(CPU)
        h = self.norm(x) if self.norm is not None else x
        return self._apply(h, x, ctx, fuses=False, norm=None).to(out_device)

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx) -> torch.Tensor:
        return self._apply(h.to(CPU), p, ctx, fuses=False, norm=None).to(h.device)

    def step_parts(self, device):
        return None  # the GPU step would take the whole mapped matrices: a stored layer has none resident

    def _rows(self, sel: np.ndarray) -> FFNWeights:
        """FFNWeights over the rows of neurons `sel` only (row k = neuron sel[k])."""
        w, store = self.weights, self.store
        blocks = store.gather(sel, list(range(len(store.matrices)))).wait()
        mats = [m.weight(b) for m, b in zip(store.matrices, blocks)]
        up, gate, down_t = mats if len(mats) == 3 else (mats[0], None, mats[1])
        bias = None if w.up_bias is None else w.up_bias[torch.from_numpy(sel)]
        return FFNWeights(up=up, gate=gate, down_t=down_t, up_bias=bias, kind=w.kind, activation=w.activation)

    def _count_tokens(self, h: torch.Tensor) -> None:
        if self.counts_tokens:
            self.store.stats.add(tokens=h.shape[0] if h.dim() == 2 else 1)

    def _apply(self, h: torch.Tensor, p: torch.Tensor, ctx, *, fuses: bool, norm=None):
        self._count_tokens(h)
        if ctx.dense:
            return self._dense(h, p, ctx, None)
        mask = self.predictor(p).to(CPU)  # [T, F] bool
        if mask.dim() == 2 and mask.shape[0] > 1:
            # the rows gathered at once stay within the plan's scratch: tokens in groups whose selected neurons
            # fit (a row's arithmetic does not depend on the other rows of its call: the same bits)
            cap = max(1, int(GATHER_SHARE * mask.shape[1]))
            parts = [self._step(h[a:b], mask[a:b]) for a, b in token_groups(mask.numpy(), cap)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            out = self._step(h, mask)
        self.record(ctx, p, mask, int(mask.sum()))
        return self.weights.add_down_bias(out)

    def _step(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The FFN of the rows of h for their masks, without the down bias."""
        sel = np.flatnonzero(mask.reshape(-1, mask.shape[-1]).any(0).numpy())
        w = self.weights
        if len(sel) == 0:  # no neuron fires: the axpy over no rows is exactly 0
            return self._zeros(h)
        if w.gate is not None and w.activation == "relu":
            return self._gate_first(h, mask, sel)
        rows = self._rows(sel)
        return sparse_step(rows, h, mask[..., torch.from_numpy(sel)], row_plan(rows), self.threads)

    def _zeros(self, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*h.shape[:-1], self.store.matrices[0].cols, dtype=torch.float32)

    def _gate_first(self, h: torch.Tensor, mask: torch.Tensor, sel: np.ndarray) -> torch.Tensor:
        """sparse_step's ops in its order, the rows read in two rounds: the gate rows of the selected neurons, then
        the up and down_t rows of those whose relu(gate) is not 0 for some token (a predictor's false positives
        need neither: sparse_step reads neither for them). While a round's reads are in flight the rows already
        in memory are multiplied. Gathers are per row (a row's result does not depend on which other rows are
        asked for) and the axpy runs over the same live rows in the same order: sparse_step's bits."""
        w, store, threads = self.weights, self.store, self.threads
        got = store.gather(sel, [1])
        msel = mask[..., torch.from_numpy(sel)]
        gate_w = store.matrices[1].weight(got.blocks[0])
        gate = _matvec_as_rows_arrive(got, 0, gate_w, h, msel, threads)
        live = msel & (torch.relu(gate) != 0)
        keep = np.flatnonzero(live.reshape(-1, len(sel)).any(0).numpy())
        if len(keep) == 0:
            return self._zeros(h)
        kt, neurons = torch.from_numpy(keep), sel[keep]
        got = store.gather(neurons, [0, 2])
        up_w, down_w = (store.matrices[i].weight(b) for i, b in zip((0, 2), got.blocks))
        live = live[..., kt]
        up = _matvec_as_rows_arrive(got, 0, up_w, h, live, threads)
        got.wait()
        bias = None if w.up_bias is None else w.up_bias[torch.from_numpy(neurons)]
        # for its combine only (kind, activation, up bias): the gate's values are given
        rows = FFNWeights(
            up=up_w, gate=gate_w, down_t=down_w, up_bias=bias, kind=w.kind, activation=w.activation
        )
        a = torch.where(live, rows.combine(up, gate[..., kt]), 0.0)
        return cpu.sparse_axpy(down_w, a, live, threads=threads)

    def _dense(self, h: torch.Tensor, p: torch.Tensor, ctx, up_gate):
        """Every neuron (a dense reference forward): the whole layer gathered, as DenseFFN computes it."""
        w = self._rows(np.arange(self.n_ff, dtype=np.int64))
        group = LinearGroup([w.up, w.gate]) if w.gate is not None else None
        out, a = dense_step(w, h, group)
        if ctx.observe is not None:
            ctx.observe(self.layer, h, p, a)
        ctx.count_all(self.layer, a)
        return self.weights.add_down_bias(out)


def _matvec_as_rows_arrive(got, k: int, weight, h: torch.Tensor, mask: torch.Tensor, threads) -> torch.Tensor:
    """gather_matvec(weight, h, mask) over block k of a gather: the rows in memory first, while the others are
    read, then those (each row's dot product is its own: the same bits as one call over all of them)."""
    if got.complete:
        got.wait()
        return cpu.gather_matvec(weight, h, mask, threads=threads)
    ready = torch.from_numpy(got.ready[k])
    first = cpu.gather_matvec(weight, h, mask & ready, threads=threads)
    got.wait()
    return torch.where(ready, first, cpu.gather_matvec(weight, h, mask & ~ready, threads=threads))


def token_groups(mask: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Consecutive token ranges [a, b) of mask [T, F] whose selected neurons number at most `cap` together (a
    token selecting more goes alone)."""
    t = mask.shape[0]
    if int(mask.any(0).sum()) <= cap:
        return [(0, t)]
    groups, start, union = [], 0, mask[0].copy()
    for i in range(1, t):
        grown = union | mask[i]
        if int(grown.sum()) > cap:
            groups.append((start, i))
            start, union = i, mask[i].copy()
        else:
            union = grown
    return groups + [(start, t)]
