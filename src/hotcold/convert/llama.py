"""LLaMA-family checkpoints (LlamaForCausalLM, MistralForCausalLM, Bamboo, ProSparse) -> GGUF tensors and keys,
laid out as PowerInfer's convert.py lays them out. Mistral is written as arch `llama` (as llama.cpp does), with its
sliding window when the config uses one; TurboSparse dReLU adds `hotcold.ffn_kind = "gated_both"` (see `drelu`)."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert.checkpoint import Checkpoint, ConvertError, llama3_rope_factors, rope_scaling, rope_theta
from hotcold.gguf import names

MODEL_TYPES = ("llama", "mistral", "bamboo")


def permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (the same permutation convert.py applies)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def architecture(config: dict[str, Any]) -> str:
    return "bamboo" if config.get("model_type") == "bamboo" else "llama"


def drelu(config: dict[str, Any]) -> bool:
    """dReLU, `relu(gate) * relu(up)` (TurboSparse-Mistral/-Mixtral). Their config.json says hidden_act "relu"
    and keeps dReLU in custom modeling code, so config.json must say it: `"hotcold_ffn_kind": "gated_both"`
    (or `"hidden_act": "drelu"`). Bamboo is dReLU by architecture and needs no flag."""
    return config.get("hotcold_ffn_kind") == "gated_both" or config.get("hidden_act") == "drelu"


def activation(config: dict[str, Any]) -> str:
    act = config.get("hidden_act", "silu")
    if act in ("drelu", "fatrelu"):
        # ProSparse's FATReLU (relu with a small cut-off) runs as plain ReLU gated by the predictor threshold,
        # as in PowerInfer; dReLU's second relu is the FFN kind (see drelu)
        return "relu"
    if act not in ("relu", "silu"):
        raise ConvertError(f"config.json hidden_act {act!r} is not supported for llama (relu or silu)")
    kind = config.get("hotcold_ffn_kind")
    if kind not in (None, "gated", "gated_both"):
        raise ConvertError(f"config.json hotcold_ffn_kind {kind!r} is not 'gated' or 'gated_both'")
    return act


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    """(n_layer, n_embd, n_ff): what every layer's predictor must fit."""
    return config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    n_head = config["num_attention_heads"]
    n_embd = config["hidden_size"]
    head_dim = config.get("head_dim") or n_embd // n_head

    def key(template: str) -> str:
        return names.key(template, arch)

    items = [
        (key(names.CONTEXT_LENGTH), int(config.get("max_position_embeddings", 2048)), V.UINT32),
        (key(names.EMBEDDING_LENGTH), n_embd, V.UINT32),
        (key(names.BLOCK_COUNT), config["num_hidden_layers"], V.UINT32),
        (key(names.FEED_FORWARD_LENGTH), config["intermediate_size"], V.UINT32),
        (key(names.ROPE_DIMENSION_COUNT), head_dim, V.UINT32),
        (key(names.HEAD_COUNT), n_head, V.UINT32),
        (key(names.HEAD_COUNT_KV), config.get("num_key_value_heads") or n_head, V.UINT32),
        (key(names.LAYERNORM_RMS_EPS), float(config.get("rms_norm_eps", 1e-6)), V.FLOAT32),
    ]
    if head_dim != n_embd // n_head or arch == "llama":  # upstream writes the head size for llama always
        items.append((key(names.KEY_LENGTH), head_dim, V.UINT32))
        items.append((key(names.VALUE_LENGTH), head_dim, V.UINT32))
    if arch == "llama" and config.get("vocab_size"):  # as upstream's llama converter
        items.append((key(names.VOCAB_SIZE), int(config["vocab_size"]), V.UINT32))
    theta = rope_theta(config)
    if theta is not None:
        items.append((key(names.ROPE_FREQ_BASE), theta, V.FLOAT32))
    scaling = rope_scaling(config, llama3=True)  # Llama 3.1's is a tensor (rope_tensors), not keys
    if scaling is not None:
        items.append((key(names.ROPE_SCALING_TYPE), scaling[0], V.STRING))
        items.append((key(names.ROPE_SCALING_FACTOR), scaling[1], V.FLOAT32))
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        items.append((key(names.SLIDING_WINDOW), int(config["sliding_window"]), V.UINT32))
    if drelu(config) and arch != "bamboo":
        items.append((names.FFN_KIND, "gated_both", V.STRING))
    return items


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    """(gguf name, loader returning a float torch tensor in GGUF numpy orientation)"""
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        plan += attention_tensors(config, ckpt, i)
        plan += [
            (names.tensor(names.FFN_GATE, i), lambda n=hf + "mlp.gate_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_UP, i), lambda n=hf + "mlp.up_proj.weight": ckpt.get(n)),
        ]
        down = hf + "mlp.down_proj.weight"
        if sparse_layout:
            plan.append((names.tensor(names.FFN_DOWN_T, i), lambda n=down: ckpt.get(n).T))
        else:
            plan.append((names.tensor(names.FFN_DOWN, i), lambda n=down: ckpt.get(n)))
    plan += output_tensors(config, ckpt)
    return plan + rope_tensors(config)


def rope_tensors(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """`rope_freqs.weight` for Llama 3.1-style RoPE scaling, as upstream llama.cpp writes it (else none)."""
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    factors = llama3_rope_factors(config, head_dim)
    return [] if factors is None else [(names.tensor(names.ROPE_FREQS), lambda: factors)]


def attention_tensors(config: dict[str, Any], ckpt: Checkpoint, i: int) -> list[tuple[str, Any]]:
    """Layer i's norms and attention (shared with Mixtral, whose layers differ only in the FFN)."""
    n_head = config["num_attention_heads"]
    n_head_kv = config.get("num_key_value_heads") or n_head
    hf = f"model.layers.{i}."
    return [
        (names.tensor(names.ATTN_NORM, i), lambda n=hf + "input_layernorm.weight": ckpt.get(n)),
        (
            names.tensor(names.ATTN_Q, i),
            lambda n=hf + "self_attn.q_proj.weight": permute(ckpt.get(n), n_head),
        ),
        (
            names.tensor(names.ATTN_K, i),
            lambda n=hf + "self_attn.k_proj.weight": permute(ckpt.get(n), n_head_kv),
        ),
        (names.tensor(names.ATTN_V, i), lambda n=hf + "self_attn.v_proj.weight": ckpt.get(n)),
        (names.tensor(names.ATTN_OUT, i), lambda n=hf + "self_attn.o_proj.weight": ckpt.get(n)),
        (names.tensor(names.FFN_NORM, i), lambda n=hf + "post_attention_layernorm.weight": ckpt.get(n)),
    ]


def output_tensors(config: dict[str, Any], ckpt: Checkpoint) -> list[tuple[str, Any]]:
    plan: list[tuple[str, Any]] = [(names.tensor(names.OUTPUT_NORM), lambda: ckpt.get("model.norm.weight"))]
    if "lm_head.weight" in ckpt and not config.get("tie_word_embeddings", False):
        plan.append((names.tensor(names.OUTPUT), lambda: ckpt.get("lm_head.weight")))
    return plan
