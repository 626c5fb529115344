"""Falcon family: ReluFalcon (PowerInfer) and dense Falcon GGUF files (GELU).

Parallel attention and FFN off the same layer input: `out = ffn(norm(x)) + attn(norm'(x)) + x`. Falcon-7B has
one LayerNorm (`attn_norm`) for both branches; the 40B layout (`new_decoder_architecture`) adds `attn_norm_2`
(HF `ln_attn`) for attention while `attn_norm` (HF `ln_mlp`) feeds the FFN, as llama.cpp maps them. The fused
`attn_qkv` is in the "jploski" layout the converters write: all q heads, then all k heads, then all v heads.
Multi-query / grouped KV, NEOX RoPE, no FFN gate. The predictor sees the layer input x, before any norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotcold.config import ModelConfig
from hotcold.gguf import names
from hotcold.models.base import (
    FFNMaker,
    Head,
    LayerSpec,
    layer_tails,
    new_sequence,
    one_call_decode,
    rope_attention_segments,
)
from hotcold.ops import LinearGroup, Norm, RopeTables, Weight, embed, linear
from hotcold.runtime.state import Batch, SequenceState
from hotcold.weights import TensorSource


@dataclass(frozen=True)
class FalconLayer:
    attn_norm: Norm  # attention's norm: attn_norm_2 in the 40B layout, else attn_norm (shared with the FFN)
    qkv: (
        LinearGroup  # wq [H*Dh, D], wk, wv [Hkv*Dh, D]: the file's attn_qkv split by rows at load, one C call
    )
    wo: Weight  # [D, H*Dh]
    ffn: object  # an FFN: ffn(x, seq) norms the layer input with attn_norm itself
    device: torch.device
    spec: LayerSpec = LayerSpec(norm="layer", residual="parallel", rope_neox=True)


class Falcon:
    def __init__(self, config: ModelConfig, token_embd: Weight, layers: list[FalconLayer], head: Head, plan):
        self.config = config
        self.token_embd = token_embd
        self.layers = layers
        self.head = head
        self.plan = plan
        self.rope = RopeTables(config, [layer.device for layer in layers])
        self.tails = layer_tails(layers)  # the one-call decode's layer tails (sparse/tails.py), or None
        self.decoder, self.static_step, self.cpu_decode = "eager", None, None  # chosen at load (decoders.py)

    def new_sequence(self, n_ctx: int) -> SequenceState:
        return new_sequence(self.config, self.plan, n_ctx)

    def forward(self, tokens: torch.Tensor, ctx: Batch, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T]: the batch's segments -> logits [T, V] (with last_only: each segment's last row)."""
        c = self.config
        T = tokens.shape[0]
        H, Hkv, Dh = c.n_head, c.n_head_kv, c.head_dim
        x = embed(self.token_embd, tokens)  # [T, D], on the CPU
        if (
            y := one_call_decode(self, x, ctx)
        ) is not None:  # a decode step in one C call, where load chose it
            return self.head(y, ctx, last_only=last_only)
        for i, layer in enumerate(self.layers):
            x = x.to(layer.device)
            q, k, v = layer.qkv(x, layer.attn_norm)
            q, k, v = q.reshape(T, H, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dh)

            attn = rope_attention_segments(ctx, i, q, k, v, self.rope, layer.device, neox=True)
            x = x + linear(attn, layer.wo) + layer.ffn(x, ctx)  # parallel residual off the layer input
        return self.head(x, ctx, last_only=last_only)


def build(src: TensorSource, make_ffn: FFNMaker) -> Falcon:
    c = src.config
    qkv_rows = [c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.head_dim]  # q, k, v
    layers = []
    for i in range(c.n_layer):
        ffn_norm = src.norm(names.ATTN_NORM, i, rms=False, bias=True)
        attn_norm = (
            src.norm(names.ATTN_NORM_2, i, rms=False, bias=True)
            if src.has(names.ATTN_NORM_2, i)
            else ffn_norm
        )
        layers.append(
            FalconLayer(
                attn_norm=attn_norm,
                qkv=LinearGroup(
                    src.attention_split(names.ATTN_QKV, i, qkv_rows, c.n_embd), stack_on_gpu=True
                ),
                wo=src.attention(names.ATTN_OUT, i, (c.n_embd, c.n_head * c.head_dim)),
                ffn=make_ffn(i, src.ffn(i, gated=False), src.predictor(i), ffn_norm),
                device=src.layer_device(i),
            )
        )
    head = Head(src.output_norm(rms=False, bias=True), src.output())
    return Falcon(c, src.token_embd(), layers, head, src.plan)
