"""LLaMA family: ReluLLaMA, ProSparse (llama layout), Bamboo (relu on gate and up), Mistral.

Tensor names are the GGUF ones; q/k are stored permuted by the converter (llama.cpp convention), so RoPE
rotates adjacent pairs. The FFN input is the normed residual; the predictor sees the residual itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotcold.config import ModelConfig
from hotcold.gguf_io import ModelFile
from hotcold.models.layers import (
    KVCache,
    LinearGroup,
    RopeTables,
    Weight,
    linear,
    rms_norm,
    rope_attention,
)
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import FFNFactory, FFNWeights, SparseFFN
from hotcold.sparse.predictor import Predictor, load_predictor


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    wq: Weight  # [H*Dh, D]
    wk: Weight  # [Hkv*Dh, D]
    wv: Weight  # [Hkv*Dh, D]
    wo: Weight  # [D, H*Dh]
    ffn_norm: torch.Tensor
    ffn_weights: FFNWeights
    predictor: Predictor | None
    ffn: object  # DenseFFN / SparseFFN / HybridFFN, chosen by the loader
    device: torch.device = torch.device("cpu")  # where the loader put this layer's attention
    qkv: LinearGroup = field(default_factory=LinearGroup)  # q, k and v in one C call on the CPU


class Llama:
    def __init__(
        self, config: ModelConfig, token_embd: Weight, layers: list[LlamaLayer], output_norm, output: Weight
    ):
        self.config = config
        self.token_embd = token_embd
        self.layers = layers
        self.output_norm = output_norm
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
        x = embed(self.token_embd, tokens)  # [T, D], on the CPU
        for i, layer in enumerate(self.layers):
            x = x.to(layer.device)
            cos, sin = self.rope(pos, T, layer.device)
            q, k, v = layer.qkv(x, [layer.wq, layer.wk, layer.wv], norm=(layer.attn_norm, c.norm_eps))
            q = q.view(T, c.n_head, c.head_dim)
            k, v = k.view(T, c.n_head_kv, c.head_dim), v.view(T, c.n_head_kv, c.head_dim)
            attn = rope_attention(
                q, k, v, cache, i, pos, cos, sin, neox=False, sliding_window=c.sliding_window
            )
            x = x + linear(attn, layer.wo)
            if isinstance(layer.ffn, SparseFFN):  # the FFN norm inside its one C call
                x = x + layer.ffn(x, x, norm=(layer.ffn_norm, c.norm_eps))
            else:
                x = x + layer.ffn(rms_norm(x, layer.ffn_norm, c.norm_eps), x)
        if last_only:
            x = x[-1:]
        x = x.to(self.output_device)
        return linear(rms_norm(x, self.output_norm, c.norm_eps), self.output).float().cpu()


def embed(token_embd: Weight, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(token_embd, QuantTensor):
        return token_embd.dequantize(tokens)
    return token_embd[tokens].float()


def build(model_file: ModelFile, config: ModelConfig, ffn_factory: FFNFactory) -> Llama:
    if config.n_expert:  # upstream llama.cpp writes Mixtral as arch llama with an expert count
        from hotcold.models import mixtral

        return mixtral.build(model_file, config, ffn_factory)
    c = config
    D, F, V = c.n_embd, c.n_ff, c.n_vocab
    t = model_file.tensor
    kind = (
        "gated_both"
        if c.arch == "bamboo" or model_file.metadata.get("hotcold.ffn_kind") == "gated_both"
        else "gated"
    )
    layers = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        sparse_layout = f"{p}ffn_down_t.weight" in model_file.tensors
        weights = FFNWeights(
            up=t(p + "ffn_up.weight", (F, D)),
            gate=t(p + "ffn_gate.weight", (F, D)),
            down_t=t(p + "ffn_down_t.weight", (F, D)) if sparse_layout else None,
            down=None if sparse_layout else t(p + "ffn_down.weight", (D, F)),
            kind=kind,
            activation=c.ffn_activation,
        )
        predictor = load_predictor(model_file, i, D, F, c.sparse_threshold) if c.sparse else None
        layers.append(
            LlamaLayer(
                **attention_tensors(model_file, i, c),
                ffn_weights=weights,
                predictor=predictor,
                ffn=ffn_factory(i, weights, predictor),
            )
        )
    token_embd = t("token_embd.weight", (V, D))
    output = t("output.weight", (V, D)) if "output.weight" in model_file.tensors else token_embd
    return Llama(c, token_embd, layers, t("output_norm.weight", (D,)).float(), output)


def attention_tensors(model_file: ModelFile, layer: int, config: ModelConfig) -> dict:
    """Layer `layer`'s norms and attention matrices, shape-checked (shared with the MoE family)."""
    c, t, p = config, model_file.tensor, f"blk.{layer}."
    D, qd, kvd = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    return dict(
        attn_norm=t(p + "attn_norm.weight", (D,)).float(),
        wq=t(p + "attn_q.weight", (qd, D)),
        wk=t(p + "attn_k.weight", (kvd, D)),
        wv=t(p + "attn_v.weight", (kvd, D)),
        wo=t(p + "attn_output.weight", (D, qd)),
        ffn_norm=t(p + "ffn_norm.weight", (D,)).float(),
    )
