"""What every family shares: the protocol the engine calls, the output head and a sequence's state.

A family module (llama.py, falcon.py, opt.py, mixtral.py) describes math only: `build(src, make_ffn)`
reads its tensors from a `TensorSource` (already on the devices the plan chose) and asks `make_ffn` for
each layer's FFN; `forward(tokens, pos, seq, last_only=...)` runs the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hotcold.config import ModelConfig
from hotcold.device import DevicePlan
from hotcold.ops import Norm, Weight, linear
from hotcold.state import SequenceState

# make_ffn(layer, weights, predictor or None, norm or None, expert=None) -> an FFN: ffn(x, seq) / ffn.apply(h, p, seq)
FFNMaker = Callable[..., Callable]


class Decoder(Protocol):
    config: ModelConfig
    layers: list

    def new_sequence(self, n_ctx: int) -> SequenceState: ...

    def forward(
        self, tokens: torch.Tensor, pos: int, seq: SequenceState, *, last_only: bool = False
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Head:
    """The output norm and projection, on their device; logits come back as float32 on the CPU."""

    norm: Norm
    weight: Weight  # [V, D]

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def __call__(self, x: torch.Tensor, *, last_only: bool) -> torch.Tensor:
        if last_only:
            x = x[-1:]
        x = x.to(self.device)
        return linear(self.norm(x), self.weight).float().cpu()


def new_sequence(config: ModelConfig, plan: DevicePlan, n_ctx: int) -> SequenceState:
    """A sequence's state with each layer's KV cache on that layer's attention device, in its dtype."""
    return SequenceState.new(config, plan.attention, plan.kv_dtypes(), n_ctx)
