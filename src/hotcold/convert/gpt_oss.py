"""gpt-oss checkpoints (GptOssForCausalLM) -> GGUF, as upstream llama.cpp's converter (GptOssModel) writes them
from float weights: arch `gpt-oss`; q/k as stored (NeoX RoPE) with q/k/v/o biases and `attn_sinks.weight` [H]; the
FFN norm as `post_attention_norm`; the router `ffn_gate_inp` with its bias; the experts' interleaved gate_up
[E, D, 2F] split into `ffn_gate_exps` (even columns) and `ffn_up_exps` (odd), transposed to [E, F, D], their biases
[E, F]; `ffn_down_exps` [E, D, F] with its bias [E, D]. Keys: the llama ones without rope.dimension_count, the
head size always, YaRN's (type, factor, original context, betas), the sliding window and the experts'.

Checkpoints as OpenAI publishes gpt-oss, the experts in MXFP4 (`mlp.experts.{gate_up,down}_proj_blocks` [E, rows,
cols / 32, 16] and `_scales` [E, rows, cols / 32]), keep them in MXFP4 (ggml type 39) whatever --outtype says, as
upstream's converter does: each block's E8M0 scale byte, then its 32 E2M1 codes re-paired from adjacent elements
(OpenAI's bytes) to elements j and j + 16 (ggml's), the gate_up rows split even / odd."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import GGUFValueType as V

from hotcold.convert.checkpoint import Checkpoint, ConvertError, Encoded, rope_scaling_params, rope_theta
from hotcold.gguf import names

MODEL_TYPES = ("gpt_oss",)


def architecture(config: dict[str, Any]) -> str:
    return "gpt-oss"


def activation(config: dict[str, Any]) -> str:
    """The experts' clamped SwiGLU is the architecture's (names.ffn_kind); the file declares nothing."""
    alpha, limit = config.get("swiglu_alpha", 1.702), config.get("swiglu_limit", 7.0)
    if (alpha, limit) != (1.702, 7.0):  # constants in llama.cpp and in hotcold
        raise ConvertError(f"config.json swiglu_alpha {alpha} / swiglu_limit {limit}: only 1.702 / 7.0 run")
    return "silu"


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    return config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]


def _layer_types(config: dict[str, Any]) -> None:
    """Upstream runs even layers in the window and odd ones globally: a checkpoint that says otherwise is refused."""
    n = config["num_hidden_layers"]
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if config.get("layer_types") not in (None, expected):
        raise ConvertError(
            "config.json layer_types: only sliding windows on even layers and global attention on odd ones run"
        )


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    _layer_types(config)
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    n_expert, n_used = config.get("num_local_experts"), config.get("num_experts_per_tok")
    if not n_expert or not n_used or not 1 <= n_used <= n_expert:
        raise ConvertError(
            f"config.json num_local_experts {n_expert} / num_experts_per_tok {n_used}: need 1 <= per_tok <= experts"
        )

    def key(template: str) -> str:
        return names.key(template, arch)

    items = [
        (key(names.CONTEXT_LENGTH), int(config.get("max_position_embeddings", 131072)), V.UINT32),
        (key(names.EMBEDDING_LENGTH), config["hidden_size"], V.UINT32),
        (key(names.BLOCK_COUNT), config["num_hidden_layers"], V.UINT32),
        (key(names.FEED_FORWARD_LENGTH), config["intermediate_size"], V.UINT32),
        (key(names.HEAD_COUNT), n_head, V.UINT32),
        (key(names.HEAD_COUNT_KV), config.get("num_key_value_heads") or n_head, V.UINT32),
    ]
    kind, params = rope_scaling_params(config)
    if kind == "yarn":
        items += [
            (key(names.ROPE_SCALING_TYPE), "yarn", V.STRING),
            (key(names.ROPE_SCALING_FACTOR), float(params["factor"]), V.FLOAT32),
            (key(names.ROPE_SCALING_ORIG_CTX_LEN), int(params["original_max_position_embeddings"]), V.UINT32),
        ]
        for template, name in ((names.ROPE_SCALING_YARN_BETA_FAST, "beta_fast"),
                               (names.ROPE_SCALING_YARN_BETA_SLOW, "beta_slow")):  # fmt: skip
            if params.get(name) is not None:
                items.append((key(template), float(params[name]), V.FLOAT32))
    elif kind not in (None, "default"):
        raise ConvertError(f"config.json: gpt-oss with rope scaling {kind!r} (only yarn)")
    theta = rope_theta(config)
    if theta is not None:
        items.append((key(names.ROPE_FREQ_BASE), theta, V.FLOAT32))
    items += [
        (key(names.LAYERNORM_RMS_EPS), float(config.get("rms_norm_eps", 1e-5)), V.FLOAT32),
        (key(names.EXPERT_COUNT), int(n_expert), V.UINT32),
        (key(names.EXPERT_USED_COUNT), int(n_used), V.UINT32),
        (key(names.KEY_LENGTH), head_dim, V.UINT32),
        (key(names.VALUE_LENGTH), head_dim, V.UINT32),
        (key(names.SLIDING_WINDOW), int(config["sliding_window"]), V.UINT32),
        (key(names.EXPERT_FEED_FORWARD_LENGTH), config["intermediate_size"], V.UINT32),
    ]
    return items


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError(
            "gpt-oss: predictors need ReLU experts (gpt-oss's are a clamped SwiGLU); convert it dense"
        )
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    for i in range(config["num_hidden_layers"]):
        plan += _layer(ckpt, i)
    plan.append((names.tensor(names.OUTPUT_NORM), lambda: ckpt.get("model.norm.weight")))
    if "lm_head.weight" in ckpt and not config.get("tie_word_embeddings", False):
        plan.append((names.tensor(names.OUTPUT), lambda: ckpt.get("lm_head.weight")))
    return plan


def _layer(ckpt: Checkpoint, i: int) -> list[tuple[str, Any]]:
    hf = f"model.layers.{i}."
    attn, experts = hf + "self_attn.", hf + "mlp.experts."

    def get(name: str):
        return lambda: ckpt.get(name)

    mxfp4 = experts + "gate_up_proj_blocks" in ckpt

    def gate_up(parity: int, bias: bool):  # the interleaved columns: gate even, up odd
        if bias:
            return lambda: ckpt.get(experts + "gate_up_proj_bias")[..., parity::2]
        if mxfp4:
            return lambda: mxfp4_tensor(ckpt, experts + "gate_up_proj", rows=slice(parity, None, 2))
        return lambda: ckpt.get(experts + "gate_up_proj").transpose(-1, -2)[:, parity::2, :]

    def down():
        if mxfp4:
            return mxfp4_tensor(ckpt, experts + "down_proj")
        return ckpt.get(experts + "down_proj").transpose(-1, -2)

    plan = [(names.tensor(names.ATTN_NORM, i), get(hf + "input_layernorm.weight"))]
    for template, proj in ((names.ATTN_Q, "q_proj"), (names.ATTN_K, "k_proj"), (names.ATTN_V, "v_proj"),
                           (names.ATTN_OUT, "o_proj")):  # fmt: skip
        plan.append((names.tensor(template, i), get(f"{attn}{proj}.weight")))
        if f"{attn}{proj}.bias" in ckpt:
            plan.append((names.tensor(template, i, "bias"), get(f"{attn}{proj}.bias")))
    return plan + [
        (names.tensor(names.ATTN_SINKS, i), get(attn + "sinks")),
        (names.tensor(names.ATTN_POST_NORM, i), get(hf + "post_attention_layernorm.weight")),
        (names.tensor(names.FFN_ROUTER, i), get(hf + "mlp.router.weight")),
        (names.tensor(names.FFN_ROUTER, i, "bias"), get(hf + "mlp.router.bias")),
        (names.tensor(names.FFN_GATE_EXPS, i), gate_up(0, False)),
        (names.tensor(names.FFN_GATE_EXPS, i, "bias"), gate_up(0, True)),
        (names.tensor(names.FFN_UP_EXPS, i), gate_up(1, False)),
        (names.tensor(names.FFN_UP_EXPS, i, "bias"), gate_up(1, True)),
        (names.tensor(names.FFN_DOWN_EXPS, i), down),
        (names.tensor(names.FFN_DOWN_EXPS, i, "bias"), get(experts + "down_proj_bias")),
    ]


def mxfp4_tensor(ckpt: Checkpoint, stem: str, rows: slice = slice(None)) -> Encoded:
    """OpenAI's MXFP4 `{stem}_blocks` [E, R, G, 16] / `{stem}_scales` [E, R, G] (its `rows`) as a ggml MXFP4 tensor
    [E, R, G * 32]. Block shapes are checked here, before anything is written."""
    blocks, scales = ckpt.get(stem + "_blocks"), ckpt.get(stem + "_scales")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ConvertError(
            f"{ckpt.dir}: {stem}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)}: expected "
            "[E, rows, groups, 16] blocks and [E, rows, groups] scales"
        )
    e, r, g = blocks[:, rows].shape[:3]
    return Encoded(
        GGMLQuantizationType.MXFP4,
        (e, r, g * 32),
        lambda: repack_mxfp4(blocks[:, rows], scales[:, rows]).reshape(e, r, g * 17),
    )


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 (byte k holds elements 2k (low nibble) and 2k + 1, the scale a separate E8M0 byte) -> ggml's
    block_mxfp4 bytes [..., 17]: the same E8M0 byte, then byte j holding elements j (low) and j + 16 (high). The
    4-bit E2M1 codes are the same in both (ggml's kvalues_mxfp4 are their values doubled, its scale halved)."""
    b = blocks.to(torch.uint8).numpy()
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)  # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales.to(torch.uint8).numpy()[..., None], qs], axis=-1)
