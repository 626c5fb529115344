"""Input sparsity of a sparsified layer's attention products (TEAL's rule with WINA's weights).

Besides the FFN neurons (thresholded.py), `hotcold sparsify --attention` thresholds the inputs of a layer's
attention products per token: channel i of the q/k/v input (the RMS-normed residual) is kept iff
|h_i| (times the column norm of [wq; wk; wv] over channel i, "wina"; plain |h_i| for "cats", TEAL's rule)
is above the layer's threshold, and likewise the channels of the o projection's input (the attention
output) against wo's column norms. The product is then computed from the kept channels only, as the
axpy over a transposed copy of the matrices (`attn_qkv_t` [D, q + k + v], `attn_output_t` [H*Dh, D]: row i
is channel i's output direction), so a decode token reads (1 - sparsity) of the attention matrices too,
not only of the FFN (benchmarks/RESULTS_LOG.md: the FFN rule alone caps a 1B shape's decode gain at ~1.43x).

The rule depends on the token alone and every kernel computes each token's channels in the same order,
so a row's bits do not depend on its batch below `cpu.GEMM_MIN_TOKENS` rows; from there (prefill) the
masked input goes through the layer's own matrices (dense GEMM), as the thresholded FFN does.
Thresholds come from the file's quantile table ([L, 2, G]: q/k/v input, o input) at the load's sparsity.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hotcold.device import place
from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from hotcold.kernels.build import hc_weight
from hotcold.ops import LinearGroup, Norm, Weight, linear, uses_c_kernels
from hotcold.sparse.thresholded import kept_channels, prompt_rows, threshold_at

CPU = torch.device("cpu")
QKV, OUT = 0, 1  # the two inputs of a layer's attention: q/k/v's, o's


def column_norms(weights: list[torch.Tensor]) -> torch.Tensor:
    """[D]: the L2 norm of input channel i over the stacked float matrices [*, D] (WINA's weight)."""
    return torch.cat([w.double() for w in weights]).pow(2).sum(0).sqrt().float()


def attention_scales(mf: ModelFile, layer: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    """The wina channel weights of a layer's inputs: column norms of [wq; wk; wv] [D] and of wo [H*Dh]."""
    c = config
    d, dq, dkv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim

    def floats(template: str, shape: tuple[int, int]) -> torch.Tensor:
        w = mf.weight(names.tensor(template, layer), shape)
        return cpu.dequantize_rows(w) if isinstance(w, QuantTensor) else w.float()

    qkv = [floats(t, (n, d)) for t, n in ((names.ATTN_Q, dq), (names.ATTN_K, dkv), (names.ATTN_V, dkv))]
    return column_norms(qkv), column_norms([floats(names.ATTN_OUT, (d, dq))])


@dataclass(frozen=True)
class InputAssets:
    """What `hotcold sparsify --attention` stored: quantiles [L, 2, G] of each layer's two input scores at the
    grid levels, and for wina the per-channel weights (scale_qkv [L, D], scale_o [L, H*Dh])."""

    grid: torch.Tensor
    quantiles: torch.Tensor
    scale_qkv: torch.Tensor | None
    scale_o: torch.Tensor | None

    def threshold(self, layer: int, which: int, sparsity: float) -> float:
        return threshold_at(self.grid, self.quantiles[layer, which], sparsity)

    @classmethod
    def from_file(cls, mf: ModelFile, grid: torch.Tensor, method: str, n_layer: int, d: int, dq: int):
        """None where the file has no attention tables; GGUFError naming what is wrong."""
        if names.SPARSIFY_ATTN_QUANTILES not in mf.tensors:
            return None

        def table(name, shape):
            return mf.tensor(mf.entry(name, shape).name).float().clone()

        quantiles = table(names.SPARSIFY_ATTN_QUANTILES, (n_layer, 2, len(grid)))
        scales = (None, None)
        if method == "wina":
            scales = (
                table(names.SPARSIFY_ATTN_SCALE_QKV, (n_layer, d)),
                table(names.SPARSIFY_ATTN_SCALE_O, (n_layer, dq)),
            )
        for i in range(n_layer):
            for t in (names.ATTN_QKV_T, names.ATTN_OUT_T):
                if names.tensor(t, i) not in mf.tensors:
                    raise GGUFError(
                        f"{mf.path}: has {names.SPARSIFY_ATTN_QUANTILES} but no {names.tensor(t, i)}"
                    )
        return cls(grid, quantiles, *scales)


class SparseInputs:
    """A layer's q/k/v and o from the kept input channels: `qkv(x, norm, group)`, `o(attn, wo)`; `c_fields`
    for the one-call decode token (cpu_step.py)."""

    def __init__(self, qkv_t: Weight | None, o_t: Weight | None, splits: list[int], thresholds: tuple[float, float],
                 scales: tuple[torch.Tensor | None, torch.Tensor | None], threads: int | None = None):  # fmt: skip
        self.qkv_t, self.o_t, self.splits, self.threads = qkv_t, o_t, list(splits), threads
        self.thresholds = tuple(float(t) for t in thresholds)
        self.scales = tuple(None if s is None else s.float().contiguous() for s in scales)
        self.rows = (
            all(w is not None and _device(w).type == "cpu" and uses_c_kernels(w) for w in (qkv_t, o_t))
            and cpu.backend() == "c"
        )  # the axpy kernels, else the masked input through the matrices

    def mask(self, h: torch.Tensor, which: int) -> torch.Tensor:
        """[T, Din] bool: the kept channels (compared in float32, as the C kernels)."""
        return kept_channels(h, self.scales[which], self.thresholds[which])

    def _product(self, h: torch.Tensor, which: int, weights: list[Weight], ctx) -> torch.Tensor:
        """The axpy over the kept channels for a few CPU rows, except prompt chunks' rows (prompt_rows), which
        take the masked input through the layer's own matrices, as many rows do."""
        mask = self.mask(h, which)

        def dense(rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
            return torch.cat([linear(torch.where(kept, rows, 0.0), w) for w in weights], dim=-1)

        if not (self.rows and h.device.type == "cpu" and h.shape[0] < cpu.GEMM_MIN_TOKENS):
            return dense(h, mask)
        w_t = self.qkv_t if which == QKV else self.o_t
        chunk = prompt_rows(ctx, h.shape[0])
        if chunk is None:  # the decode path: the kept channels' axpy alone
            return cpu.sparse_axpy(w_t, h.contiguous(), mask, threads=self.threads)
        out = h.new_empty(h.shape[0], w_t.shape[1])
        out[chunk] = dense(h[chunk].contiguous(), mask[chunk])
        if bool((~chunk).any()):
            rest = ~chunk
            out[rest] = cpu.sparse_axpy(w_t, h[rest].contiguous(), mask[rest], threads=self.threads)
        return out

    def qkv(self, x: torch.Tensor, norm: Norm, group: LinearGroup, ctx) -> list[torch.Tensor]:
        out = self._product(norm(x), QKV, group.weights, ctx)
        return list(out.split(self.splits, dim=-1))

    def o(self, attn: torch.Tensor, wo: Weight, ctx) -> torch.Tensor:
        return self._product(attn, OUT, [wo], ctx)

    def c_fields(self) -> dict | None:
        """HCLayer's input-sparse fields (and what they point into), or None where the axpy cannot run."""
        if not self.rows:
            return None
        qkv_t, o_t = hc_weight(self.qkv_t), hc_weight(self.o_t)
        fields = dict(
            qkv_t=ctypes.pointer(qkv_t), wo_t=ctypes.pointer(o_t),
            qkv_scale=cpu.ptr(self.scales[QKV]), wo_scale=cpu.ptr(self.scales[OUT]),
            qkv_thr=self.thresholds[QKV], wo_thr=self.thresholds[OUT],
        )  # fmt: skip
        return dict(fields=fields, keep=(qkv_t, o_t, self))


def _device(weight: Weight) -> torch.device:
    return weight.device if isinstance(weight, torch.Tensor) else weight.data.device


def sparse_inputs(src, layer: int, assets: InputAssets, sparsity: float, threads: int | None) -> SparseInputs:
    """Layer's SparseInputs at `sparsity`: on the CPU with the transposed matrices (the axpy kernels); on a GPU
    without them (the masked input goes through the layer's own matrices there)."""
    c = src.config
    d, dq, dkv = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    qkv_t = o_t = None
    if src.layer_device(layer).type == "cpu":
        qkv_t = place(src.raw(names.ATTN_QKV_T, layer, (d, dq + 2 * dkv)), CPU)
        o_t = place(src.raw(names.ATTN_OUT_T, layer, (dq, d)), CPU)
    thresholds = (assets.threshold(layer, QKV, sparsity), assets.threshold(layer, OUT, sparsity))
    scales = (
        None if assets.scale_qkv is None else assets.scale_qkv[layer],
        None if assets.scale_o is None else assets.scale_o[layer],
    )
    return SparseInputs(qkv_t, o_t, [dq, dkv, dkv], thresholds, scales, threads)
