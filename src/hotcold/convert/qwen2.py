"""Qwen2 / Qwen2.5 checkpoints (Qwen2ForCausalLM) -> GGUF, as upstream llama.cpp's converter writes them: arch
`qwen2`, the llama keys, q/k/v with biases (o without), q/k rows as stored (Qwen2 rotates halves: NeoX RoPE, so
no permutation), the output tied to the embedding where the checkpoint ties it."""

from __future__ import annotations

from typing import Any

from hotcold import names
from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint

MODEL_TYPES = ("qwen2",)


def architecture(config: dict[str, Any]) -> str:
    return "qwen2"


activation = llama.activation
dims = llama.dims


def metadata(config: dict[str, Any], arch: str) -> list:
    return llama.metadata(config, arch)


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    """llama's tensors, with q/k as stored (no permutation) and each of q/k/v followed by its bias."""
    qkv = {
        names.tensor(template, i): (template, f"model.layers.{i}.self_attn.{proj}", i)
        for i in range(config["num_hidden_layers"])
        for template, proj in ((names.ATTN_Q, "q_proj"), (names.ATTN_K, "k_proj"), (names.ATTN_V, "v_proj"))
    }
    plan = []
    for name, load in llama.tensors(config, ckpt, sparse_layout=sparse_layout):
        if name not in qkv:
            plan.append((name, load))
            continue
        template, hf, i = qkv[name]
        plan.append((name, lambda n=f"{hf}.weight": ckpt.get(n)))
        plan.append((names.tensor(template, i, "bias"), lambda n=f"{hf}.bias": ckpt.get(n)))
    return plan
