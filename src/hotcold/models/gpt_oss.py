"""gpt-oss (OpenAI's gpt-oss-20b / -120b), as upstream llama.cpp runs arch `gpt-oss` (LLM_ARCH_OPENAI_MOE).

The LLaMA block with:
- attention: q/k/v and o biases, NeoX RoPE with YaRN (config.rope_yarn, ops.yarn_corr_dims), a learned sink logit
  per head in each softmax's denominator (`blk.N.attn_sinks.weight` [H]), a sliding window on even layers and
  global attention on odd ones (upstream's swa pattern 2; `attention.sliding_window`);
- the FFN norm is `blk.N.post_attention_norm.weight`; the FFN a mixture of experts: router
  `blk.N.ffn_gate_inp.{weight,bias}` [E, D] / [E], top-k then a softmax over the chosen logits; experts stacked as
  `ffn_{gate,up}_exps.weight` [E, F, D] and `ffn_down_exps.weight` [E, D, F] with biases [E, F] / [E, D], each
  the clamped SwiGLU (sparse/ffn_weights.swiglu_oai, alpha 1.702, limit 7).

Expert matrices come as upstream's converter writes them: MXFP4 (ggml type 39) from the original checkpoint, read
in place by the C kernels as any block type (4.25 bits a weight), or any float / block type.
On the CPU a decode token is one C call (the sinks in the C attention, the router's and the experts' biases and the
clamped SwiGLU in the C MoE tail; the eager layers call the same C attention and combine); the GPU's fixed-shape step
has none of them (LayerSpec.beyond_llama).
"""

from __future__ import annotations

from dataclasses import replace

from hotcold.device import place_vector
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError
from hotcold.models.base import FFNMaker, Head
from hotcold.models.llama import Llama, LlamaLayer, attention_block
from hotcold.models.mixtral import expert_weights
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.moe import MoEFFN
from hotcold.weights import TensorSource


class GptOss(Llama):
    """Llama's attention and residual stream (sinks, biases and windows from each layer's spec); each layer's
    `ffn` is a MoEFFN over clamped-SwiGLU experts."""


def oai_experts(src: TensorSource, i: int) -> list[FFNWeights]:
    """Layer i's experts with their biases: gate and up [E, F], down [E, D], float32 on the layer's FFN device."""
    c = src.config
    D, F, E = c.n_embd, c.n_ff, c.n_expert
    device = src.plan.ffn[i]

    def bias(template: str, rows: int):
        return place_vector(src.raw(template, i, (E, rows), "bias"), device).float()

    up_b, gate_b, down_b = (
        bias(names.FFN_UP_EXPS, F),
        bias(names.FFN_GATE_EXPS, F),
        bias(names.FFN_DOWN_EXPS, D),
    )
    return [
        replace(w, up_bias=up_b[e], gate_bias=gate_b[e], down_bias=down_b[e])
        for e, w in enumerate(expert_weights(src, i))
    ]


def build(src: TensorSource, make_ffn: FFNMaker) -> GptOss:
    c = src.config
    D, E = c.n_embd, c.n_expert
    if E < 1 or not 1 <= c.n_expert_used <= E:
        raise GGUFError(
            f"{src.path}: expert_count {E} / expert_used_count {c.n_expert_used}: need 1 <= used <= count"
        )
    if not c.sliding_window:  # upstream requires it: its even layers attend in the window
        raise GGUFError(f"{src.path}: missing metadata key {c.arch}.attention.sliding_window")
    if c.sparse:
        raise GGUFError(
            f"{src.path}: gpt-oss files with predictors are not supported (its experts are SwiGLU)"
        )
    qd, kvd = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    required = [(names.ATTN_Q, qd, "bias"), (names.ATTN_K, kvd, "bias"), (names.ATTN_V, kvd, "bias"),
                (names.ATTN_OUT, D, "bias"), (names.ATTN_SINKS, c.n_head, "weight")]  # fmt: skip
    layers = []
    for i in range(c.n_layer):
        for template, rows, suffix in required:  # optional in llama's block, required by upstream here: named
            src.raw(template, i, (rows,), suffix)
        attention = attention_block(src, i)
        experts = [make_ffn(i, w, None, None, expert=e) for e, w in enumerate(oai_experts(src, i))]
        norm = src.norm(names.ATTN_POST_NORM, i, rms=True)  # the FFN's norm
        router = src.attention(names.FFN_ROUTER, i, (E, D))
        router_bias = src.attention(names.FFN_ROUTER, i, (E,), "bias").float()
        ffn = MoEFFN(
            router, src.experts(i, experts), c.n_expert_used, layer=i, norm=norm, router_bias=router_bias
        )
        attention["spec"] = replace(attention["spec"], moe=True, oai_experts=True)
        layers.append(LlamaLayer(**attention, ffn=ffn))
    head = Head(src.output_norm(rms=True), src.output())
    return GptOss(c, src.token_embd(), layers, head, src.plan)
