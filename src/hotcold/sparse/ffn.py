"""The FFN block of every family, computed densely (the reference) or sparsely (only firing neurons).

A family says how gate and up combine (`kind`) and which activation it uses; the loader chooses dense,
sparse or hybrid. Neuron i is row i of up, gate and down_t.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hotcold.kernels import cpu
from hotcold.models.layers import C_NORM_MAX_TOKENS, LinearGroup, Weight, linear, rms_norm, uses_c_kernels
from hotcold.sparse.predictor import Predictor

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu": F.gelu,
}

# how a family combines its projections:
#   gated       act(gate) * up            (llama, ProSparse, mistral)
#   gated_both  act(gate) * act(up)       (bamboo, TurboSparse dReLU)
#   plain       act(up + b_up)            (falcon, opt)
KINDS = ("gated", "gated_both", "plain")


@dataclass
class FFNWeights:
    up: Weight  # [F, D]
    gate: Weight | None  # [F, D]
    down_t: Weight | None  # [F, D]: row i = neuron i's output direction (PowerInfer layout)
    down: Weight | None = None  # [D, F]: dense GGUF layout (used when down_t is absent)
    up_bias: torch.Tensor | None = None  # [F]
    down_bias: torch.Tensor | None = None  # [D]
    kind: str = "gated"
    activation: str = "relu"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown FFN kind {self.kind!r}; expected one of {KINDS}")
        if self.kind != "plain" and self.gate is None:
            raise ValueError(f"FFN kind {self.kind!r} needs a gate projection")
        if (self.down_t is None) == (self.down is None):
            raise ValueError("FFN needs exactly one of down_t [F, D] and down [D, F]")

    @property
    def n_ff(self) -> int:
        return self.up.shape[0]

    def combine(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        if self.up_bias is not None:
            up = up + self.up_bias
        if self.kind == "gated":
            return act(gate) * up
        if self.kind == "gated_both":
            return act(gate) * act(up)
        return act(up)


@dataclass
class FFNStats:
    """Neurons computed vs neurons in the layer, summed over tokens (for the reported firing rate)."""

    computed: int = 0
    total: int = 0

    @property
    def rate(self) -> float:
        return self.computed / self.total if self.total else 0.0


# observer(ffn_input [T, D], pred_input [T, D], activation [T, F]): sees the true activations of a dense
# forward; profiling and predictor training use it.
Observer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class DenseFFN:
    """Every neuron: the reference path (`--dense`) and the path for dense GGUF files."""

    def __init__(self, weights: FFNWeights):
        self.weights = weights
        self.stats = FFNStats()
        self.observer: Observer | None = None
        self.up_gate = LinearGroup()  # up and gate in one C call on the CPU

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weights
        if w.gate is not None:
            up, gate = self.up_gate(x, [w.up, w.gate])
        else:
            up, gate = linear(x, w.up), None
        a = w.combine(up, gate)
        if self.observer is not None:
            self.observer(x, pred_input, a)
        if w.down is not None:
            out = linear(a, w.down)
        else:
            out = down_projection(w.down_t, a, None)
        self.stats.computed += a.numel()
        self.stats.total += a.numel()
        return out + w.down_bias if w.down_bias is not None else out


class SparseFFN:
    """Only the neurons the predictor selects, per token: row-gather GEMV for up/gate, axpy over down_t."""

    def __init__(
        self,
        weights: FFNWeights,
        predictor: Callable[[torch.Tensor], torch.Tensor],
        *,
        threads: int | None = None,
    ):
        if weights.down_t is None:
            raise ValueError("sparse FFN needs the PowerInfer layout (ffn_down_t)")
        self.weights = weights
        self.predictor = predictor
        self.threads = threads
        self.stats = FFNStats()
        self._plan_key: tuple | None = None
        self._plan = None  # cpu.SparseFFNPlan for the one-call CPU step, when it applies

    def __call__(
        self, x: torch.Tensor, pred_input: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """x: the FFN input, or with norm = (weight, eps) the residual that rms_norm turns into it (for a few
        tokens the norm then runs inside the one C call)."""
        w = self.weights
        # the CPU kernels run on the CPU even when this layer's attention was placed on a GPU
        out_device, x = x.device, x.to("cpu")
        fused = self._fused(x, pred_input, norm)
        if fused is not None:
            out, fired = fused
            self.stats.computed += fired
            self.stats.total += x.shape[0] * w.n_ff
            out = out + w.down_bias if w.down_bias is not None else out
            return out.to(out_device)
        if norm is not None:
            x = rms_norm(x, *norm)
        mask = self.predictor(pred_input).to("cpu")  # [T, F] bool
        live, gate = mask, None
        if w.gate is not None:
            # gate first: where relu(gate) is 0 (a predictor's false positive) up need not be read
            gate = cpu.gather_matvec(w.gate, x, mask, threads=self.threads)
            if w.activation == "relu":
                live = mask & (torch.relu(gate) != 0)
        up = cpu.gather_matvec(w.up, x, live, threads=self.threads)
        # inactive neurons contribute exactly 0, even where a bias would make act(b) nonzero (OPT)
        a = torch.where(live, w.combine(up, gate), 0.0)
        out = cpu.sparse_axpy(w.down_t, a, live, threads=self.threads)
        self.stats.computed += int(mask.sum())
        self.stats.total += mask.numel()
        out = out + w.down_bias if w.down_bias is not None else out
        return out.to(out_device)

    def _fused(
        self, x: torch.Tensor, pred_input: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """The whole step in one C call (same results bit for bit), where it applies: ReLU, a CPU predictor
        whose matmuls also run in the C kernels (not float32 tensors, which torch multiplies), and few
        tokens (a prefill batch's matmuls go to torch's GEMM instead)."""
        if x.shape[0] >= cpu.GEMM_MIN_TOKENS:
            return None
        w, pred = self.weights, self.predictor
        key = (w.up, w.gate, w.down_t, w.up_bias, w.kind, w.activation, pred)
        if self._plan_key is None or any(a is not b for a, b in zip(key, self._plan_key, strict=True)):
            self._plan_key, self._plan = key, None  # built once; rebuilt only if the weights are replaced
            if (
                w.activation == "relu"
                and isinstance(pred, Predictor)
                and all(uses_c_kernels(m) for m in (pred.fc1, pred.fc2, w.up, w.down_t))
                and (w.gate is None or uses_c_kernels(w.gate))
                and cpu.backend() == "c"
            ):
                self._plan = cpu.SparseFFNPlan(
                    w.up,
                    w.gate,
                    w.down_t,
                    kind=w.kind,
                    up_bias=w.up_bias,
                    fc1=pred.fc1,
                    fc2=pred.fc2,
                    threshold=pred.threshold,
                )
        if self._plan is None or self._plan.threshold != pred.threshold:
            return None
        if norm is not None and x.shape[0] > C_NORM_MAX_TOKENS:  # the norm as rms_norm computes it there
            x, norm = rms_norm(x, *norm), None
        res = self._plan(x, pred_input.to("cpu"), norm=norm, threads=self.threads)
        return None if res is None else (res[0], res[2])


def down_projection(down_t: Weight, a: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum_i a[:, i] * down_t[i] -> [T, D]"""
    if (
        isinstance(down_t, torch.Tensor)
        and mask is None
        and (down_t.dtype == torch.float32 or down_t.device.type != "cpu")
    ):
        return (a.to(down_t.dtype) @ down_t).float()
    return cpu.sparse_axpy(down_t, a, mask)


@dataclass
class FFNFactory:
    """Chosen by the loader: how each layer's FFN is computed."""

    dense: bool = False
    threads: int | None = None
    make_hybrid: Callable | None = field(default=None, repr=False)

    def __call__(self, layer: int, weights: FFNWeights, predictor) -> Callable:
        if self.dense or predictor is None or weights.down_t is None:
            return DenseFFN(weights)
        if self.make_hybrid is not None:
            return self.make_hybrid(layer, weights, predictor)
        return SparseFFN(weights, predictor, threads=self.threads)
