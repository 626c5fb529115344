"""Mixtral (and TurboSparse-Mixtral): the LLaMA block with a mixture-of-experts FFN (sparse/moe.py).

Upstream llama.cpp writes Mixtral as arch `llama` with `{arch}.expert_count` / `{arch}.expert_used_count`; the
registry sends such files here (`mixtral` as an arch string works too).

Router: `blk.N.ffn_gate_inp.weight` [E, D]. Experts are read from
- upstream's stacked tensors `blk.N.ffn_{gate,up}_exps.weight` [E, F, D] and `ffn_down_exps.weight` [E, D, F], or
- one tensor per expert (older llama.cpp, and hotcold's sparse layout): `blk.N.ffn_gate.{e}.weight`,
  `blk.N.ffn_up.{e}.weight` [F, D], `blk.N.ffn_down.{e}.weight` [D, F] or `blk.N.ffn_down_t.{e}.weight` [F, D],
  with per-expert predictors `blk.N.fc1.{e}.weight` [R, D] / `blk.N.fc2.{e}.weight` [F, R] in PWRI files.
Each expert is an ordinary FFN (dense or sparse, chosen by the loader); the expert activation is SiLU for
dense files, ReLU for sparse or `hotcold.ffn_activation = relu` files, dReLU with `hotcold.ffn_kind =
gated_both` (TurboSparse).
"""

from __future__ import annotations

from dataclasses import replace

from hotcold.device import place
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError
from hotcold.gguf.quants import QuantTensor
from hotcold.models.base import FFNMaker, Head
from hotcold.models.llama import Llama, LlamaLayer, attention_block
from hotcold.ops import Weight
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.moe import MoEFFN
from hotcold.weights import TensorSource


class Mixtral(Llama):
    """Same attention and residual stream as Llama; each layer's `ffn` is a MoEFFN."""


def _expert_slice(weight: Weight, e: int, rows: int) -> Weight:
    """Expert e of a stacked [E, rows, cols] tensor (block formats come as a [E*rows, cols] QuantTensor)."""
    if isinstance(weight, QuantTensor):
        return QuantTensor(weight.data[e * rows : (e + 1) * rows], weight.qtype, (rows, weight.shape[1]))
    return weight[e]


def expert_weights(src: TensorSource, i: int) -> list[FFNWeights]:
    c = src.config
    D, F, E = c.n_embd, c.n_ff, c.n_expert
    if src.has(names.FFN_UP_EXPS, i):
        stacked = {
            t: src.raw(t, i, shape)
            for t, shape in (
                (names.FFN_GATE_EXPS, (E, F, D)),
                (names.FFN_UP_EXPS, (E, F, D)),
                (names.FFN_DOWN_EXPS, (E, D, F)),
            )
        }
        device = src.plan.ffn[i]
        # dense experts are only ever multiplied whole, as a dense file's FFN: packed (the F16 row kernel reads ~20
        # GB/s at one token, the packed one ~33 on the dev machine); ReLU experts gather their live rows (moe.py)
        whole = not c.sparse and c.ffn_activation != "relu"

        def expert(t, e, rows):
            w = place(_expert_slice(stacked[t], e, rows), device)
            return src.pack_expert(w) if whole else w

        return [
            FFNWeights(
                up=expert(names.FFN_UP_EXPS, e, F),
                gate=expert(names.FFN_GATE_EXPS, e, F),
                down_t=None,
                down=expert(names.FFN_DOWN_EXPS, e, D),
                kind=c.ffn_kind,
                activation=c.ffn_activation,
            )
            for e in range(E)
        ]
    if not src.has(names.FFN_UP, i, expert=0):
        raise GGUFError(
            f"{src.path}: layer {i} has neither {names.tensor(names.FFN_UP_EXPS, i)} nor per-expert "
            f"{names.tensor(names.FFN_UP, i, expert=0)}"
        )
    return [src.ffn(i, gated=True, expert=e) for e in range(E)]


def build(src: TensorSource, make_ffn: FFNMaker) -> Mixtral:
    c = src.config
    D, E = c.n_embd, c.n_expert
    if E < 1 or not 1 <= c.n_expert_used <= E:
        raise GGUFError(
            f"{src.path}: expert_count {E} / expert_used_count {c.n_expert_used}: need 1 <= used <= count"
        )
    layers = []
    for i in range(c.n_layer):
        attention = attention_block(src, i)
        # the experts get normed inputs from the MoE layer, which owns the norm; a layer index is all
        # make_ffn knows of placement
        experts = [
            make_ffn(i, w, src.predictor(i, expert=e), None, expert=e)
            for e, w in enumerate(expert_weights(src, i))
        ]
        norm = src.norm(names.FFN_NORM, i, rms=True)
        router = src.attention(names.FFN_ROUTER, i, (E, D))
        ffn = MoEFFN(router, src.experts(i, experts), c.n_expert_used, layer=i, norm=norm)
        attention["spec"] = replace(attention["spec"], moe=True)
        layers.append(LlamaLayer(**attention, ffn=ffn))
    head = Head(src.output_norm(rms=True), src.output())
    return Mixtral(c, src.token_embd(), layers, head, src.plan, rope_freqs=src.rope_freqs())
