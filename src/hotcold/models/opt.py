"""OPT family (PowerInfer's `opt` architecture): pre-norm LayerNorm blocks, biases everywhere, learned absolute
positions offset by 2 (row pos + 2 of `position_embd`, as in HF's OPTLearnedPositionalEmbedding), multi-head
attention without RoPE, output tied to `token_embd`.

FFN `act(up x + b_up)` then down (+ b_down); in the PowerInfer layout the transposed down keeps its bias under
`ffn_down_t.bias`. Inactive neurons contribute exactly 0, even where relu(b_up) > 0. The predictor sees the
residual after attention (before `ffn_norm`).

LayerNorm eps: PowerInfer's converter stores none (its runtime then uses 0); hotcold's converter writes
`opt.attention.layer_norm_epsilon` and the runtime defaults to HF's 1e-5 when the key is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotcold.config import ModelConfig
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from hotcold.models.base import (
    FFNMaker,
    Head,
    LayerSpec,
    layer_tails,
    new_sequence,
    one_call_decode,
    rope_attention_segments,
)
from hotcold.ops import LinearGroup, Norm, RopeTables, Weight, check_context, embed, linear
from hotcold.runtime.state import Batch, SequenceState
from hotcold.weights import TensorSource

POSITION_OFFSET = 2  # OPT's learned positions start at row 2


@dataclass(frozen=True)
class OPTLayer:
    attn_norm: Norm  # LayerNorm with bias
    qkv: LinearGroup  # wq, wk, wv [D, D]: one C call on the CPU
    q_bias: torch.Tensor
    k_bias: torch.Tensor
    v_bias: torch.Tensor
    wo: Weight
    wo_bias: torch.Tensor
    ffn: object  # an FFN: ffn(x, seq) owns ffn_norm
    device: torch.device
    spec: LayerSpec = LayerSpec(norm="layer", positions="learned", attn_bias=True)


class OPT:
    def __init__(
        self,
        config: ModelConfig,
        token_embd: Weight,
        position_embd: torch.Tensor,
        layers: list[OPTLayer],
        head,
        plan,
    ):
        self.config = config
        self.token_embd = token_embd
        self.position_embd = position_embd  # [P + 2, D] float32
        self.layers = layers
        self.head: Head = head
        self.plan = plan
        self.rope = RopeTables(
            config, [layer.device for layer in layers], rope_dim=0
        )  # positions are learned
        self.tails = layer_tails(layers)  # the one-call decode's layer tails (sparse/tails.py), or None
        self.decoder, self.static_step, self.cpu_decode = "eager", None, None  # chosen at load (decoders.py)

    @property
    def max_positions(self) -> int:
        return self.position_embd.shape[0] - POSITION_OFFSET

    def new_sequence(self, n_ctx: int) -> SequenceState:
        return new_sequence(self.config, self.plan, n_ctx)

    def forward(self, tokens: torch.Tensor, ctx: Batch, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T]: the batch's segments -> logits [T, V] (with last_only: each segment's last row)."""
        c = self.config
        T = tokens.shape[0]
        H, Dh = c.n_head, c.head_dim
        rows = []
        for _, _, seq, pos in ctx.segments():
            n = ctx.lengths[len(rows)]
            if pos + n > self.max_positions:
                raise ValueError(
                    f"context overflow: position {pos + n} exceeds OPT's {self.max_positions} learned positions"
                )
            check_context(pos + n, seq.kv.n_ctx)
            rows.append(self.position_embd[pos + POSITION_OFFSET : pos + n + POSITION_OFFSET])
        x = embed(self.token_embd, tokens) + (rows[0] if len(rows) == 1 else torch.cat(rows))
        if (
            y := one_call_decode(self, x, ctx)
        ) is not None:  # a decode step in one C call, where load chose it
            return self.head(y, ctx, last_only=last_only)
        for i, layer in enumerate(self.layers):
            x = x.to(layer.device)
            q, k, v = layer.qkv(x, layer.attn_norm)
            q, k, v = (
                (t + b).view(T, H, Dh) for t, b in ((q, layer.q_bias), (k, layer.k_bias), (v, layer.v_bias))
            )
            # no RoPE (self.rope rotates nothing): the attention kernels of every family
            attn = rope_attention_segments(ctx, i, q, k, v, self.rope, layer.device, neox=False)
            x = x + linear(attn, layer.wo, layer.wo_bias)
            x = x + layer.ffn(x, ctx)
        return self.head(x, ctx, last_only=last_only)


def build(src: TensorSource, make_ffn: FFNMaker) -> OPT:
    c = src.config
    D = c.n_embd
    if c.n_head_kv != c.n_head:
        raise GGUFError(f"{src.path}: OPT has no grouped KV heads (head_count_kv {c.n_head_kv})")
    layers = []
    for i in range(c.n_layer):
        w = {
            t: src.attention(t, i, (D, D)) for t in (names.ATTN_Q, names.ATTN_K, names.ATTN_V, names.ATTN_OUT)
        }
        b = {t: src.attention(t, i, (D,), "bias") for t in w}
        ffn_norm = src.norm(names.FFN_NORM, i, rms=False, bias=True)
        layers.append(
            OPTLayer(
                attn_norm=src.norm(names.ATTN_NORM, i, rms=False, bias=True),
                qkv=LinearGroup([w[names.ATTN_Q], w[names.ATTN_K], w[names.ATTN_V]]),
                q_bias=b[names.ATTN_Q],
                k_bias=b[names.ATTN_K],
                v_bias=b[names.ATTN_V],
                wo=w[names.ATTN_OUT],
                wo_bias=b[names.ATTN_OUT],
                ffn=make_ffn(i, src.ffn(i, gated=False, biases=True), src.predictor(i), ffn_norm),
                device=src.layer_device(i),
            )
        )
    positions = src.file.entry(names.tensor(names.POS_EMBD)).shape[0]
    position_embd = src.raw(names.POS_EMBD, None, (positions, D))
    position_embd = (
        cpu.dequantize_rows(position_embd)
        if isinstance(position_embd, QuantTensor)
        else position_embd.float()
    )
    head = Head(src.output_norm(rms=False, bias=True), src.output())
    return OPT(c, src.token_embd(), position_embd, layers, head, src.plan)
