"""Qwen3-MoE checkpoints (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B) -> GGUF, as upstream llama.cpp's
converter writes them: arch `qwen3moe`, Qwen3's attention (per-head q/k RMS norms, q/k as stored, NeoX RoPE), the
router `blk.N.ffn_gate_inp.weight` [E, D] and the experts stacked as `blk.N.ffn_{gate,up}_exps.weight` [E, F, D],
`blk.N.ffn_down_exps.weight` [E, D, F] (F: `moe_intermediate_size`, written as `expert_feed_forward_length`).

Upstream runs every Qwen3-MoE layer as softmax top-k routing with the chosen weights renormalised, no shared
expert: a checkpoint that says otherwise (`norm_topk_prob` false, dense layers in `mlp_only_layers`, a
`decoder_sparse_step` other than 1) is refused, named. Checkpoints come with one tensor per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`) or transformers 5's fused
`mlp.experts.gate_up_proj` [E, 2F, D] / `mlp.experts.down_proj` [E, D, F]."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert import llama, qwen
from hotcold.convert.checkpoint import Checkpoint, ConvertError
from hotcold.gguf import names

MODEL_TYPES = ("qwen3_moe",)

activation = llama.activation


def architecture(config: dict[str, Any]) -> str:
    return "qwen3moe"


def dims(config: dict[str, Any]) -> tuple[int, int, int]:
    return config["num_hidden_layers"], config["hidden_size"], _expert_width(config)


def _expert_width(config: dict[str, Any]) -> int:
    width = config.get("moe_intermediate_size")
    if not width:
        raise ConvertError("config.json: qwen3_moe without moe_intermediate_size (each expert's width)")
    return int(width)


def _experts(config: dict[str, Any]) -> tuple[int, int]:
    n_expert = config.get("num_experts") or config.get(
        "num_local_experts"
    )  # transformers 5 names it the latter
    n_used = config.get("num_experts_per_tok")
    if not n_expert or not n_used or not 1 <= n_used <= n_expert:
        raise ConvertError(
            f"config.json num_experts {n_expert} / num_experts_per_tok {n_used}: need 1 <= per_tok <= experts"
        )
    if config.get("norm_topk_prob") is False:
        raise ConvertError(
            "config.json norm_topk_prob false: upstream (and hotcold) renormalise the top-k weights"
        )
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ConvertError(
            "config.json: dense layers among the experts (mlp_only_layers / decoder_sparse_step) are not supported"
        )
    return int(n_expert), int(n_used)


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    n_expert, n_used = _experts(config)
    return [
        *llama.metadata(config, arch),
        (names.key(names.EXPERT_COUNT, arch), n_expert, V.UINT32),
        (names.key(names.EXPERT_USED_COUNT, arch), n_used, V.UINT32),
        (names.key(names.EXPERT_FEED_FORWARD_LENGTH, arch), _expert_width(config), V.UINT32),
    ]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    if sparse_layout:
        raise ConvertError("qwen3moe: predictors need ReLU experts (Qwen3-MoE is SwiGLU); convert it dense")
    n_expert, _ = _experts(config)
    width = _expert_width(config)
    dense_ffn = {
        names.tensor(t, i)
        for i in range(config["num_hidden_layers"])
        for t in (names.FFN_GATE, names.FFN_UP, names.FFN_DOWN)
    }
    plan = []
    for name, load in qwen.tensors(config, ckpt, sparse_layout=False):
        if name in dense_ffn:
            continue  # the experts and the router take the dense FFN's place, right after ffn_norm
        plan.append((name, load))
        if name.endswith(".ffn_norm.weight"):
            plan += _expert_tensors(ckpt, names.block_of(name), n_expert, width)
    return plan


def _expert_tensors(ckpt: Checkpoint, i: int, n_expert: int, width: int) -> list[tuple[str, Any]]:
    mlp = f"model.layers.{i}.mlp."
    if mlp + "gate.weight" not in ckpt:
        raise ConvertError(f"{ckpt.dir}: checkpoint has no router {mlp}gate.weight")

    def stacked(which: str) -> torch.Tensor:
        if mlp + "experts.down_proj" in ckpt:  # transformers 5's fused experts
            if which == "down":
                return ckpt.get(mlp + "experts.down_proj")
            gate_up = ckpt.get(mlp + "experts.gate_up_proj")  # [E, 2F, D]: gate rows, then up rows
            return gate_up[:, :width] if which == "gate" else gate_up[:, width:]
        return torch.stack([ckpt.get(f"{mlp}experts.{e}.{which}_proj.weight") for e in range(n_expert)])

    return [
        (names.tensor(names.FFN_ROUTER, i), lambda: ckpt.get(mlp + "gate.weight")),
        (names.tensor(names.FFN_GATE_EXPS, i), lambda: stacked("gate")),
        (names.tensor(names.FFN_UP_EXPS, i), lambda: stacked("up")),
        (names.tensor(names.FFN_DOWN_EXPS, i), lambda: stacked("down")),
    ]
