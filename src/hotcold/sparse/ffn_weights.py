"""An FFN's weights and how a family combines them (`FFNWeights`: kind, activation, biases, the order its rows
are kept in), and the activations every CPU path shares (the C kernels' SiLU and GELU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotcold.gguf.names import FFN_KINDS
from hotcold.kernels import ffn_calls
from hotcold.ops import Weight


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU: for CPU float32 tensors the C kernels' (ffn_calls.ffn_combine), the one SiLU of every CPU path (the
    dense decode tail's included, so a row's bits never depend on its path); torch's elsewhere."""
    out = ffn_calls.ffn_combine("plain", "silu", x, None, None)
    return F.silu(x) if out is None else out


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU (erf form, or approximate="tanh": Gemma's): for CPU float32 tensors the C kernels' (ffn_calls.ffn_combine),
    the one GELU of every CPU path (the one-call decode's included); torch's elsewhere."""
    out = ffn_calls.ffn_combine("plain", "gelu_tanh" if approximate == "tanh" else "gelu", x, None, None)
    return F.gelu(x, approximate=approximate) if out is None else out


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0  # gpt-oss's, constants in llama.cpp (build_moe_ffn)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, as ggml_swiglu_oai: g = min(gate, limit), u = clamp(up, -limit, limit),
    g / (1 + exp(-alpha g)) * (u + 1) (transformers' GptOssExperts: (up + 1) * gate * sigmoid(alpha * gate))."""
    g = gate.clamp(max=SWIGLU_OAI_LIMIT)
    u = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return g / (1 + torch.exp(-SWIGLU_OAI_ALPHA * g)) * (u + 1)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "silu": silu,
    "gelu": gelu,
    "gelu_tanh": lambda x: gelu(x, approximate="tanh"),  # Gemma's
}


@dataclass
class FFNWeights:
    """How a family combines its projections (`kind`):
    gated       act(gate) * up            (llama, ProSparse, mistral)
    gated_both  act(gate) * act(up)       (bamboo, TurboSparse dReLU)
    plain       act(up + b_up)            (falcon, opt)
    swiglu_oai  swiglu_oai(gate + b_gate, up + b_up)   (gpt-oss's experts; `activation` unused)"""

    up: Weight  # [F, D]
    gate: Weight | None  # [F, D]
    down_t: Weight | None  # [F, D]: row i = neuron i's output direction (PowerInfer layout)
    down: Weight | None = None  # [D, F]: dense GGUF layout (used when down_t is absent)
    up_bias: torch.Tensor | None = None  # [F]
    down_bias: torch.Tensor | None = None  # [D]
    kind: str = "gated"
    activation: str = "relu"
    # row i of up, gate and down_t (and up_bias[i]) is the file's neuron order[i] (TensorSource puts the
    # hottest neurons first); None: the file's order
    order: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None  # [F]: gpt-oss's experts (kind swiglu_oai)

    def __post_init__(self):
        if self.kind not in FFN_KINDS:
            raise ValueError(f"unknown FFN kind {self.kind!r}; expected one of {FFN_KINDS}")
        if self.kind != "plain" and self.gate is None:
            raise ValueError(f"FFN kind {self.kind!r} needs a gate projection")
        if (self.down_t is None) == (self.down is None):
            raise ValueError("FFN needs exactly one of down_t [F, D] and down [D, F]")

    @property
    def n_ff(self) -> int:
        return self.up.shape[0]

    def in_file_order(self, per_neuron: torch.Tensor) -> torch.Tensor:
        """[T, F] values per neuron (a mask, an activation) with the columns in the file's neuron order,
        whatever order the rows are kept in: what profiling and predictor training record."""
        if self.order is None:
            return per_neuron
        file_order = torch.empty_like(per_neuron)
        file_order[:, self.order.to(per_neuron.device)] = per_neuron
        return file_order

    def combine(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "swiglu_oai":  # one C call on the CPU (the one-call decode's), else torch's ops
            fused = ffn_calls.ffn_combine(self.kind, self.activation, up, gate, self.up_bias, self.gate_bias)
            if fused is not None:
                return fused
            up = up if self.up_bias is None else up + self.up_bias
            return swiglu_oai(gate if self.gate_bias is None else gate + self.gate_bias, up)
        # CPU float32 tensors: one C call (relu: torch's bits; silu: the one CPU SiLU, see `silu`)
        fused = ffn_calls.ffn_combine(self.kind, self.activation, up, gate, self.up_bias)
        if fused is not None:
            return fused
        act = ACTIVATIONS[self.activation]
        if self.up_bias is not None:
            up = up + self.up_bias
        if self.kind == "gated":
            return act(gate) * up
        if self.kind == "gated_both":
            return act(gate) * act(up)
        return act(up)

    def add_down_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.down_bias is None else out + self.down_bias.to(out.device)
