"""OPT checkpoints (OPTForCausalLM) -> GGUF arch `opt`, laid out as PowerInfer's convert-hf-to-powerinfer-gguf.py
lays them out: biases everywhere, `position_embd.weight` with all rows (the 2 offset rows included), no
`output.weight` (tied to `token_embd`), and in the PowerInfer layout `ffn_down_t.weight` + `ffn_down_t.bias`.

Differences from PowerInfer's converter: `opt.context_length` is `max_position_embeddings` (PowerInfer writes 2050,
2 more than the positions the table holds), and the LayerNorm eps is stored as `opt.attention.layer_norm_epsilon`
(1e-5, HF's nn.LayerNorm default; PowerInfer stores none and its runtime then uses 0). Checkpoints with or without
the `model.` prefix (facebook/opt-* .bin files have none) both work.

Only the pre-norm layout PowerInfer runs: `do_layer_norm_before` true, `word_embed_proj_dim == hidden_size`
(so not opt-350m), biases and affine LayerNorms on.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as V

from hotcold.convert.checkpoint import Checkpoint, ConvertError
from hotcold.gguf import names

MODEL_TYPES = ("opt",)
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, what OPT uses


def architecture(config: dict[str, Any]) -> str:
    return "opt"


def activation(config: dict[str, Any]) -> str:
    act = config.get("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise ConvertError(f"config.json activation_function {act!r} is not supported for opt (relu or gelu)")
    return act


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    return config["num_hidden_layers"], config["hidden_size"], config["ffn_dim"]


def _check(config: dict[str, Any]) -> None:
    problems = []
    if not config.get("do_layer_norm_before", True):
        problems.append("do_layer_norm_before is false (post-norm OPT, e.g. opt-350m)")
    if config.get("word_embed_proj_dim", config["hidden_size"]) != config["hidden_size"]:
        problems.append("word_embed_proj_dim differs from hidden_size (project_in/project_out)")
    if config.get("_remove_final_layer_norm"):
        problems.append("_remove_final_layer_norm is true")
    if not config.get("enable_bias", True):
        problems.append("enable_bias is false")
    if not config.get("layer_norm_elementwise_affine", True):
        problems.append("layer_norm_elementwise_affine is false")
    if problems:
        raise ConvertError(f"config.json: unsupported OPT variant: {'; '.join(problems)}")


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    _check(config)
    n_layer, n_embd, n_ff = dims(config)
    n_head = config["num_attention_heads"]

    def key(template: str) -> str:
        return names.key(template, arch)

    return [
        (key(names.CONTEXT_LENGTH), int(config.get("max_position_embeddings", 2048)), V.UINT32),
        (key(names.EMBEDDING_LENGTH), n_embd, V.UINT32),
        (key(names.BLOCK_COUNT), n_layer, V.UINT32),
        (key(names.FEED_FORWARD_LENGTH), n_ff, V.UINT32),
        (key(names.HEAD_COUNT), n_head, V.UINT32),
        (key(names.HEAD_COUNT_KV), n_head, V.UINT32),
        (key(names.LAYERNORM_EPS), LAYER_NORM_EPS, V.FLOAT32),
    ]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    """(gguf name, loader returning a float torch tensor in GGUF numpy orientation)"""
    _check(config)
    root = "model.decoder." if "model.decoder.embed_tokens.weight" in ckpt else "decoder."

    def get(name: str, transpose: bool = False):
        return lambda: ckpt.get(name).T if transpose else ckpt.get(name)

    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), get(root + "embed_tokens.weight")),
        (names.tensor(names.POS_EMBD), get(root + "embed_positions.weight")),
    ]
    pairs = [
        (names.ATTN_NORM, "self_attn_layer_norm"),
        (names.ATTN_Q, "self_attn.q_proj"),
        (names.ATTN_K, "self_attn.k_proj"),
        (names.ATTN_V, "self_attn.v_proj"),
        (names.ATTN_OUT, "self_attn.out_proj"),
        (names.FFN_NORM, "final_layer_norm"),
        (names.FFN_UP, "fc1"),
    ]
    for i in range(config["num_hidden_layers"]):
        hf = f"{root}layers.{i}."
        for ours, theirs in pairs:
            plan += [(names.tensor(ours, i, s), get(f"{hf}{theirs}.{s}")) for s in ("weight", "bias")]
        down = names.FFN_DOWN_T if sparse_layout else names.FFN_DOWN  # the rename hits the bias too
        plan.append((names.tensor(down, i), get(hf + "fc2.weight", transpose=sparse_layout)))
        plan.append((names.tensor(down, i, "bias"), get(hf + "fc2.bias")))
    plan += [
        (names.tensor(names.OUTPUT_NORM, suffix=s), get(f"{root}final_layer_norm.{s}"))
        for s in ("weight", "bias")
    ]
    if "lm_head.weight" in ckpt and not config.get("tie_word_embeddings", True):
        plan.append((names.tensor(names.OUTPUT), get("lm_head.weight")))
    return plan
