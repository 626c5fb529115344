"""Per-sequence state: everything one sequence's forwards write, passed with every forward and never kept
on the model. The model's objects are immutable after load, so any number of sequences (the server's
slots, threads of a program) can run forwards of one loaded model at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

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
        self.k = [torch.zeros(shape, dtype=t, device=d) for d, t in zip(devices, dtypes, strict=True)]
        self.v = [torch.zeros(shape, dtype=t, device=d) for d, t in zip(devices, dtypes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


@dataclass
class FFNCounts:
    """Neurons computed vs neurons in the layer (or in the experts routed to), summed over tokens."""

    computed: int = 0
    total: int = 0

    @property
    def rate(self) -> float:
        return self.computed / self.total if self.total else 0.0


@dataclass
class SequenceState:
    """One sequence: its KV cache, what its forwards report back, and how it wants them run.

    dense: compute every neuron whatever the FFN kind (the reference a sparse model is judged by);
    observe: called by every layer's dense FFN evaluation (see Observer);
    keep_masks: remember each layer's last predictor input and mask in `masks`."""

    kv: KVCache
    counts: list[FFNCounts]
    routing: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, k] experts, best first
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dense: bool = False
    observe: Observer | None = None
    keep_masks: bool = False

    @classmethod
    def new(cls, config, devices: Sequence[torch.device], dtypes: Sequence[torch.dtype], n_ctx: int):
        kv = KVCache(config.n_layer, n_ctx, config.n_head_kv, config.head_dim, devices=devices, dtypes=dtypes)
        return cls(kv, [FFNCounts() for _ in range(config.n_layer)])

    def count(self, layer: int, computed: int, total: int) -> None:
        c = self.counts[layer]
        c.computed += computed
        c.total += total

    def neuron_totals(self) -> tuple[int, int]:
        """(computed, total) over every layer so far."""
        return sum(c.computed for c in self.counts), sum(c.total for c in self.counts)
