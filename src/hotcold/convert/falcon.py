"""Falcon checkpoints (FalconForCausalLM, the older RefinedWeb configs) -> GGUF, laid out as llama.cpp and
PowerInfer's convert-hf-to-powerinfer-gguf.py lay them out: arch `falcon`, fused qkv rearranged to the "jploski"
layout (all q heads, then all k heads, then all v heads), `attn_norm` = the FFN's LayerNorm (HF
`input_layernorm`, or `ln_mlp` in the 40B layout), `attn_norm_2` = attention's own LayerNorm (HF `ln_attn`).

Two deliberate differences from PowerInfer's converter: `falcon.feed_forward_length` is the real
`ffn_hidden_size` (PowerInfer writes 4 * hidden_size, the same for every released Falcon), and the KV head count
follows transformers (multi-query without `new_decoder_architecture` means 1 KV head, whatever `num_kv_heads`
says; PowerInfer reads `num_kv_heads` first, which transformers always writes).
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert.checkpoint import Checkpoint, ConvertError, rope_scaling, rope_theta
from hotcold.gguf import names

MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")


def _hp(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """First present key: transformers' names first, then the RefinedWeb ones."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise ConvertError(f"config.json has none of {', '.join(keys)}")
    return default


def architecture(config: dict[str, Any]) -> str:
    return "falcon"


def activation(config: dict[str, Any]) -> str:
    act = config.get("activation", "gelu")
    if act not in ("relu", "gelu"):
        raise ConvertError(f"config.json activation {act!r} is not supported for falcon (relu or gelu)")
    return act


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    n_embd = _hp(config, "hidden_size", "d_model")
    return (
        _hp(config, "num_hidden_layers", "n_layer"),
        n_embd,
        _hp(config, "ffn_hidden_size", default=4 * n_embd),
    )


def _new_arch(config: dict[str, Any]) -> bool:
    """The 40B layout (grouped KV heads); RefinedWeb configs (40B) predate the flag, RefinedWebModel is 7B."""
    return bool(config.get("new_decoder_architecture", config.get("model_type") == "RefinedWeb"))


def heads(config: dict[str, Any]) -> tuple[int, int]:
    """(n_head, n_head_kv) as transformers' FalconAttention computes them."""
    n_head = _hp(config, "num_attention_heads", "n_head")
    if _new_arch(config):
        return n_head, _hp(config, "num_kv_heads", "n_head_kv", default=n_head)
    return n_head, 1 if config.get("multi_query", True) else n_head


def _check(config: dict[str, Any]) -> None:
    if config.get("alibi"):
        raise ConvertError("config.json: Falcon with alibi positions is not supported (only rotary)")
    if config.get("bias"):
        raise ConvertError("config.json: Falcon with linear biases (bias: true) is not supported")
    if not _new_arch(config) and not config.get("parallel_attn", True):
        raise ConvertError(
            "config.json: Falcon without parallel attention (parallel_attn: false) is not supported"
        )


def _two_norms(config: dict[str, Any]) -> bool:
    """The 40B layout: separate LayerNorms for attention (ln_attn) and the FFN (ln_mlp)."""
    return _new_arch(config) and config.get("num_ln_in_parallel_attn") in (None, 2)


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    _check(config)
    n_layer, n_embd, n_ff = dims(config)
    n_head, n_head_kv = heads(config)

    def key(template: str) -> str:
        return names.key(template, arch)

    items = [
        (key(names.CONTEXT_LENGTH), int(config.get("max_position_embeddings", 2048)), V.UINT32),
        (key(names.TENSOR_DATA_LAYOUT), "jploski", V.STRING),
        (key(names.EMBEDDING_LENGTH), n_embd, V.UINT32),
        (key(names.FEED_FORWARD_LENGTH), n_ff, V.UINT32),
        (key(names.BLOCK_COUNT), n_layer, V.UINT32),
        (key(names.HEAD_COUNT), n_head, V.UINT32),
        (key(names.HEAD_COUNT_KV), n_head_kv, V.UINT32),
        (key(names.LAYERNORM_EPS), float(config.get("layer_norm_epsilon", 1e-5)), V.FLOAT32),
    ]
    theta = rope_theta(config)
    if theta is not None:
        items.append((key(names.ROPE_FREQ_BASE), theta, V.FLOAT32))
    scaling = rope_scaling(config)
    if scaling is not None:
        items.append((key(names.ROPE_SCALING_TYPE), scaling[0], V.STRING))
        items.append((key(names.ROPE_SCALING_FACTOR), scaling[1], V.FLOAT32))
    return items


def jploski(qkv: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """HF fused qkv rows, grouped per KV head as [q x (n_head/n_head_kv), k, v], -> [all q, all k, all v]."""
    group = n_head // n_head_kv
    head_dim = qkv.shape[0] // (n_head + 2 * n_head_kv)
    w = qkv.reshape(n_head_kv, group + 2, head_dim, qkv.shape[-1])
    q, k, v = w[:, :group], w[:, group], w[:, group + 1]
    return torch.cat([t.reshape(-1, qkv.shape[-1]) for t in (q, k, v)])


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    """(gguf name, loader returning a float torch tensor in GGUF numpy orientation)"""
    _check(config)
    n_layer, _, _ = dims(config)
    n_head, n_head_kv = heads(config)
    two_norms = _two_norms(config)
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("transformer.word_embeddings.weight"))
    ]
    for i in range(n_layer):
        hf = f"transformer.h.{i}."
        ffn_norm = hf + ("ln_mlp" if two_norms else "input_layernorm")
        for suffix in ("weight", "bias"):
            plan.append(
                (names.tensor(names.ATTN_NORM, i, suffix), lambda n=f"{ffn_norm}.{suffix}": ckpt.get(n))
            )
            if two_norms:
                plan.append(
                    (
                        names.tensor(names.ATTN_NORM_2, i, suffix),
                        lambda n=f"{hf}ln_attn.{suffix}": ckpt.get(n),
                    )
                )
        qkv = hf + "self_attention.query_key_value.weight"
        plan += [
            (names.tensor(names.ATTN_QKV, i), lambda n=qkv: jploski(ckpt.get(n), n_head, n_head_kv)),
            (names.tensor(names.ATTN_OUT, i), lambda n=hf + "self_attention.dense.weight": ckpt.get(n)),
            (names.tensor(names.FFN_UP, i), lambda n=hf + "mlp.dense_h_to_4h.weight": ckpt.get(n)),
        ]
        down = hf + "mlp.dense_4h_to_h.weight"
        if sparse_layout:
            plan.append((names.tensor(names.FFN_DOWN_T, i), lambda n=down: ckpt.get(n).T))
        else:
            plan.append((names.tensor(names.FFN_DOWN, i), lambda n=down: ckpt.get(n)))
    for suffix in ("weight", "bias"):
        plan.append(
            (
                names.tensor(names.OUTPUT_NORM, suffix=suffix),
                lambda s=suffix: ckpt.get(f"transformer.ln_f.{s}"),
            )
        )
    if "lm_head.weight" in ckpt and not config.get("tie_word_embeddings", True):
        plan.append((names.tensor(names.OUTPUT), lambda: ckpt.get("lm_head.weight")))
    return plan
