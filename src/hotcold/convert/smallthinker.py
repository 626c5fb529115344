"""SmallThinker checkpoints (SmallThinkerForCausalLM: PowerInfer/SmallThinker-4BA0.6B, -21BA3B) -> GGUF, as upstream
llama.cpp's converter (conversion/smallthinker.py) writes them: arch `smallthinker`, the base text-model keys (the
head size always), the experts' count, top-k and width (`moe_num_primary_experts`, `moe_num_active_primary_experts`,
`moe_ffn_hidden_size`, the last also as feed_forward_length), `expert_gating_func` 1 (softmax, where
`moe_primary_router_apply_softmax`) or 2 (sigmoid), and `attention.sliding_window` where `sliding_window_layout`
has a windowed layer; q/k as stored (NeoX RoPE); the router `block_sparse_moe.primary_router` as
`blk.N.ffn_gate_inp.weight` [E, D] and the experts stacked as `blk.N.ffn_{gate,up}_exps.weight` [E, F, D],
`blk.N.ffn_down_exps.weight` [E, D, F]. The experts are ReLU-gated (the reader's default for the arch)."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint, ConvertError, rope_scaling, rope_theta
from hotcold.gguf import names

MODEL_TYPES = ("smallthinker",)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama_expert_gating_func_type


def architecture(config: dict[str, Any]) -> str:
    return "smallthinker"


def activation(config: dict[str, Any]) -> str:
    return "relu"


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    return config["num_hidden_layers"], config["hidden_size"], _experts(config)[2]


def _experts(config: dict[str, Any]) -> tuple[int, int, int]:
    n_expert = config.get("moe_num_primary_experts")
    n_used = config.get("moe_num_active_primary_experts")
    width = config.get("moe_ffn_hidden_size")
    if not n_expert or not n_used or not 1 <= n_used <= n_expert:
        raise ConvertError(
            f"config.json moe_num_primary_experts {n_expert} / moe_num_active_primary_experts {n_used}: "
            "need 1 <= active <= experts"
        )
    if not width:
        raise ConvertError("config.json: smallthinker without moe_ffn_hidden_size (each expert's width)")
    return int(n_expert), int(n_used), int(width)


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    n_expert, n_used, width = _experts(config)
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head

    def key(template: str) -> str:
        return names.key(template, arch)

    items = [
        (key(names.CONTEXT_LENGTH), int(config.get("max_position_embeddings", 2048)), V.UINT32),
        (key(names.EMBEDDING_LENGTH), config["hidden_size"], V.UINT32),
        (key(names.BLOCK_COUNT), config["num_hidden_layers"], V.UINT32),
        (key(names.FEED_FORWARD_LENGTH), width, V.UINT32),
        (key(names.HEAD_COUNT), n_head, V.UINT32),
        (key(names.HEAD_COUNT_KV), config.get("num_key_value_heads") or n_head, V.UINT32),
        (key(names.LAYERNORM_RMS_EPS), float(config.get("rms_norm_eps", 1e-6)), V.FLOAT32),
        (key(names.KEY_LENGTH), head_dim, V.UINT32),
        (key(names.VALUE_LENGTH), head_dim, V.UINT32),
        (key(names.EXPERT_COUNT), n_expert, V.UINT32),
        (key(names.EXPERT_USED_COUNT), n_used, V.UINT32),
        (key(names.EXPERT_FEED_FORWARD_LENGTH), width, V.UINT32),
        (f"{arch}.expert_gating_func", GATING_SOFTMAX if config.get("moe_primary_router_apply_softmax")
         else GATING_SIGMOID, V.UINT32),
    ]  # fmt: skip
    theta = rope_theta(config)
    if theta is not None:
        items.append((key(names.ROPE_FREQ_BASE), theta, V.FLOAT32))
    if rope_scaling(config) is not None:
        raise ConvertError("config.json: RoPE scaling on a SmallThinker checkpoint is not supported")
    if any(config.get("sliding_window_layout") or ()) and config.get("sliding_window_size"):
        items.append((key(names.SLIDING_WINDOW), int(config["sliding_window_size"]), V.UINT32))
    return items


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError(
            "smallthinker: per-neuron predictors are not supported (its experts skip rows by ReLU)"
        )
    n_expert, _, _ = _experts(config)
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        moe = hf + "block_sparse_moe."
        if moe + "primary_router.weight" not in ckpt:
            raise ConvertError(f"{ckpt.dir}: checkpoint has no router {moe}primary_router.weight")

        def stacked(which: str, moe=moe) -> torch.Tensor:
            return torch.stack([ckpt.get(f"{moe}experts.{e}.{which}.weight") for e in range(n_expert)])

        plan += [
            (names.tensor(names.ATTN_NORM, i), lambda n=hf + "input_layernorm.weight": ckpt.get(n)),
            *[(names.tensor(t, i), lambda n=f"{hf}self_attn.{p}_proj.weight": ckpt.get(n))
              for t, p in ((names.ATTN_Q, "q"), (names.ATTN_K, "k"), (names.ATTN_V, "v"), (names.ATTN_OUT, "o"))],
            (names.tensor(names.FFN_NORM, i), lambda n=hf + "post_attention_layernorm.weight": ckpt.get(n)),
            (names.tensor(names.FFN_ROUTER, i), lambda n=moe + "primary_router.weight": ckpt.get(n)),
            (names.tensor(names.FFN_GATE_EXPS, i), lambda s=stacked: s("gate")),
            (names.tensor(names.FFN_UP_EXPS, i), lambda s=stacked: s("up")),
            (names.tensor(names.FFN_DOWN_EXPS, i), lambda s=stacked: s("down")),
        ]  # fmt: skip
    return plan + llama.output_tensors(config, ckpt)
