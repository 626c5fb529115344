"""Phi-3 / Phi-4-mini checkpoints (Phi3ForCausalLM) -> GGUF, as upstream llama.cpp's converter writes them: arch
`phi3`, the llama keys with the rotated part of a head (`partial_rotary_factor`), the fused `attn_qkv` (q, k, v
rows as stored: NeoX RoPE, no permutation) and the fused `ffn_up` ([gate; up] rows: 2 x n_ff), the output tied to
the embedding where the checkpoint ties it. Long-context variants (longrope: Phi-3-*-128k, Phi-3.5-mini, Phi-4-mini)
get upstream's `rope_factors_long` / `rope_factors_short` tensors and `rope.scaling.attn_factor`
(sqrt(1 + ln(scale) / ln(original context)), scale = max_position_embeddings / the original context)."""

from __future__ import annotations

import math
from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint, ConvertError, rope_scaling_params
from hotcold.gguf import names

MODEL_TYPES = ("phi3",)
LONGROPE = ("longrope", "su")  # "su": the name the first 128k checkpoints gave it


def architecture(config: dict[str, Any]) -> str:
    return "phi3"


activation = llama.activation
dims = llama.dims


def _rope_dim(config: dict[str, Any]) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    _, params = rope_scaling_params(config)
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * float(factor))


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    kind, params = rope_scaling_params(config)
    if kind not in (None, "default", *LONGROPE):
        raise ConvertError(f"config.json: phi3 rope scaling {kind!r} is not supported (only longrope)")
    dim_key, window_key = names.key(names.ROPE_DIMENSION_COUNT, arch), names.key(names.SLIDING_WINDOW, arch)
    plain = config  # llama's keys know no longrope: its factors are tensors here, not keys
    if kind in LONGROPE:
        plain = dict(config)
        for field in ("rope_scaling", "rope_parameters"):
            if isinstance(config.get(field), dict):
                plain[field] = {**config[field], "rope_type": "default", "type": "default"}
    items = [
        (k, _rope_dim(config), t) if k == dim_key else (k, v, t) for k, v, t in llama.metadata(plain, arch)
    ]
    items = [item for item in items if item[0] != window_key]
    original = params.get("original_max_position_embeddings")
    original = original or config.get(
        "original_max_position_embeddings", config.get("max_position_embeddings")
    )
    if kind in LONGROPE:
        scale = config["max_position_embeddings"] / int(original)
        factor = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1.0 else 1.0
        items.append((names.key(names.ROPE_SCALING_ATTN_FACTOR, arch), factor, V.FLOAT32))
    return items + [
        (names.key(names.ROPE_SCALING_ORIG_CTX_LEN, arch), int(original), V.UINT32),
        # upstream writes 0 for no window (it tells Phi-4 from the other Phi-3 models by it)
        (window_key, int(config.get("sliding_window") or 0), V.UINT32),
    ]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError("phi3: predictors need a ReLU model (Phi-3 is SwiGLU); convert it dense")
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        plan += [
            (names.tensor(names.ATTN_NORM, i), lambda n=hf + "input_layernorm.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_QKV, i), lambda n=hf + "self_attn.qkv_proj.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_OUT, i), lambda n=hf + "self_attn.o_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_NORM, i), lambda n=hf + "post_attention_layernorm.weight": ckpt.get(n)),
            (names.tensor(names.FFN_UP, i), lambda n=hf + "mlp.gate_up_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_DOWN, i), lambda n=hf + "mlp.down_proj.weight": ckpt.get(n)),
        ]
    return plan + llama.output_tensors(config, ckpt) + _longrope_tensors(config)


def _longrope_tensors(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """rope_factors_long / rope_factors_short [rope_dim / 2], float32, as upstream writes them (else none)."""
    kind, params = rope_scaling_params(config)
    if kind not in LONGROPE:
        return []
    long, short = params.get("long_factor"), params.get("short_factor")
    half = _rope_dim(config) // 2
    if long is None or short is None or len(long) != half or len(short) != half:
        raise ConvertError(
            f"config.json: longrope needs rope_scaling long_factor and short_factor of {half} values each "
            f"(got {None if long is None else len(long)} and {None if short is None else len(short)})"
        )
    return [
        (names.tensor(names.ROPE_FACTORS_LONG), lambda: torch.tensor(long, dtype=torch.float32)),
        (names.tensor(names.ROPE_FACTORS_SHORT), lambda: torch.tensor(short, dtype=torch.float32)),
    ]
