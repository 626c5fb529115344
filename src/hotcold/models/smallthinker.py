"""SmallThinker (PowerInfer's SmallThinker-4BA0.6B / -21BA3B), as upstream llama.cpp runs arch `smallthinker`.

The LLaMA block (NeoX RoPE, as upstream's rope type for it) with:
- the router `blk.N.ffn_gate_inp.weight` [E, D] on the layer's raw residual, before `attn_norm` (upstream's
  `probs = ffn_gate_inp @ inpL`), routed after attention: top-k of the logits, then the sigmoids of the chosen ones
  renormalised to 1 (`{arch}.expert_gating_func` 2), or their softmax (1). The PowerInfer team's converter omits
  the key for sigmoid models (upstream's would abort on such a file): absent, hotcold takes sigmoid and says so;
- experts stacked as `ffn_{gate,up}_exps.weight` [E, F, D] and `ffn_down_exps.weight` [E, D, F], each
  relu(gate) * up; PowerInfer's fork may write `ffn_down_exps` transposed, [E, F, D] (`--transpose-down`): told
  apart by shape and read as down_t (where F == D the shapes agree and upstream's layout is assumed);
- with `{arch}.attention.sliding_window` > 0, upstream's pattern: layer i global and without RoPE (NoPE) where
  i % 4 == 0, the others in a 4096-token window with RoPE (upstream sets n_swa = 4096 whatever the key says;
  `attention.sliding_window_pattern` overrides the period or gives the layers); without it every layer is
  global with RoPE;
- the dense output head `output.weight` (or the tied embedding). The fork's `lm_head_profiler.*` (a low-rank
  predictor of the head's rows) is not used: the head is computed whole, and the load notes say so.

Its ReLU experts compute only their live rows (sparse/moe.py). On the CPU a decode token is one C call (cpu_step:
the router on the layer's input before attention, sigmoid gating, NoPE layers with no rotation, the experts over
their live rows: decode.c's relu_rows_ffn); the GPU step has no experts yet."""

from __future__ import annotations

from dataclasses import replace

import torch

from hotcold.device import place
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError
from hotcold.models.base import FFNMaker, Head, one_call_decode
from hotcold.models.llama import Llama, LlamaLayer, attention_block
from hotcold.models.mixtral import _expert_slice
from hotcold.ops import RopeTables, embed, linear
from hotcold.runtime.state import Batch
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.moe import MoEFFN
from hotcold.weights import TensorSource

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama_expert_gating_func_type values SmallThinker uses
SWA_WINDOW = 4096  # upstream's n_swa for SmallThinker, whatever the file's key says
SWA_PERIOD = 4  # upstream's default pattern: layer i global (and NoPE) iff i % 4 == 0
PROFILER = "lm_head_profiler"


class SmallThinker(Llama):
    """Llama's attention and residual stream; each layer routes its raw residual before attention, and NoPE layers
    attend without RoPE."""

    def __init__(self, *args, load_notes: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        devices = [layer.device for layer in self.layers]
        c = self.config
        self.rope_nope = RopeTables(c, devices, rope_dim=0)  # nothing rotated: NoPE layers
        if any(layer.spec.local_rope for layer in self.layers):  # the window layers' own base, the same scale
            self.rope_local = RopeTables(c, devices, base=c.rope_base_swa)
        self.load_notes = load_notes

    def forward(self, tokens: torch.Tensor, ctx: Batch, *, last_only: bool = False) -> torch.Tensor:
        x = embed(self.token_embd, tokens)  # [T, D]
        if (y := one_call_decode(self, x, ctx)) is not None:  # none chosen at load today (spec.early_router)
            return self.head(y, ctx, last_only=last_only)
        for i, (layer, ops) in enumerate(zip(self.layers, self.ops[bool(ctx.dense)])):
            x = x.to(layer.device)
            spec = layer.spec
            routing = layer.ffn.route(x)  # the raw residual, before attn_norm
            rope = self.rope_nope if spec.nope else self.rope_local if spec.local_rope else self.rope
            attn = self.attend(i, layer, ops, x, ctx, rope=rope)
            x = x + linear(attn, layer.wo)
            x = x + layer.ffn(x, ctx, routing=routing)
        return self.head(x, ctx, last_only=last_only)


def gating(src: TensorSource, notes: list[str]) -> str:
    """The router's gating function from `{arch}.expert_gating_func`; absent: sigmoid (noted)."""
    key = f"{src.config.arch}.expert_gating_func"
    value = src.file.metadata.get(key)
    if value is None:
        notes.append(f"{key} absent: sigmoid routing (SmallThinker's converter omits it for sigmoid models)")
        return "sigmoid"
    if value not in GATING_FUNCS:
        raise GGUFError(
            f"{src.path}: metadata key {key} is {value!r}; SmallThinker routes with 1 (softmax) or 2 (sigmoid)"
        )
    return GATING_FUNCS[value]


def layer_pattern(src: TensorSource) -> list[tuple[bool, bool]]:
    """(windowed, nope) per layer, as upstream's load_arch_hparams derives them."""
    c, meta = src.config, src.file.metadata
    n = c.n_layer
    if not c.sliding_window:
        return [(False, False)] * n
    pattern = meta.get(f"{c.arch}.attention.sliding_window_pattern", SWA_PERIOD)
    if isinstance(pattern, list):  # a flag per layer: 1 = windowed
        if len(pattern) < n:
            raise GGUFError(
                f"{src.path}: metadata key {c.arch}.attention.sliding_window_pattern has {len(pattern)} "
                f"values for {n} layers"
            )
        windowed = [bool(p) for p in pattern[:n]]
    else:
        windowed = [pattern == 0 or i % pattern != 0 for i in range(n)]
    return [(w, i % SWA_PERIOD == 0) for i, w in enumerate(windowed)]


def experts(src: TensorSource, i: int) -> list[FFNWeights]:
    """Layer i's E experts: relu(gate) * up, down as stored (upstream's [E, D, F] or the fork's transposed [E, F, D])."""
    c = src.config
    D, F, E = c.n_embd, c.n_ff, c.n_expert
    tensors = {}
    for t in (names.FFN_GATE_EXPS, names.FFN_UP_EXPS, names.FFN_DOWN_EXPS):
        name = names.tensor(t, i)
        entry = src.file.tensors.get(name)
        if entry is None:
            raise GGUFError(f"{src.path}: missing tensor {name} (SmallThinker's layer {i} experts)")
        if len(entry.shape) != 3 or entry.shape[0] != E:
            raise GGUFError(
                f"{src.path}: tensor {name} has shape {tuple(entry.shape)}, but {c.arch}.expert_count is {E} "
                f"(expected [{E}, ...] experts)"
            )
        tensors[t] = entry.shape
    down_t = tuple(tensors[names.FFN_DOWN_EXPS]) == (E, F, D) and F != D
    shapes = {names.FFN_GATE_EXPS: (E, F, D), names.FFN_UP_EXPS: (E, F, D),
              names.FFN_DOWN_EXPS: (E, F, D) if down_t else (E, D, F)}  # fmt: skip
    stacked = {t: src.raw(t, i, shape) for t, shape in shapes.items()}
    device = src.plan.ffn[i]

    def expert(t, e):
        rows = shapes[t][1]
        w = place(_expert_slice(stacked[t], e, rows), device)
        # the gate is only ever multiplied whole (relu_rows_apply gathers up and down rows): packed, ~2x the row
        # kernel's rate for Q4_0 at one token
        return src.pack_expert(w) if t == names.FFN_GATE_EXPS else w

    down = names.FFN_DOWN_EXPS
    return [
        FFNWeights(
            up=expert(names.FFN_UP_EXPS, e),
            gate=expert(names.FFN_GATE_EXPS, e),
            down_t=expert(down, e) if down_t else None,
            down=None if down_t else expert(down, e),
            kind="gated",
            activation="relu",
        )
        for e in range(E)
    ]


def build(src: TensorSource, make_ffn: FFNMaker) -> SmallThinker:
    c = src.config
    D, E = c.n_embd, c.n_expert
    if E < 1 or not 1 <= c.n_expert_used <= E:
        raise GGUFError(
            f"{src.path}: {c.arch}.expert_count {E} / expert_used_count {c.n_expert_used}: need 1 <= used <= count"
        )
    if c.sparse:
        raise GGUFError(f"{src.path}: SmallThinker files with per-neuron predictors are not supported")
    if c.rope_dim != c.head_dim:  # upstream asserts it
        raise GGUFError(
            f"{src.path}: rope.dimension_count {c.rope_dim} differs from the head size {c.head_dim}"
        )
    notes: list[str] = []
    gate_fn = gating(src, notes)
    local = c.rope_base_swa is not None and c.rope_base_swa != c.rope_base
    layers = []
    for i, (windowed, nope) in enumerate(layer_pattern(src)):
        attention = attention_block(src, i)
        ffns = [make_ffn(i, w, None, None, expert=e) for e, w in enumerate(experts(src, i))]
        norm = src.norm(names.FFN_NORM, i, rms=True)
        router = src.attention(names.FFN_ROUTER, i, (E, D))
        ffn = MoEFFN(router, src.experts(i, ffns), c.n_expert_used, layer=i, norm=norm, gating=gate_fn)
        attention["spec"] = replace(
            attention["spec"], moe=True, early_router=True, nope=nope,
            sliding_window=SWA_WINDOW if windowed else 0, local_rope=windowed and local,
        )  # fmt: skip
        layers.append(LlamaLayer(**attention, ffn=ffn))
    profiler = sorted(n for n in src.file.tensors if n.startswith(PROFILER))
    if profiler:
        notes.append(
            f"{', '.join(profiler)}: the fork's output-head predictor is not used; the head is computed whole"
        )
    head = Head(src.output_norm(rms=True), src.output())
    return SmallThinker(c, src.token_embd(), layers, head, src.plan, load_notes=notes)
