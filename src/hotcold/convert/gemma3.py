"""Gemma 3 text checkpoints (Gemma3ForCausalLM, model_type gemma3_text) -> GGUF, as upstream llama.cpp's converter
writes them: arch `gemma3`, the llama keys with the head size and the sliding window, RMS norm weights stored as
1 + w (Gemma's norms scale by 1 + w), the sandwich norms (`post_attention_norm`, `post_ffw_norm`), per-head q/k
norms, q/k as stored (NeoX RoPE), the output tied to the embedding. Which layers are local follows upstream's
pattern (every sixth layer global); the local layers' RoPE base is `rope.freq_base_swa` (10000 by default)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from hotcold import names
from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint, ConvertError

MODEL_TYPES = ("gemma3_text",)
LOCAL_ROPE_BASE = 10000.0  # upstream llama.cpp's base for gemma3's sliding-window layers
SWA_PATTERN = 6  # upstream: layer i is global iff (i + 1) % 6 == 0


def architecture(config: dict[str, Any]) -> str:
    return "gemma3"


def activation(config: dict[str, Any]) -> str:
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConvertError(
            f"config.json hidden_activation {act!r} is not supported for gemma3 (gelu_pytorch_tanh)"
        )
    return "gelu_tanh"


dims = llama.dims


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(local base, global parameters) from transformers 5's per-layer-type rope_parameters or 4's keys."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return float(params.get("sliding_attention", {}).get("rope_theta", LOCAL_ROPE_BASE)), params[
            "full_attention"
        ]
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_theta", config.get("rope_theta", 1e6))
    return float(config.get("rope_local_base_freq", LOCAL_ROPE_BASE)), scaling


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    local, full = _rope(config)
    types = config.get("layer_types")
    want = [
        "full_attention" if (i + 1) % SWA_PATTERN == 0 else "sliding_attention"
        for i in range(config["num_hidden_layers"])
    ]
    if types is not None and list(types) != want:
        raise ConvertError(
            "config.json: gemma3 layer_types differ from upstream's pattern (every sixth layer global)"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key):
            raise ConvertError(f"config.json: gemma3 {key} {config[key]} is not supported yet")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise ConvertError(
            f"config.json: query_pre_attn_scalar {config['query_pre_attn_scalar']} differs from head_dim {head_dim} "
            "(upstream's file has no key for it)"
        )
    flat = {**config, "rope_theta": float(full.get("rope_theta", 1e6)), "rope_parameters": full}
    flat.pop("rope_scaling", None)
    items = [
        (k, v, t) for k, v, t in llama.metadata(flat, arch) if k != names.key(names.SLIDING_WINDOW, arch)
    ]

    def key(template: str) -> str:
        return names.key(template, arch)

    if not any(k == key(names.KEY_LENGTH) for k, _, _ in items):
        items += [(key(names.KEY_LENGTH), head_dim, V.UINT32), (key(names.VALUE_LENGTH), head_dim, V.UINT32)]
    if config.get("sliding_window"):
        items.append((key(names.SLIDING_WINDOW), int(config["sliding_window"]), V.UINT32))
    return items + [(key(names.ROPE_FREQ_BASE_SWA), local, V.FLOAT32)]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError("gemma3: predictors need a ReLU model (Gemma 3 is GeGLU); convert it dense")

    def norm(n):  # Gemma's RMS norms scale by 1 + w: stored as 1 + w, as upstream does
        return lambda: ckpt.get(n).float() + 1.0

    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        plan += [
            (names.tensor(names.ATTN_NORM, i), norm(hf + "input_layernorm.weight")),
            (names.tensor(names.ATTN_Q, i), lambda n=hf + "self_attn.q_proj.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_K, i), lambda n=hf + "self_attn.k_proj.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_V, i), lambda n=hf + "self_attn.v_proj.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_Q_NORM, i), norm(hf + "self_attn.q_norm.weight")),
            (names.tensor(names.ATTN_K_NORM, i), norm(hf + "self_attn.k_norm.weight")),
            (names.tensor(names.ATTN_OUT, i), lambda n=hf + "self_attn.o_proj.weight": ckpt.get(n)),
            (names.tensor(names.ATTN_POST_NORM, i), norm(hf + "post_attention_layernorm.weight")),
            (names.tensor(names.FFN_NORM, i), norm(hf + "pre_feedforward_layernorm.weight")),
            (names.tensor(names.FFN_GATE, i), lambda n=hf + "mlp.gate_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_UP, i), lambda n=hf + "mlp.up_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_DOWN, i), lambda n=hf + "mlp.down_proj.weight": ckpt.get(n)),
            (names.tensor(names.FFN_POST_NORM, i), norm(hf + "post_feedforward_layernorm.weight")),
        ]
    plan.append((names.tensor(names.OUTPUT_NORM), norm("model.norm.weight")))
    return plan
