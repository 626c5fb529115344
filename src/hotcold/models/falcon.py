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
from hotcold.gguf_io import ModelFile
from hotcold.models.layers import (
    KVCache,
    RopeTables,
    Weight,
    layer_norm,
    linear,
    rope_attention,
)
from hotcold.models.llama import embed
from hotcold.sparse.ffn import FFNFactory, FFNWeights
from hotcold.sparse.predictor import Predictor, load_predictor


@dataclass
class FalconLayer:
    attn_norm: torch.Tensor  # [D]: the FFN's norm (and attention's when attn_norm_2 is absent)
    attn_norm_b: torch.Tensor
    attn_norm_2: torch.Tensor | None  # [D]: attention's own norm (40B layout)
    attn_norm_2_b: torch.Tensor | None
    wqkv: Weight  # [(H + 2*Hkv)*Dh, D]
    wo: Weight  # [D, H*Dh]
    ffn_weights: FFNWeights
    predictor: Predictor | None
    ffn: object  # DenseFFN / SparseFFN / HybridFFN, chosen by the loader
    device: torch.device = torch.device("cpu")  # where the loader put this layer's attention


class Falcon:
    def __init__(
        self,
        config: ModelConfig,
        token_embd: Weight,
        layers: list[FalconLayer],
        output_norm: torch.Tensor,
        output_norm_b: torch.Tensor,
        output: Weight,
    ):
        self.config = config
        self.token_embd = token_embd
        self.layers = layers
        self.output_norm = output_norm
        self.output_norm_b = output_norm_b
        self.output = output
        self.output_device = torch.device("cpu")
        self.rope = RopeTables(config)

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache.for_layers(self.config, self.layers, n_ctx)

    def forward(
        self, tokens: torch.Tensor, pos: int, cache: KVCache, *, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, V] (or [1, V] with last_only)."""
        c = self.config
        T = tokens.shape[0]
        H, Hkv, Dh = c.n_head, c.n_head_kv, c.head_dim
        x = embed(self.token_embd, tokens)  # [T, D], on the CPU
        for i, layer in enumerate(self.layers):
            x = x.to(layer.device)
            cos, sin = self.rope(pos, T, layer.device)
            ffn_in = layer_norm(x, layer.attn_norm, layer.attn_norm_b, c.norm_eps)
            if layer.attn_norm_2 is not None:
                attn_in = layer_norm(x, layer.attn_norm_2, layer.attn_norm_2_b, c.norm_eps)
            else:
                attn_in = ffn_in
            qkv = linear(attn_in, layer.wqkv)  # [T, (H + 2*Hkv)*Dh]
            q, k, v = qkv.split((H * Dh, Hkv * Dh, Hkv * Dh), dim=-1)
            q, k, v = q.reshape(T, H, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dh)
            attn = linear(rope_attention(q, k, v, cache, i, pos, cos, sin, neox=True), layer.wo)
            x = x + attn + layer.ffn(ffn_in, x)  # parallel residual; the predictor sees the layer input
        if last_only:
            x = x[-1:]
        x = x.to(self.output_device)
        out = linear(layer_norm(x, self.output_norm, self.output_norm_b, c.norm_eps), self.output)
        return out.float().cpu()


def build(model_file: ModelFile, config: ModelConfig, ffn_factory: FFNFactory) -> Falcon:
    c = config
    D, F, V = c.n_embd, c.n_ff, c.n_vocab
    qkv_rows = (c.n_head + 2 * c.n_head_kv) * c.head_dim
    t, names = model_file.tensor, model_file.tensors

    def norm(name: str) -> torch.Tensor:
        return t(name, (D,)).float()

    layers = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        sparse_layout = f"{p}ffn_down_t.weight" in names
        weights = FFNWeights(
            up=t(p + "ffn_up.weight", (F, D)),
            gate=None,
            down_t=t(p + "ffn_down_t.weight", (F, D)) if sparse_layout else None,
            down=None if sparse_layout else t(p + "ffn_down.weight", (D, F)),
            kind="plain",
            activation=c.ffn_activation,
        )
        predictor = load_predictor(model_file, i, D, F, c.sparse_threshold) if c.sparse else None
        has_norm_2 = p + "attn_norm_2.weight" in names
        layers.append(
            FalconLayer(
                attn_norm=norm(p + "attn_norm.weight"),
                attn_norm_b=norm(p + "attn_norm.bias"),
                attn_norm_2=norm(p + "attn_norm_2.weight") if has_norm_2 else None,
                attn_norm_2_b=norm(p + "attn_norm_2.bias") if has_norm_2 else None,
                wqkv=t(p + "attn_qkv.weight", (qkv_rows, D)),
                wo=t(p + "attn_output.weight", (D, c.n_head * c.head_dim)),
                ffn_weights=weights,
                predictor=predictor,
                ffn=ffn_factory(i, weights, predictor),
            )
        )
    token_embd = t("token_embd.weight", (V, D))
    output = t("output.weight", (V, D)) if "output.weight" in names else token_embd
    return Falcon(c, token_embd, layers, norm("output_norm.weight"), norm("output_norm.bias"), output)
