"""Gemma 3 text checkpoints (Gemma3ForCausalLM, model_type gemma3_text) and Gemma 2 ones (Gemma2ForCausalLM) -> GGUF,
as upstream llama.cpp's converter writes them: arch `gemma3` / `gemma2`, the llama keys with the head size and the sliding window, RMS norm weights stored as
1 + w (Gemma's norms scale by 1 + w), the sandwich norms (`post_attention_norm`, `post_ffw_norm`), per-head q/k
norms, q/k as stored (NeoX RoPE), the output tied to the embedding. Which layers are local follows upstream's
pattern (every sixth layer global; Gemma 2: every other one); the local layers' RoPE base is `rope.freq_base_swa`
(10000 by default; Gemma 2's layers share one base). Gemma 2 also caps its attention scores and its logits
(`attn_logit_softcapping`, `final_logit_softcapping`) and has no q/k norms."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint, ConvertError
from hotcold.gguf import names

MODEL_TYPES = ("gemma3_text", "gemma2")
LOCAL_ROPE_BASE = 10000.0  # upstream llama.cpp's base for gemma3's sliding-window layers
SWA_PATTERN = {"gemma3": 6, "gemma2": 2}  # upstream: layer i is global iff (i + 1) % pattern == 0
GEMMA2_27B_LAYERS = (
    46  # upstream scales q.k of this one by 1 / sqrt(width / heads), the others by 1 / sqrt(Dh)
)


def architecture(config: dict[str, Any]) -> str:
    return "gemma2" if config.get("model_type") == "gemma2" else "gemma3"


def activation(config: dict[str, Any]) -> str:
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConvertError(
            f"config.json hidden_activation {act!r} is not supported for {architecture(config)} (gelu_pytorch_tanh)"
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
    if params:  # one set for every layer (Gemma 2)
        return float(config.get("rope_local_base_freq", LOCAL_ROPE_BASE)), dict(params)
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_theta", config.get("rope_theta", 1e6))
    return float(config.get("rope_local_base_freq", LOCAL_ROPE_BASE)), scaling


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    local, full = _rope(config)
    types = config.get("layer_types")
    n_layer, pattern = config["num_hidden_layers"], SWA_PATTERN[arch]
    want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer)]
    if types is not None and list(types) != want:
        raise ConvertError(
            f"config.json: {arch} layer_types differ from upstream's pattern (every layer i with "
            f"(i + 1) % {pattern} == 0 global)"
        )
    caps = ("final_logit_softcapping", "attn_logit_softcapping")
    if arch == "gemma3" and any(config.get(key) for key in caps):
        raise ConvertError(
            f"config.json: gemma3 soft-capping {[config.get(k) for k in caps]} is not supported"
        )
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # the q.k scale upstream's loader derives (the file has no key for query_pre_attn_scalar)
    big = arch == "gemma2" and n_layer == GEMMA2_27B_LAYERS
    scalar = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    if config.get("query_pre_attn_scalar", scalar) != scalar:
        raise ConvertError(
            f"config.json: query_pre_attn_scalar {config['query_pre_attn_scalar']} differs from {scalar}, the "
            f"scale upstream llama.cpp derives for {arch} with {n_layer} layers (the file has no key for it)"
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
    if arch == "gemma2":  # llama.cpp always caps Gemma 2 (50 and 30 where a file has no keys): never uncapped
        for template, name in (
            (names.ATTN_LOGIT_SOFTCAPPING, caps[1]),
            (names.FINAL_LOGIT_SOFTCAPPING, caps[0]),
        ):
            if not config.get(name):
                raise ConvertError(
                    f"config.json: gemma2 {name} is {config.get(name)!r}; llama.cpp runs every gemma2 file capped"
                )
            items.append((key(template), float(config[name]), V.FLOAT32))
        return items
    return items + [(key(names.ROPE_FREQ_BASE_SWA), local, V.FLOAT32)]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError(
            f"{architecture(config)}: predictors need a ReLU model (Gemma is GeGLU); convert it dense"
        )
    qk_norms = config.get("model_type") != "gemma2"

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
        ]
        if qk_norms:
            plan += [
                (names.tensor(names.ATTN_Q_NORM, i), norm(hf + "self_attn.q_norm.weight")),
                (names.tensor(names.ATTN_K_NORM, i), norm(hf + "self_attn.k_norm.weight")),
            ]
        plan += [
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
