"""Mixtral checkpoints (MixtralForCausalLM, TurboSparse-Mixtral) -> GGUF, as upstream llama.cpp lays them out.

Arch `llama` with `llama.expert_count` / `llama.expert_used_count` (upstream's choice; hotcold also reads arch
`mixtral`). Attention, norms and keys are the LLaMA ones; the router is `blk.N.ffn_gate_inp.weight` [E, D].
- dense layout: upstream's stacked experts `blk.N.ffn_{gate,up}_exps.weight` [E, F, D],
  `blk.N.ffn_down_exps.weight` [E, D, F];
- PowerInfer layout (with predictors): one tensor per expert, `blk.N.ffn_gate.{e}.weight`, `blk.N.ffn_up.{e}.weight`
  and `blk.N.ffn_down_t.{e}.weight` [F, D], plus `blk.N.fc1.{e}.weight` / `blk.N.fc2.{e}.weight` from the
  predictor folder's `expert_{e}/model_{N}.pt` (threshold from the folder's own config.json).

HF names: `model.layers.N.block_sparse_moe.{gate,experts.E.w1,w3,w2}.weight` (checkpoints, and what transformers
saves), or transformers 5's fused `model.layers.N.mlp.{gate.weight,experts.gate_up_proj,experts.down_proj}`.
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFValueType as V

from hotcold.convert import llama
from hotcold.convert.checkpoint import Checkpoint, ConvertError
from hotcold.gguf import names

MODEL_TYPES = ("mixtral",)

activation = llama.activation
dims = llama.dims


def architecture(config: dict[str, Any]) -> str:
    return "llama"


def n_experts(config: dict[str, Any]) -> tuple[int, int]:
    n_expert, n_used = config.get("num_local_experts"), config.get("num_experts_per_tok")
    if not n_expert or not n_used or not 1 <= n_used <= n_expert:
        raise ConvertError(
            f"config.json num_local_experts {n_expert} / num_experts_per_tok {n_used}: need 1 <= per_tok <= experts"
        )
    return int(n_expert), int(n_used)


def metadata(config: dict[str, Any], arch: str) -> list[tuple[str, Any, V]]:
    n_expert, n_used = n_experts(config)
    return [
        *llama.metadata(config, arch),
        (names.key(names.EXPERT_COUNT, arch), n_expert, V.UINT32),
        (names.key(names.EXPERT_USED_COUNT, arch), n_used, V.UINT32),
    ]


def predictor_groups(config: dict[str, Any]) -> list[tuple[str, int | None]]:
    """(subfolder of the predictor folder, expert index in the GGUF name) per expert."""
    n_expert, _ = n_experts(config)
    return [(f"expert_{e}", e) for e in range(n_expert)]


class _Experts:
    """Layer i's expert matrices in HF orientation: gate/up [F, D], down [D, F]."""

    def __init__(self, ckpt: Checkpoint, i: int, n_ff: int):
        self.ckpt, self.n_ff = ckpt, n_ff
        legacy = f"model.layers.{i}.block_sparse_moe."
        self.fused = f"model.layers.{i}.mlp." if legacy + "gate.weight" not in ckpt else None
        self.legacy = legacy
        prefix = self.fused or legacy
        if prefix + "gate.weight" not in ckpt:
            raise ConvertError(
                f"{ckpt.dir}: checkpoint has no router {legacy}gate.weight (nor {prefix}gate.weight)"
            )

    def router(self) -> torch.Tensor:
        return self.ckpt.get((self.fused or self.legacy) + "gate.weight")

    def get(self, e: int, which: str) -> torch.Tensor:
        if self.fused is None:
            hf = {"gate": "w1", "up": "w3", "down": "w2"}[which]
            return self.ckpt.get(f"{self.legacy}experts.{e}.{hf}.weight")
        if which == "down":
            return self.ckpt.get(self.fused + "experts.down_proj")[e]
        gate_up = self.ckpt.get(self.fused + "experts.gate_up_proj")[e]  # [2F, D]: gate rows, then up rows
        return gate_up[: self.n_ff] if which == "gate" else gate_up[self.n_ff :]


def tensors(config: dict[str, Any], ckpt: Checkpoint, *, sparse_layout: bool) -> list[tuple[str, Any]]:
    n_expert, _ = n_experts(config)
    _, _, n_ff = dims(config)
    plan: list[tuple[str, Any]] = [
        (names.tensor(names.TOKEN_EMBD), lambda: ckpt.get("model.embed_tokens.weight"))
    ]
    stacked = {"gate": names.FFN_GATE_EXPS, "up": names.FFN_UP_EXPS, "down": names.FFN_DOWN_EXPS}
    for i in range(config["num_hidden_layers"]):
        ex = _Experts(ckpt, i, n_ff)
        plan += llama.attention_tensors(config, ckpt, i)
        plan.append((names.tensor(names.FFN_ROUTER, i), ex.router))
        if sparse_layout:
            for e in range(n_expert):
                plan += [
                    (names.tensor(names.FFN_GATE, i, expert=e), lambda e=e, ex=ex: ex.get(e, "gate")),
                    (names.tensor(names.FFN_UP, i, expert=e), lambda e=e, ex=ex: ex.get(e, "up")),
                    (names.tensor(names.FFN_DOWN_T, i, expert=e), lambda e=e, ex=ex: ex.get(e, "down").T),
                ]
        else:
            for which, template in stacked.items():
                plan.append(
                    (
                        names.tensor(template, i),
                        lambda w=which, ex=ex: torch.stack([ex.get(e, w) for e in range(n_expert)]),
                    )
                )
    plan += llama.output_tensors(config, ckpt)
    return plan + llama.rope_tensors(config)
