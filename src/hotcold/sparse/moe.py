"""Mixture-of-experts FFN (Mixtral, TurboSparse-Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's top-k
experts, each an ordinary FFN (dense, sparse or hybrid, chosen by the loader), and their outputs are summed,
weighted by the softmax over the selected router logits (= transformers' softmax, top-k, renormalise; gpt-oss's
top-k then softmax is the same). gpt-oss's router has a bias, added to its logits."""

from __future__ import annotations

import ctypes

import torch

from hotcold.kernels import cpu
from hotcold.kernels.build import HCWeight, hc_weight
from hotcold.ops import Norm, Weight, linear
from hotcold.sparse.ffn import FFN
from hotcold.state import Batch

_WEIGHTS = ctypes.POINTER(HCWeight)


class MoEFFN:
    def __init__(self, router: Weight, experts: list[FFN], n_used: int, *, layer: int, norm: Norm,
                 router_bias: torch.Tensor | None = None):  # fmt: skip
        self.router = router  # [E, D]
        self.router_bias = router_bias  # [E] float32 on the router's device, or None
        self.experts = experts  # FFNs called with apply(h, p, ctx) on their tokens
        self.n_used = n_used
        self.layer = layer
        self.norm = norm

    @property
    def n_ff(self) -> int:
        """The neurons a token's FFN holds: its experts' together (what a token's counts are out of)."""
        return self.n_used * self.experts[0].n_ff

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] (normed) -> expert ids [T, k] and their weights [T, k] (softmax over the selected logits). On
        the CPU, for a few tokens, the router's product and the routing in the C kernels (any router type: the
        one-call decode's, so a token's experts never depend on its path)."""
        if h.device.type == "cpu" and cpu.backend() == "c" and h.shape[0] < cpu.GEMM_MIN_TOKENS:
            logits = cpu.matmul(self.router, h)
            return cpu.moe_route(
                logits if self.router_bias is None else logits + self.router_bias, self.n_used
            )
        logits = linear(h, self.router, self.router_bias)  # [T, E]
        top, ids = torch.topk(logits, self.n_used, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def __call__(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor:
        h = self.norm(x)
        ids, weights = self.route(h)
        ctx.route(self.layer, ids)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == e)
            y = self.experts[e].apply(h[tokens], x[tokens], ctx.subset(tokens))  # [t, D]
            out.index_add_(0, tokens, y.to(out.device) * weights[tokens, slot, None])
        return out

    def c_tail(self, wo: Weight, *, dense: bool) -> dict | None:
        """The fields of this layer's tail in the one-call C decode (build.HCLayer: the router and every expert's
        FFN, as their own c_tail gives them; cpu_step adds the sequence's routing buffer), or None where an expert
        has no C tail, the experts differ in kind, or the norm is not RMS."""
        router_data = self.router if isinstance(self.router, torch.Tensor) else self.router.data
        if not self.norm.rms or router_data.device.type != "cpu":  # route multiplies a CPU router in C
            return None
        if self.router_bias is not None:  # gpt-oss: not in the C decode layer yet
            return None
        tails = [e.c_tail(wo, dense=dense, norm=self.norm) for e in self.experts]  # the layer norms once
        if any(t is None for t in tails):
            return None
        fields = [t["fields"] for t in tails]
        shared = ("sparse", "kind", "act", "down_is_t")
        if any(any(f.get(k) != fields[0].get(k) for k in shared) or f.get("up_bias") for f in fields):
            return None
        router = hc_weight(self.router)
        if router.cols != wo.shape[0] or router.rows != len(self.experts):
            return None

        def column(name):
            structs = [f.get(name) for f in fields]
            return (
                None
                if structs[0] is None
                else (_WEIGHTS * len(structs))(*[ctypes.pointer(s) for s in structs])
            )

        arrays = {k: column(k) for k in ("up", "gate", "down", "fc1", "fc2")}
        thr = torch.tensor([float(f.get("thr", 0.0)) for f in fields], dtype=torch.float32)
        out = dict(fields[0])  # wo, the FFN norm and the shared fields; up (expert 0's) sizes the masks
        out.update(
            router=router, n_expert=len(self.experts), n_used=self.n_used, e_thr=thr.data_ptr(),
            **{f"e_{k}": v for k, v in arrays.items()},
        )  # fmt: skip
        return dict(fields=out, keep=(tails, router, self.router, arrays, thr))
