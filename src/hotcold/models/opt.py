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

from dataclasses import dataclass, field

import torch

from hotcold.config import ModelConfig
from hotcold.gguf_io import ModelFile
from hotcold.models.layers import KVCache, LinearGroup, Weight, attention, layer_norm, linear
from hotcold.models.llama import embed
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import FFNFactory, FFNWeights
from hotcold.sparse.predictor import Predictor, load_predictor

POSITION_OFFSET = 2  # OPT's learned positions start at row 2


@dataclass
class OPTLayer:
    attn_norm: torch.Tensor  # [D]
    attn_norm_b: torch.Tensor
    wq: Weight  # [D, D]
    bq: torch.Tensor
    wk: Weight
    bk: torch.Tensor
    wv: Weight
    bv: torch.Tensor
    wo: Weight
    bo: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_norm_b: torch.Tensor
    ffn_weights: FFNWeights
    predictor: Predictor | None
    ffn: object  # DenseFFN / SparseFFN / HybridFFN, chosen by the loader
    device: torch.device = torch.device("cpu")  # where the loader put this layer's attention
    qkv: LinearGroup = field(default_factory=LinearGroup)  # q, k and v in one C call on the CPU


class OPT:
    def __init__(
        self,
        config: ModelConfig,
        token_embd: Weight,
        position_embd: torch.Tensor,
        layers: list[OPTLayer],
        output_norm: torch.Tensor,
        output_norm_b: torch.Tensor,
        output: Weight,
    ):
        self.config = config
        self.token_embd = token_embd
        self.position_embd = position_embd.float()  # [P + 2, D]
        self.layers = layers
        self.output_norm = output_norm
        self.output_norm_b = output_norm_b
        self.output = output
        self.output_device = torch.device("cpu")

    @property
    def max_positions(self) -> int:
        return self.position_embd.shape[0] - POSITION_OFFSET

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache.for_layers(self.config, self.layers, n_ctx)

    def forward(
        self, tokens: torch.Tensor, pos: int, cache: KVCache, *, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, V] (or [1, V] with last_only)."""
        c = self.config
        T = tokens.shape[0]
        H, Dh = c.n_head, c.head_dim
        if pos + T > self.max_positions:
            raise ValueError(
                f"context overflow: position {pos + T} exceeds OPT's {self.max_positions} learned positions"
            )
        x = (
            embed(self.token_embd, tokens)
            + self.position_embd[pos + POSITION_OFFSET : pos + T + POSITION_OFFSET]
        )
        for i, layer in enumerate(self.layers):
            x = x.to(layer.device)
            h = layer_norm(x, layer.attn_norm, layer.attn_norm_b, c.norm_eps)
            q, k, v = layer.qkv(h, [layer.wq, layer.wk, layer.wv])
            q, k, v = ((t + b).view(T, H, Dh) for t, b in ((q, layer.bq), (k, layer.bk), (v, layer.bv)))
            x = x + linear(attention(q, k, v, cache, i, pos), layer.wo, layer.bo)
            ffn_in = layer_norm(x, layer.ffn_norm, layer.ffn_norm_b, c.norm_eps)
            x = x + layer.ffn(ffn_in, x)
        if last_only:
            x = x[-1:]
        x = x.to(self.output_device)
        out = linear(layer_norm(x, self.output_norm, self.output_norm_b, c.norm_eps), self.output)
        return out.float().cpu()


def build(model_file: ModelFile, config: ModelConfig, ffn_factory: FFNFactory) -> OPT:
    c = config
    D, F, V = c.n_embd, c.n_ff, c.n_vocab
    if c.n_head_kv != c.n_head:
        raise ValueError(f"{model_file.path}: OPT has no grouped KV heads (head_count_kv {c.n_head_kv})")
    t, names = model_file.tensor, model_file.tensors

    def vec(name: str, n: int = D) -> torch.Tensor:
        return t(name, (n,)).float()

    layers = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        sparse_layout = f"{p}ffn_down_t.weight" in names
        down = "ffn_down_t" if sparse_layout else "ffn_down"
        weights = FFNWeights(
            up=t(p + "ffn_up.weight", (F, D)),
            gate=None,
            down_t=t(p + "ffn_down_t.weight", (F, D)) if sparse_layout else None,
            down=None if sparse_layout else t(p + "ffn_down.weight", (D, F)),
            up_bias=vec(p + "ffn_up.bias", F),
            down_bias=vec(p + down + ".bias"),
            kind="plain",
            activation=c.ffn_activation,
        )
        predictor = load_predictor(model_file, i, D, F, c.sparse_threshold) if c.sparse else None
        layers.append(
            OPTLayer(
                attn_norm=vec(p + "attn_norm.weight"),
                attn_norm_b=vec(p + "attn_norm.bias"),
                wq=t(p + "attn_q.weight", (D, D)),
                bq=vec(p + "attn_q.bias"),
                wk=t(p + "attn_k.weight", (D, D)),
                bk=vec(p + "attn_k.bias"),
                wv=t(p + "attn_v.weight", (D, D)),
                bv=vec(p + "attn_v.bias"),
                wo=t(p + "attn_output.weight", (D, D)),
                bo=vec(p + "attn_output.bias"),
                ffn_norm=vec(p + "ffn_norm.weight"),
                ffn_norm_b=vec(p + "ffn_norm.bias"),
                ffn_weights=weights,
                predictor=predictor,
                ffn=ffn_factory(i, weights, predictor),
            )
        )
    token_embd = t("token_embd.weight", (V, D))
    positions = model_file.entry("position_embd.weight").shape[0]
    position_embd = t("position_embd.weight", (positions, D))
    if isinstance(position_embd, QuantTensor):
        position_embd = position_embd.dequantize()
    output = t("output.weight", (V, D)) if "output.weight" in names else token_embd
    return OPT(
        c, token_embd, position_embd, layers, vec("output_norm.weight"), vec("output_norm.bias"), output
    )
