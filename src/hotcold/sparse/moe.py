"""Mixture-of-experts FFN (Mixtral, TurboSparse-Mixtral): a router picks each token's top-k experts, each an
ordinary FFN (dense, sparse or hybrid, chosen by the loader), and their outputs are summed, weighted by the
softmax over the selected router logits (= transformers' softmax, top-k, renormalise)."""

from __future__ import annotations

import torch

from hotcold.ops import Norm, Weight, linear
from hotcold.sparse.ffn import FFN
from hotcold.state import Batch


class MoEFFN:
    def __init__(self, router: Weight, experts: list[FFN], n_used: int, *, layer: int, norm: Norm):
        self.router = router  # [E, D]
        self.experts = experts  # FFNs called with apply(h, p, ctx) on their tokens
        self.n_used = n_used
        self.layer = layer
        self.norm = norm

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] (normed) -> expert ids [T, k] and their weights [T, k] (softmax over the selected logits)."""
        logits = linear(h, self.router)  # [T, E]
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
