"""LLaMA family: ReluLLaMA, ProSparse (llama layout), Bamboo (relu on gate and up), Mistral, TurboSparse dReLU,
Llama 3.x (rope_freqs), Qwen2 / Qwen2.5 (q/k/v biases, NeoX RoPE), Qwen3 (per-head q/k norms, NeoX RoPE), Phi-3 /
Phi-4-mini (fused q/k/v and gate/up split at load, NeoX RoPE over part of a head), Gemma 2 and 3 (sandwich norms,
local and global layers; Gemma 2's soft-capped scores and logits): the layer description says which.

Tensor names are the GGUF ones; q/k are stored permuted by the converter (llama.cpp convention), so RoPE
rotates adjacent pairs. The FFN input is the RMS-normed residual; the predictor sees the residual itself.
Files with experts are Mixtral (the registry sends them to mixtral.py, which reuses this block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hotcold.config import ModelConfig
from hotcold.device import DevicePlan
from hotcold.gguf import names
from hotcold.kernels import cpu
from hotcold.models.base import (
    FFNMaker,
    Head,
    LayerSpec,
    decode_attention,
    layer_tails,
    new_sequence,
    one_call_decode,
    rope_attention_segments,
)
from hotcold.ops import LinearGroup, Norm, RopeTables, Weight, embed, linear
from hotcold.runtime.state import Batch, SequenceState
from hotcold.sparse.attention_inputs import SparseInputs, sparse_inputs
from hotcold.weights import TensorSource


@dataclass(frozen=True)
class ArchRules:
    """What upstream llama.cpp derives from the architecture rather than reads from the file (its per-arch
    load_arch_hparams), as data: the layer description of each layer follows from these and the file."""

    neox: bool = False  # RoPE rotates the two halves of a head (LLAMA_ROPE_TYPE_NEOX): q/k kept as stored
    swa_period: int = (
        0  # layer i global iff (i + 1) % period == 0, the others in the window (0: all windowed)
    )
    local_rope: bool = (
        False  # windowed layers: their own RoPE base (rope.freq_base_swa, else 10000), unscaled
    )
    embed_scale: bool = False  # embeddings times sqrt(width)
    wide_scale_depth: int = (
        0  # the model of this depth scales q.k by 1 / sqrt(width / heads), not 1 / sqrt(Dh)
    )


LLAMA_RULES = ArchRules()  # llama, bamboo, mistral: q/k permuted into adjacent pairs by their converters
ARCH_RULES = {
    "qwen2": ArchRules(neox=True),
    "qwen3": ArchRules(neox=True),
    "qwen3moe": ArchRules(neox=True),
    "phi3": ArchRules(neox=True),
    "gemma2": ArchRules(neox=True, swa_period=2, embed_scale=True, wide_scale_depth=46),  # 27B: 46 layers
    "gemma3": ArchRules(neox=True, swa_period=6, local_rope=True, embed_scale=True, wide_scale_depth=62),
    "gpt-oss": ArchRules(neox=True, swa_period=2),
    "smallthinker": ArchRules(neox=True),  # its window and NoPE layers: smallthinker.layer_pattern
}
NEOX_ROPE = {arch for arch, rules in ARCH_RULES.items() if rules.neox}
LOCAL_ROPE_BASE = 10000.0  # upstream's base for local layers where the file has no rope.freq_base_swa


@dataclass(frozen=True)
class LlamaLayer:
    attn_norm: Norm
    qkv: LinearGroup  # wq [H*Dh, D], wk, wv [Hkv*Dh, D]: one C call on the CPU, the norm folded in
    wo: Weight  # [D, H*Dh]
    ffn: object  # an FFN (dense, sparse, hybrid or MoE): ffn(x, seq), owns ffn_norm
    device: torch.device  # where this layer's attention and KV cache live
    spec: LayerSpec  # what it computes (the decoders read this)
    inputs: SparseInputs | None = None  # a sparsified file's input-sparse q/k/v and o (attention_inputs.py)
    q_bias: torch.Tensor | None = (
        None  # [H*Dh], k_bias / v_bias [Hkv*Dh]: Qwen2's q/k/v biases (spec.attn_bias)
    )
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: Norm | None = None  # [Dh]: Qwen3's RMS norm over each head of q, and of k (spec.qk_norm)
    k_norm: Norm | None = None
    post_attn_norm: Norm | None = None  # Gemma 3's sandwich norms, on attention's and the FFN's output
    post_ffn_norm: Norm | None = None
    wo_bias: torch.Tensor | None = None  # [D]: gpt-oss's bias on attention's output projection
    sinks: torch.Tensor | None = None  # [H] float32: gpt-oss's attention sinks (spec.sinks)


@dataclass(frozen=True)
class LayerOps:
    """Which code computes each part of one layer, chosen once at load from its description and its FFN
    (decoders.py chooses how whole decode steps run; these, the pieces of a forward the layers run one by one).
    A fast op answers None for a forward it does not run (more than one decode row, a norm it cannot fold) and
    the general op runs that forward: the one fallback contract (ARCHITECTURE.md)."""

    decode_attention: bool  # q/k/v, RoPE and attention of a decode token: one C call (two fused GPU launches)
    tail: (
        str  # "fused": o, residuals and the FFN in one C call (`fused`); "normed": each branch normed before
    )
    # its add (Gemma's sandwich norms) or the input-sparse o; "plain": o, then the FFN, op by op
    fused: object = None  # the layer's tail (sparse/tails.py) where tail is "fused"


def choose_ops(layer: LlamaLayer, tail, *, dense: bool) -> LayerOps:
    """The ops of `layer` (whose tail is `tail`: tails.layer_tail, or None) for sparse forwards, or (dense) for
    the dense reference, where input sparsity is off."""
    spec, input_sparse = layer.spec, layer.inputs is not None and not dense
    plain_qkv = not (spec.attn_bias or spec.qk_norm or spec.attn_scale or spec.sinks or spec.attn_softcap)
    decode_attention = plain_qkv and not input_sparse
    if spec.post_norms or input_sparse:
        return LayerOps(decode_attention, "normed")
    if layer.wo_bias is None and tail is not None and tail.eager:  # MoE tails run in the one-call decode only
        return LayerOps(decode_attention, "fused", tail)
    return LayerOps(decode_attention, "plain")


class Llama:
    def __init__(
        self,
        config: ModelConfig,
        token_embd: Weight,
        layers: list[LlamaLayer],
        head: Head,
        plan,
        rope_freqs=None,
    ):
        self.config = config
        self.token_embd = token_embd
        self.layers = layers
        self.head = head
        self.plan: DevicePlan = plan
        # rope_freqs: Llama 3.1's per-dimension RoPE scaling (the file's rope_freqs), or None
        devices = [layer.device for layer in layers]
        self.rope = RopeTables(config, devices, freq_factors=rope_freqs)
        # Gemma 3: local layers' RoPE (own base, no scaling); Gemma: embeddings scaled by sqrt(width)
        local = any(layer.spec.local_rope for layer in layers)
        self.rope_local = (
            RopeTables(config, devices, base=config.rope_base_swa or LOCAL_ROPE_BASE, scale=1.0)
            if local
            else None
        )
        rules = ARCH_RULES.get(config.arch, LLAMA_RULES)
        self.embed_scale = math.sqrt(config.n_embd) if rules.embed_scale else None
        # each layer's ops for sparse forwards and for the dense reference (they differ where input is sparse)
        self.tails = layer_tails(layers)  # each layer's tail as one C call, or None
        self.ops = {
            dense: [choose_ops(layer, tail, dense=dense) for layer, tail in zip(layers, self.tails)]
            for dense in (False, True)
        }
        # the decoder, chosen at load (decoders.choose_decoder): a fast one, or None for these layers one by one
        self.decoder, self.static_step, self.cpu_decode = "eager", None, None

    def new_sequence(self, n_ctx: int) -> SequenceState:
        return new_sequence(self.config, self.plan, n_ctx)

    def forward(self, tokens: torch.Tensor, ctx: Batch, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T]: the batch's segments, each at its own sequence's positions -> logits [T, V] (with
        last_only: [segments, V], each segment's last row)."""
        x = embed(self.token_embd, tokens)  # [T, D], on the CPU
        if self.embed_scale is not None:  # Gemma: the embedding times sqrt(width), in float32
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        # a decode step in one C call, where load chose it
        if (y := one_call_decode(self, x, ctx)) is not None:
            return self.head(y, ctx, last_only=last_only)
        watch = getattr(ctx.observe, "attention", None)  # calibration of input sparsity (sparsify.py)
        for i, (layer, ops) in enumerate(zip(self.layers, self.ops[bool(ctx.dense)])):
            x = x.to(layer.device)
            if watch is not None:
                watch(i, 0, layer.attn_norm(x))
            attn = self.attend(i, layer, ops, x, ctx)
            if watch is not None:
                watch(i, 1, attn)
            if ops.tail == "normed":
                inputs, post = None if ctx.dense else layer.inputs, layer.spec.post_norms
                o = inputs.o(attn, layer.wo, ctx) if inputs is not None else linear(attn, layer.wo)
                x = x + (layer.post_attn_norm(o) if post else o)
                f = layer.ffn(x, ctx)
                x = x + (layer.post_ffn_norm(f) if post else f)
                continue
            if ops.tail == "fused" and (y := ops.fused(attn, x, ctx)) is not None:
                x = y  # one C call, CPU decode
                continue
            x = x + linear(attn, layer.wo, layer.wo_bias)
            x = x + layer.ffn(x, ctx)
        return self.head(x, ctx, last_only=last_only)

    def attend(
        self,
        i: int,
        layer: LlamaLayer,
        ops: LayerOps,
        x: torch.Tensor,
        ctx: Batch,
        *,
        rope: RopeTables | None = None,
    ) -> torch.Tensor:
        """Layer i's attention over x [T, D] -> [T, H*Dh]: the decode op where load chose it and this forward is
        one it runs, else q/k/v (input-sparse where the layer is), biases, head norms and scale, RoPE attention.
        rope: the tables (None: the layer's, local or global)."""
        c, spec, T = self.config, layer.spec, x.shape[0]
        if rope is None:
            rope = self.rope_local if spec.local_rope else self.rope
        neox, window = spec.rope_neox, spec.sliding_window or None
        if ops.decode_attention:
            heads = (c.n_head, c.n_head_kv, c.head_dim)
            attn = decode_attention(
                ctx, i, layer.qkv, layer.attn_norm, x, rope, layer.device, heads=heads, neox=neox,
                sliding_window=window,
            )  # fmt: skip
            if attn is not None:
                return attn
        inputs = None if ctx.dense else layer.inputs
        q, k, v = inputs.qkv(x, layer.attn_norm, layer.qkv, ctx) if inputs else layer.qkv(x, layer.attn_norm)
        if spec.attn_bias:  # Qwen2's q/k/v biases
            q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
        if spec.qk_norm:  # each head of q and of k (Qwen3, Gemma 3), before RoPE
            q, k = head_norm(q, layer.q_norm, c.head_dim), head_norm(k, layer.k_norm, c.head_dim)
        if spec.attn_scale:  # the softmax scales by 1 / sqrt(Dh): q carries the rest
            q = q * (spec.attn_scale * math.sqrt(c.head_dim))
        q = q.view(T, c.n_head, c.head_dim)
        k, v = k.view(T, c.n_head_kv, c.head_dim), v.view(T, c.n_head_kv, c.head_dim)
        return rope_attention_segments(
            ctx, i, q, k, v, rope, layer.device, neox=neox, sliding_window=window, sinks=layer.sinks,
            softcap=spec.attn_softcap,
        )  # fmt: skip


def head_norm(x: torch.Tensor, norm: Norm, head_dim: int) -> torch.Tensor:
    """An RMS norm over each head of x [T, heads * Dh]: on the CPU the C kernels' (any row count, the bits of
    the one-call decode's), elsewhere torch's."""
    rows = x.reshape(-1, head_dim).contiguous()
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return cpu.rms_norm(rows, norm.weight.float().contiguous(), norm.eps).view(x.shape)
    return norm(rows).view(x.shape)


def attention_block(src: TensorSource, i: int) -> dict:
    """Layer i's attention norm and matrices, shape-checked, on the layer's device (shared with mixtral.py)."""
    c = src.config
    D, qd, kvd = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    if src.has(names.ATTN_QKV, i):  # Phi-3's fused q/k/v, split by rows at load: one C group as llama's
        wq, wk, wv = src.attention_split(names.ATTN_QKV, i, [qd, kvd, kvd], D)
    else:
        wq, wk, wv = (
            src.attention(t, i, (n, D))
            for t, n in ((names.ATTN_Q, qd), (names.ATTN_K, kvd), (names.ATTN_V, kvd))
        )
    inputs = None
    if src.sparse_inputs is not None:
        assets, sparsity, threads = src.sparse_inputs
        inputs = sparse_inputs(src, i, assets, sparsity, threads)
    biases = {}
    if src.has(names.ATTN_Q, i, "bias"):  # Qwen2: q/k/v biases (o has none); gpt-oss: o's too
        biases = {
            f"{n}_bias": src.attention(t, i, (rows,), "bias")
            for n, t, rows in (("q", names.ATTN_Q, qd), ("k", names.ATTN_K, kvd), ("v", names.ATTN_V, kvd))
        }
    if src.has(names.ATTN_OUT, i, "bias"):
        biases["wo_bias"] = src.attention(names.ATTN_OUT, i, (D,), "bias")
    if src.has(names.ATTN_SINKS, i):  # gpt-oss: one logit per head
        biases["sinks"] = src.attention(names.ATTN_SINKS, i, (c.n_head,)).float()
    norms = {}
    if src.has(names.ATTN_Q_NORM, i):  # Qwen3: per-head q/k RMS norms
        norms = {
            "q_norm": src.norm(names.ATTN_Q_NORM, i, rms=True, width=c.head_dim),
            "k_norm": src.norm(names.ATTN_K_NORM, i, rms=True, width=c.head_dim),
        }
    rules = ARCH_RULES.get(c.arch, LLAMA_RULES)
    windowed = not rules.swa_period or (i + 1) % rules.swa_period != 0
    window = (c.sliding_window or 0) if windowed else 0
    local = rules.local_rope and windowed
    scale = 1 / math.sqrt(c.n_embd / c.n_head) if c.n_layer == rules.wide_scale_depth else 0.0
    # Gemma 3's sandwich norms (gpt-oss's post_attention_norm is its FFN norm: gpt_oss.py reads it)
    if src.has(names.ATTN_POST_NORM, i) and c.arch != "gpt-oss":
        norms["post_attn_norm"] = src.norm(names.ATTN_POST_NORM, i, rms=True)
        norms["post_ffn_norm"] = src.norm(names.FFN_POST_NORM, i, rms=True)
    spec = LayerSpec(
        rope_neox=rules.neox, attn_bias="q_bias" in biases, sliding_window=window,
        input_sparse=inputs is not None, qk_norm="q_norm" in norms, post_norms="post_attn_norm" in norms,
        local_rope=local, attn_scale=scale, sinks="sinks" in biases, attn_softcap=c.attn_softcap,
    )  # fmt: skip
    return dict(
        **biases,
        **norms,
        attn_norm=src.norm(names.ATTN_NORM, i, rms=True),
        qkv=LinearGroup([wq, wk, wv], stack_on_gpu=True),  # one matrix for the fused decode kernels
        wo=src.attention(names.ATTN_OUT, i, (D, qd)),
        device=src.layer_device(i),
        spec=spec,
        inputs=inputs,
    )


def build(src: TensorSource, make_ffn: FFNMaker) -> Llama:
    c = src.config
    layers = []
    for i in range(c.n_layer):
        ffn = make_ffn(i, src.ffn(i, gated=True), src.predictor(i), src.norm(names.FFN_NORM, i, rms=True))
        layers.append(LlamaLayer(**attention_block(src, i), ffn=ffn))
    head = Head(src.output_norm(rms=True), src.output(), softcap=c.final_softcap)
    return Llama(c, src.token_embd(), layers, head, src.plan, rope_freqs=src.rope_freqs())
