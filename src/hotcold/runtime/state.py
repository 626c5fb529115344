"""Per-sequence state: everything one sequence's forwards write, passed with every forward and never kept
on the model. The model's objects are immutable after load, so any number of sequences (the server's
slots, threads of a program) can run forwards of one loaded model at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hotcold.kernels.pages import anonymous

# observe(layer, ffn_input [T, D], pred_input [T, D], activation [T, F]): sees the true activations of a
# dense FFN evaluation; profiling, predictor training and perplexity's mask agreement use it.
Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class KVCache:
    """Preallocated keys and values for one sequence: k[l], v[l] are [S, Hkv, Dh] on layer l's device, in
    that device's KV dtype (hotcold.device.kv_dtype); positions are explicit, so a decode step always has
    the same shapes."""

    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        *,
        devices: Sequence[torch.device] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ):
        self.n_ctx = n_ctx
        devices = list(devices or [torch.device("cpu")] * n_layer)
        dtypes = list(dtypes or [torch.float32] * n_layer)
        shape = (n_ctx, n_head_kv, head_dim)
        self.k = [_zeros(shape, t, d) for d, t in zip(devices, dtypes, strict=True)]
        self.v = [_zeros(shape, t, d) for d, t in zip(devices, dtypes, strict=True)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU in an anonymous memory map (pages.anonymous): zero pages as positions
    are first written, where torch.zeros wrote every byte at once (8 sequences of the 1B synthetic at the
    default context took 0.72 s, most of an 8-prompt generate_batch's setup), and a sequence's memory grows
    only with the positions it uses. A GPU cache stays torch.zeros."""
    device = torch.device(device)
    return anonymous(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class FFNCounts:
    """Neurons computed vs neurons in the layer (or in the experts routed to), summed over tokens; `hot`:
    those of `computed` that the layer's hot copy on the fast device computed (hybrid layers)."""

    computed: int = 0
    total: int = 0
    hot: int = 0

    @property
    def rate(self) -> float:
        return self.computed / self.total if self.total else 0.0


@dataclass
class SequenceState:
    """One sequence: its KV cache, what its forwards report back, and how it wants them run.

    dense: compute every neuron whatever the FFN kind (the reference a sparse model is judged by);
    observe: called by every layer's dense FFN evaluation (see Observer);
    keep_masks: remember each layer's last predictor input and mask in `masks`;
    hot: per layer, bool [F] of the neurons with a hot copy on the fast device (None: none), so `counts`
    say how many of the computed neurons ran there (set by the engine from the model's DevicePlan)."""

    kv: KVCache
    counts: list[FFNCounts]
    routing: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, k] experts, best first
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dense: bool = False
    observe: Observer | None = None
    keep_masks: bool = False
    hot: list[torch.Tensor | None] | None = None
    # the one-call CPU decoder's plans over this sequence's caches (cpu_step), by dense: built on first use
    decode_plans: dict = field(default_factory=dict)
    # output-head rows computed and rows in the head, over the forwards so far (a screened step: fewer)
    head_rows: list[int] = field(default_factory=lambda: [0, 0])
    # the last forward's head left the rows that cannot matter at -inf, its computed rows checked (head_screen.py)
    head_screened: bool = False

    @classmethod
    def new(cls, config, devices: Sequence[torch.device], dtypes: Sequence[torch.dtype], n_ctx: int):
        kv = KVCache(config.n_layer, n_ctx, config.n_head_kv, config.head_dim, devices=devices, dtypes=dtypes)
        return cls(kv, [FFNCounts() for _ in range(config.n_layer)])

    def count(self, layer: int, computed: int, total: int, hot: int = 0) -> None:
        c = self.counts[layer]
        c.computed += computed
        c.total += total
        c.hot += hot

    def neuron_totals(self) -> tuple[int, int]:
        """(computed, total) over every layer so far."""
        return sum(c.computed for c in self.counts), sum(c.total for c in self.counts)

    def hot_total(self) -> int:
        """Neurons computed by hot copies on the fast device, over every layer so far."""
        return sum(c.hot for c in self.counts)

    def hot_mask(self, layer: int, width: int) -> torch.Tensor | None:
        """Layer's hot neurons as bool [width], or None when it has none (or another width: not its FFN)."""
        hot = None if self.hot is None else self.hot[layer]
        return hot if hot is not None and hot.numel() == width else None


def hot_masks(hot_rows: Sequence[Sequence[int] | None], n_ff: int) -> list[torch.Tensor | None] | None:
    """SequenceState.hot from each layer's hot neuron ids (DevicePlan.hot_rows); None when no layer has any."""
    out: list[torch.Tensor | None] = []
    for rows in hot_rows:
        if rows is None or len(rows) == 0:
            out.append(None)
            continue
        mask = torch.zeros(n_ff, dtype=torch.bool)
        mask[torch.as_tensor(rows, dtype=torch.long)] = True
        out.append(mask)
    return out if any(m is not None for m in out) else None


@dataclass(frozen=True)
class HeadNeed:
    """What a decode step's last logits are read for when the sampler needs only some of them: each row's `top`
    largest (1: greedy's argmax; k: top-k sampling's, which every later filter reads alone), once the tokens
    keep[j] of row j are set aside (the repeat penalty's window: the sampler changes those logits, so they are
    computed exactly whatever their bound). The head may leave every other logit at -inf (head_screen.py)."""

    top: int
    keep: tuple[tuple[int, ...], ...] = ()

    @staticmethod
    def of_rows(needs: Sequence[HeadNeed | None]) -> HeadNeed | None:
        """One need for a batch's rows (each a one-row need): the largest top, each row's keep; None if a row
        needs every logit."""
        if not needs or any(n is None for n in needs):
            return None
        return HeadNeed(max(n.top for n in needs), tuple(n.keep[0] if n.keep else () for n in needs))


class Batch:
    """What one forward runs: the input's rows in segments, segment j = `lengths[j]` tokens of sequence
    `seqs[j]` at positions `starts[j]`..; every segment attends over its own sequence's cache, and what
    the layers report (neurons computed, routing, masks) goes to the segment's own sequence.

    A dense reference forward (`dense`) or an observed one (`observe`) is a single-sequence batch."""

    def __init__(
        self,
        seqs: Sequence[SequenceState],
        starts: Sequence[int],
        lengths: Sequence[int],
        *,
        head_need: HeadNeed | None = None,
    ):
        """head_need: what the segments' last logits are read for, where not all of them (HeadNeed)."""
        if not (len(seqs) == len(starts) == len(lengths)) or not seqs:
            raise ValueError("a batch needs one start and one length per sequence, and at least one sequence")
        self.seqs, self.starts, self.lengths = list(seqs), list(starts), list(lengths)
        ends, row = [], 0
        for n in self.lengths:
            row += n
            ends.append(row)
        self.rows = row
        self.bounds = [(e - n, e) for e, n in zip(ends, self.lengths)]  # [row0, row1) of each segment
        if len(self.seqs) > 1 and any(s.dense or s.observe is not None for s in self.seqs):
            raise ValueError("a dense or observed forward runs one sequence at a time")
        first = self.seqs[0]
        self.dense, self.observe = first.dense, first.observe
        self.keep_masks = any(s.keep_masks for s in self.seqs)
        self.head_need = head_need
        self._start_on: dict[torch.device, torch.Tensor] = {}

    def start_on(self, device: torch.device) -> torch.Tensor:
        """The first segment's start as int64 [1] on `device`, made once per forward (not per layer) for
        kernels that read the position on the device."""
        at = self._start_on.get(device)
        if at is None:
            at = self._start_on[device] = torch.full((1,), self.starts[0], dtype=torch.long, device=device)
        return at

    @classmethod
    def single(cls, seq: SequenceState, pos: int, n: int, *, head_need: HeadNeed | None = None) -> Batch:
        return cls([seq], [pos], [n], head_need=head_need)

    def segments(self):
        """(row0, row1, seq, pos) for every segment."""
        for (a, b), seq, pos in zip(self.bounds, self.seqs, self.starts):
            yield a, b, seq, pos

    def last_rows(self) -> list[int]:
        return [b - 1 for _, b in self.bounds]

    def count(self, layer: int, mask: torch.Tensor, fired: int | None = None, rows=None) -> None:
        """Neurons computed in `layer`: mask [T, F] over the batch's rows, or over `rows` of them (a MoE
        expert's tokens); fired: the mask's sum, when the kernel already counted it."""
        hot = self.seqs[0].hot_mask(layer, mask.shape[-1])  # one model per batch: the same for every row
        if hot is not None:
            hot = mask & hot.to(mask.device)
        if len(self.seqs) == 1:
            n_hot = 0 if hot is None else int(hot.sum())
            self.seqs[0].count(layer, int(mask.sum()) if fired is None else fired, mask.numel(), n_hot)
            return
        if rows is None and self.rows == len(self.seqs):  # a decode step: one row per sequence
            per_row = mask.sum(1).tolist()
            per_hot = [0] * len(per_row) if hot is None else hot.sum(1).tolist()
            for seq, c, h in zip(self.seqs, per_row, per_hot):
                seq.count(layer, int(c), mask.shape[1], int(h))
            return
        seg = self._segment_of_row() if rows is None else self._segment_of_row()[rows]
        n = len(self.seqs)
        computed = torch.bincount(seg, weights=mask.sum(1, dtype=torch.float64), minlength=n)
        tokens = torch.bincount(seg, minlength=n)
        on_fast = (
            None if hot is None else torch.bincount(seg, weights=hot.sum(1, dtype=torch.float64), minlength=n)
        )
        for j, seq in enumerate(self.seqs):
            seq.count(
                layer,
                int(computed[j]),
                int(tokens[j]) * mask.shape[1],
                0 if on_fast is None else int(on_fast[j]),
            )

    def count_all(self, layer: int, activation: torch.Tensor, rows=None) -> None:
        """Every neuron of `layer` computed (a dense FFN's activation [T, F]) for every row, or for `rows`."""
        per_row = activation.shape[-1]
        if len(self.seqs) == 1:
            self.seqs[0].count(layer, activation.numel(), activation.numel())
            return
        seg = self._segment_of_row() if rows is None else self._segment_of_row()[rows]
        tokens = torch.bincount(seg, minlength=len(self.seqs))
        for j, seq in enumerate(self.seqs):
            seq.count(layer, int(tokens[j]) * per_row, int(tokens[j]) * per_row)

    def _segment_of_row(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.seqs)), torch.tensor(self.lengths))

    def subset(self, rows: torch.Tensor) -> _Rows:
        """The context of an FFN that runs on some of the batch's rows (a MoE expert's tokens)."""
        return _Rows(self, rows)

    def keep(self, layer: int, p: torch.Tensor, mask: torch.Tensor) -> None:
        for a, b, seq, _ in self.segments():
            if seq.keep_masks:
                seq.masks[layer] = (p[a:b].detach().clone(), mask[a:b])

    def route(self, layer: int, ids: torch.Tensor) -> None:
        for a, b, seq, _ in self.segments():
            seq.routing[layer] = ids[a:b]


class _Rows:
    """Some rows of a batch, as a MoE expert sees them: counts go to the rows' own sequences; experts are
    not observed or recorded one by one."""

    observe = None
    keep_masks = False

    def __init__(self, batch: Batch, rows: torch.Tensor):
        self.batch, self.rows = batch, rows
        self.dense = batch.dense

    def count(self, layer: int, mask: torch.Tensor, fired: int | None = None) -> None:
        self.batch.count(layer, mask, fired, rows=self.rows)

    def count_all(self, layer: int, activation: torch.Tensor) -> None:
        self.batch.count_all(layer, activation, rows=self.rows)
