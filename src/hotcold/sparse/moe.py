"""Mixture-of-experts FFN (Mixtral, TurboSparse-Mixtral, Qwen3-MoE, gpt-oss, SmallThinker): a router picks each
token's top-k experts, each an ordinary FFN (dense, sparse or hybrid, chosen by the loader), and their outputs are
summed, weighted by the softmax over the selected router logits (= transformers' softmax, top-k, renormalise;
gpt-oss's top-k then softmax is the same), or with gating "sigmoid" (SmallThinker) by the sigmoids of the selected
logits renormalised to 1 (upstream's build_moe_ffn with norm_w: the sum clamped below at 2^-14). gpt-oss's router
has a bias, added to its logits.

Expert-row sparsity: a dense expert whose gate is ReLU (SmallThinker, a ReLU Mixtral, TurboSparse's dReLU) computes
its gate rows, then only the up rows where relu(gate) != 0 and only the down rows whose activation is nonzero
(`relu_rows`, the C row kernels): every skipped row's product is an exact 0, so the bits are the dense expert's
(tests/sparse/test_moe_rows.py). The rows it computes are what the timings count."""

from __future__ import annotations

import torch

from hotcold.kernels import cpu
from hotcold.kernels.decode_glue import GATINGS as GATING_CODES
from hotcold.ops import Norm, Weight, linear
from hotcold.runtime.state import Batch
from hotcold.sparse import tails
from hotcold.sparse.ffn import FFN, DenseFFN
from hotcold.sparse.ffn_weights import FFNWeights

GATINGS = tuple(GATING_CODES)  # "softmax", "sigmoid"


def relu_rows_apply(
    w: FFNWeights, h: torch.Tensor, *, threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ReLU-gated expert over only its live rows: h [T, D] float32 on the CPU -> (out [T, D] without the down
    bias, live [T, F] bool: the neurons whose activation is nonzero). Every gate row (matmul: the packed GEMV of a gate
    packed at load, SmallThinker's), the up rows
    where relu(gate) != 0, the activation, then the down rows where it is nonzero: the axpy over down_t (the same
    kernel, ascending rows, the dense path runs over every row) or, for a file with ffn_down [D, F], the dense
    product of the activation (its zeros included). Skipped rows would add exact zeros, so the result is the dense
    expert's, bit for bit."""
    gate = cpu.matmul(w.gate, h, threads=threads)  # every row (its packed copy where it has one)
    up = cpu.gather_matvec(w.up, h, torch.relu(gate) != 0, threads=threads)  # exactly 0 on the other rows
    a = w.combine(up, gate)  # relu(gate) * up: 0 wherever relu(gate) is 0
    live = a != 0  # dReLU: relu(up) zeroes more rows
    if w.down_t is not None:
        return cpu.sparse_axpy(w.down_t, a, live, threads=threads), live
    return linear(a, w.down), live


def runs_relu_rows(expert: FFN) -> bool:
    """Whether an expert takes relu_rows_apply: a dense expert (a sparse one has its predictor) whose gate is ReLU,
    on the CPU, of weight types the row kernels read (not float32, which the dense path multiplies in torch)."""
    if type(expert) is not DenseFFN:
        return False
    w = expert.weights
    if w.activation != "relu" or w.kind not in ("gated", "gated_both") or w.up_bias is not None:
        return False
    mats = [m for m in (w.up, w.gate, w.down_t, w.down) if m is not None]
    return all(
        (m.device if isinstance(m, torch.Tensor) else m.data.device).type == "cpu"
        and not (isinstance(m, torch.Tensor) and m.dtype == torch.float32)
        for m in mats
    )


class MoEFFN:
    tail_type = tails.MoETail  # the one-call decode's layer tail; eager forwards run the experts op by op

    def __init__(self, router: Weight, experts: list[FFN], n_used: int, *, layer: int, norm: Norm,
                 router_bias: torch.Tensor | None = None, gating: str = "softmax", threads: int | None = None):  # fmt: skip
        if gating not in GATINGS:
            raise ValueError(
                f"layer {layer}: unknown expert gating function {gating!r}; expected one of {GATINGS}"
            )
        self.router = router  # [E, D]
        self.gating = gating
        self.threads = threads
        self.relu_rows = [runs_relu_rows(e) for e in experts]  # experts computed over their live rows only
        self.router_bias = router_bias  # [E] float32 on the router's device, or None
        self.experts = experts  # FFNs called with apply(h, p, ctx) on their tokens
        self.n_used = n_used
        self.layer = layer
        self.norm = norm

    @property
    def stored(self) -> bool:
        """Whether the experts are read from storage under a RAM budget (storage/experts.py's ExpertStore)."""
        return not isinstance(self.experts, list)

    @property
    def n_ff(self) -> int:
        """The neurons a token's FFN holds: its experts' together (what a token's counts are out of)."""
        return (
            self.n_used * next(iter(self.experts)).n_ff
        )  # (a store iterates its experts as mapped: no read)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] (the router's input: the normed FFN input, or SmallThinker's residual before attention) ->
        expert ids [T, k] and their weights [T, k] (softmax over the selected logits, or their sigmoids
        renormalised). On the CPU, for a few tokens, the router's product in the C kernels and softmax routing too
        (any router type: the one-call decode's, so a token's experts never depend on its path)."""
        if h.device.type == "cpu" and cpu.backend() == "c" and h.shape[0] < cpu.GEMM_MIN_TOKENS:
            logits = cpu.matmul(self.router, h)
            if self.router_bias is not None:
                logits = logits + self.router_bias
        else:
            logits = linear(h, self.router, self.router_bias)  # [T, E]
        ids, weights = cpu.moe_route(logits, self.n_used, self.gating)
        if self.stored:  # start every read now
            self.experts.prefetch(sorted(set(ids.flatten().tolist())))  # (SmallThinker: before its attention)
        return ids, weights

    def __call__(
        self, x: torch.Tensor, ctx: Batch, routing: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x [T, D] the FFN input (normed here); routing: (ids, weights) the family routed already (SmallThinker
        routes the residual before attention), else the normed x is routed."""
        h = self.norm(x)
        ids, weights = self.route(h) if routing is None else routing
        ctx.route(self.layer, ids)
        if self.stored:  # (the reads started when route() chose)
            self.experts.count_tokens(x.shape[0])
        out = torch.zeros_like(x)
        # live rows below the GEMM size (where the dense path multiplies in the same C kernels: the same bits)
        rows_ok = not ctx.dense and h.device.type == "cpu"
        if (
            x.shape[0] == 1
        ):  # a decode token: its k experts in ascending order, as below, without the index ops
            chosen = ids[0].tolist()
            for slot in sorted(range(len(chosen)), key=chosen.__getitem__):
                y = self._expert(chosen[slot], h, x, ctx, rows_ok)
                out.add_(y.to(out.device) * weights[0, slot])
            return out
        for e in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == e)
            y = self._expert(e, h[tokens], x[tokens], ctx.subset(tokens), rows_ok)  # [t, D]
            out.index_add_(0, tokens, y.to(out.device) * weights[tokens, slot, None])
        return out

    def _expert(self, e: int, h: torch.Tensor, x: torch.Tensor, rows, rows_ok: bool) -> torch.Tensor:
        """Expert e on its tokens (h normed, x the residual, rows their context): over its live rows where it is
        ReLU-gated and dense (counting them: the timings' FFN neurons), else its own path."""
        expert = self.experts[e]
        if self.relu_rows[e] and rows_ok and h.shape[0] < cpu.GEMM_MIN_TOKENS:
            y, live = relu_rows_apply(expert.weights, h.float().contiguous(), threads=self.threads)
            rows.count(self.layer, live)
            return expert.weights.add_down_bias(y)
        return expert.apply(h, x, rows)
