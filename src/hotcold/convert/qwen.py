"""Qwen2 / Qwen2.5 and Qwen3 checkpoints (Qwen2ForCausalLM, Qwen3ForCausalLM) -> GGUF, as upstream llama.cpp's
converter writes them: arch `qwen2` / `qwen3`, the llama keys (with the head size where it is not width / heads),
q/k rows as stored (both rotate halves: NeoX RoPE, so no permutation), Qwen2's q/k/v biases (o has none),
Qwen3's per-head q/k RMS norms (`attn_q_norm` / `attn_k_norm` [head_dim]), the output tied to the embedding where
the checkpoint ties it."""

from __future__ import annotations

from typing import Any

from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint
from hotcold.gguf import names

MODEL_TYPES = ("qwen2", "qwen3")


def architecture(config: dict[str, Any]) -> str:
    return config["model_type"]


activation = llama.activation
dims = llama.dims
metadata = llama.metadata


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    """llama's tensors, with q/k as stored (no permutation), each of q/k/v followed by its bias where the
    checkpoint has one, and k by the q/k norms where it has them."""
    qkv = {
        names.tensor(template, i): (template, f"model.layers.{i}.self_attn.", proj, i)
        for i in range(config["num_hidden_layers"])
        for template, proj in ((names.ATTN_Q, "q_proj"), (names.ATTN_K, "k_proj"), (names.ATTN_V, "v_proj"))
    }
    plan = []
    for name, load in llama.tensors(config, ckpt, sparse_layout=sparse_layout):
        if name not in qkv:
            plan.append((name, load))
            continue
        template, attn, proj, i = qkv[name]
        plan.append((name, lambda n=f"{attn}{proj}.weight": ckpt.get(n)))
        if f"{attn}{proj}.bias" in ckpt:
            plan.append((names.tensor(template, i, "bias"), lambda n=f"{attn}{proj}.bias": ckpt.get(n)))
        if template == names.ATTN_K and f"{attn}q_norm.weight" in ckpt:
            plan.append((names.tensor(names.ATTN_Q_NORM, i), lambda n=f"{attn}q_norm.weight": ckpt.get(n)))
            plan.append((names.tensor(names.ATTN_K_NORM, i), lambda n=f"{attn}k_norm.weight": ckpt.get(n)))
    return plan
