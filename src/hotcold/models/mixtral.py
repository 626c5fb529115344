"""Mixtral (and TurboSparse-Mixtral): the LLaMA block with a mixture-of-experts FFN.

Upstream llama.cpp writes Mixtral as arch `llama` with `{arch}.expert_count` / `{arch}.expert_used_count`, so
`llama.build` hands files with experts to this module (`mixtral` as an arch string works too).

Router: `blk.N.ffn_gate_inp.weight` [E, D]; per token the top-k experts by router logit, weighted by the
softmax over the selected logits (= transformers' softmax, top-k, renormalise). Experts are read from
- upstream's stacked tensors `blk.N.ffn_{gate,up}_exps.weight` [E, F, D] and `ffn_down_exps.weight` [E, D, F], or
- one tensor per expert (older llama.cpp, and hotcold's sparse layout): `blk.N.ffn_gate.{e}.weight`,
  `blk.N.ffn_up.{e}.weight` [F, D], `blk.N.ffn_down.{e}.weight` [D, F] or `blk.N.ffn_down_t.{e}.weight` [F, D],
  with per-expert predictors `blk.N.fc1.{e}.weight` [R, D] / `blk.N.fc2.{e}.weight` [F, R] in PWRI files.
Each expert is an ordinary FFN (dense or sparse, chosen by the loader's factory); the expert activation is
SiLU for dense files, ReLU for sparse or `hotcold.ffn_activation = relu` files, dReLU with
`hotcold.ffn_kind = gated_both` (TurboSparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotcold.config import ModelConfig
from hotcold.gguf_io import GGUFError, ModelFile
from hotcold.models.layers import LinearGroup, Weight, linear
from hotcold.models.llama import Llama, attention_tensors
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import FFNFactory, FFNStats, FFNWeights
from hotcold.sparse.predictor import Predictor


@dataclass
class MixtralLayer:
    attn_norm: torch.Tensor
    wq: Weight  # [H*Dh, D]
    wk: Weight  # [Hkv*Dh, D]
    wv: Weight  # [Hkv*Dh, D]
    wo: Weight  # [D, H*Dh]
    ffn_norm: torch.Tensor
    router: Weight  # [E, D]
    experts: list[FFNWeights]
    predictors: list[Predictor | None]
    ffn: MoEFFN
    device: torch.device = torch.device("cpu")  # where the loader put this layer's attention
    qkv: LinearGroup = field(default_factory=LinearGroup)  # q, k and v in one C call on the CPU
    predictor: None = None  # per-expert predictors are in `predictors`; the per-layer placement skips them


class MoEFFN:
    """Routes each token to its top-k experts and sums their outputs, weighted by the router."""

    def __init__(self, router: Weight, experts: list, n_used: int):
        self.router = router
        self.experts = experts  # callables (x [t, D], pred_input [t, D]) -> [t, D]
        self.n_used = n_used
        self.last_routing: torch.Tensor | None = None  # [T, k] expert ids of the last call, best first

    @property
    def stats(self) -> FFNStats:
        """Neurons computed vs neurons of the experts the tokens were routed to."""
        parts = [e.stats for e in self.experts if hasattr(e, "stats")]
        return FFNStats(sum(s.computed for s in parts), sum(s.total for s in parts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, k] and their weights [T, k] (softmax over the selected logits)."""
        logits = linear(x, self.router)  # [T, E]
        top, ids = torch.topk(logits, self.n_used, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        self.last_routing = ids
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == e)
            y = self.experts[e](x[tokens], pred_input[tokens])  # [t, D]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class Mixtral(Llama):
    """Same attention and residual stream as Llama; each layer's `ffn` is a MoEFFN."""


def _expert_slice(weight: Weight, e: int, rows: int) -> Weight:
    """Expert e of a stacked [E, rows, cols] tensor (block formats come as a [E*rows, cols] QuantTensor)."""
    if isinstance(weight, QuantTensor):
        return QuantTensor(weight.data[e * rows : (e + 1) * rows], weight.qtype, (rows, weight.shape[1]))
    return weight[e]


def _expert_weights(model_file: ModelFile, i: int, c: ModelConfig, kind: str) -> list[FFNWeights]:
    D, F, E = c.n_embd, c.n_ff, c.n_expert
    p, t, names = f"blk.{i}.", model_file.tensor, model_file.tensors
    if p + "ffn_up_exps.weight" in names:
        gate = t(p + "ffn_gate_exps.weight", (E, F, D))
        up = t(p + "ffn_up_exps.weight", (E, F, D))
        down = t(p + "ffn_down_exps.weight", (E, D, F))
        return [
            FFNWeights(
                up=_expert_slice(up, e, F),
                gate=_expert_slice(gate, e, F),
                down_t=None,
                down=_expert_slice(down, e, D),
                kind=kind,
                activation=c.ffn_activation,
            )
            for e in range(E)
        ]
    if p + "ffn_up.0.weight" not in names:
        raise GGUFError(
            f"{model_file.path}: layer {i} has neither {p}ffn_up_exps.weight nor per-expert {p}ffn_up.0.weight"
        )
    experts = []
    for e in range(E):
        sparse_layout = f"{p}ffn_down_t.{e}.weight" in names
        experts.append(
            FFNWeights(
                up=t(f"{p}ffn_up.{e}.weight", (F, D)),
                gate=t(f"{p}ffn_gate.{e}.weight", (F, D)),
                down_t=t(f"{p}ffn_down_t.{e}.weight", (F, D)) if sparse_layout else None,
                down=None if sparse_layout else t(f"{p}ffn_down.{e}.weight", (D, F)),
                kind=kind,
                activation=c.ffn_activation,
            )
        )
    return experts


def _expert_predictor(model_file: ModelFile, i: int, e: int, c: ModelConfig) -> Predictor:
    fc1_name, fc2_name = f"blk.{i}.fc1.{e}.weight", f"blk.{i}.fc2.{e}.weight"
    rank = model_file.entry(fc1_name).shape[0]
    fc1 = model_file.tensor(fc1_name, (rank, c.n_embd))
    fc2 = model_file.tensor(fc2_name, (c.n_ff, rank))
    return Predictor(fc1, fc2, c.sparse_threshold)


def build(model_file: ModelFile, config: ModelConfig, ffn_factory: FFNFactory) -> Mixtral:
    c = config
    D, V, E = c.n_embd, c.n_vocab, c.n_expert
    if E < 1 or not 1 <= c.n_expert_used <= E:
        raise GGUFError(
            f"{model_file.path}: expert_count {E} / expert_used_count {c.n_expert_used}: need 1 <= used <= count"
        )
    t = model_file.tensor
    gated_both = c.arch == "bamboo" or model_file.metadata.get("hotcold.ffn_kind") == "gated_both"
    kind = "gated_both" if gated_both else "gated"
    layers = []
    for i in range(c.n_layer):
        p = f"blk.{i}."
        experts = _expert_weights(model_file, i, c, kind)
        predictors = [_expert_predictor(model_file, i, e, c) if c.sparse else None for e in range(E)]
        router = t(p + "ffn_gate_inp.weight", (E, D))
        # the factory picks dense or sparse per expert; a layer index is all it knows of placement
        ffns = [ffn_factory(i, w, pred) for w, pred in zip(experts, predictors)]
        layers.append(
            MixtralLayer(
                **attention_tensors(model_file, i, c),
                router=router,
                experts=experts,
                predictors=predictors,
                ffn=MoEFFN(router, ffns, c.n_expert_used),
            )
        )
    token_embd = t("token_embd.weight", (V, D))
    output = t("output.weight", (V, D)) if "output.weight" in model_file.tensors else token_embd
    return Mixtral(c, token_embd, layers, t("output_norm.weight", (D,)).float(), output)
