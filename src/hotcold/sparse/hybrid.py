"""Hybrid FFN: the hot neurons' rows live on the fast device (a compact copy), the CPU keeps the full
matrices and computes the cold neurons that fire; both parts run at the same time and are added.

Order per call: predictor -> mask; the mask comes to the CPU first (that sync waits only for the
predictor), then the hot part is launched on the fast device (asynchronous on CUDA), then the CPU
computes the cold firing rows (the C kernel releases the GIL), then the two are summed. Any device can
stand in for the GPU: tests use a second "cpu" placement and get the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hotcold.kernels import cpu
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import FFNStats, FFNWeights


def _rows_to(weight, rows: torch.Tensor, device: torch.device):
    if weight is None:
        return None
    if isinstance(weight, QuantTensor):
        return weight.select_rows(rows).to(device)
    return weight.index_select(0, rows).to(device).contiguous()


class HybridFFN:
    def __init__(
        self,
        weights: FFNWeights,
        predictor: Callable[[torch.Tensor], torch.Tensor],
        hot: torch.Tensor,
        device: torch.device | str,
        *,
        threads: int | None = None,
    ):
        if weights.down_t is None:
            raise ValueError("hybrid FFN needs the PowerInfer layout (ffn_down_t)")
        self.weights = weights
        self.predictor = predictor
        self.device = torch.device(device)
        self.threads = threads
        self.stats = FFNStats()
        n_ff = weights.n_ff
        hot = torch.as_tensor(hot, dtype=torch.long).sort().values
        self.hot_idx = hot
        self.hot_idx_fast = hot.to(self.device)
        self.cold = torch.ones(n_ff, dtype=torch.bool)
        self.cold[hot] = False
        self.all_hot = len(hot) == n_ff
        # the compact copy of the hot rows on the fast device (the CPU keeps the full matrices)
        self.hot_weights = FFNWeights(
            up=_rows_to(weights.up, hot, self.device),
            gate=_rows_to(weights.gate, hot, self.device),
            down_t=_rows_to(weights.down_t, hot, self.device),
            up_bias=weights.up_bias[hot].to(self.device) if weights.up_bias is not None else None,
            kind=weights.kind,
            activation=weights.activation,
        )
        self.down_bias = weights.down_bias

    def __call__(self, x: torch.Tensor, pred_input: torch.Tensor) -> torch.Tensor:
        out_device = x.device
        mask = self.predictor(pred_input)  # [T, F] bool, on the predictor's device
        mask_cpu = mask.to("cpu")  # sync point: waits for the predictor only
        x_cpu = x.to("cpu")  # before the hot launch, so this copy does not wait for the hot kernels
        hot_out = self._hot(x.to(self.device, non_blocking=True), mask.to(self.device)[:, self.hot_idx_fast])
        total = mask_cpu.sum()
        if self.all_hot:
            out = hot_out.to(out_device)
        else:
            cold_mask = mask_cpu & self.cold
            cold_out = self._cold(x_cpu, cold_mask)
            out = cold_out.to(out_device) + hot_out.to(out_device)
        self.stats.computed += int(total)
        self.stats.total += mask_cpu.numel()
        if self.down_bias is not None:
            out = out + self.down_bias.to(out_device)
        return out

    def _hot(self, x: torch.Tensor, mask_hot: torch.Tensor) -> torch.Tensor:
        w = self.hot_weights
        if self.device.type == "cuda":
            from hotcold.kernels import triton as gpu

            up = gpu_matvec(gpu, w.up, x, mask_hot)
            gate = gpu_matvec(gpu, w.gate, x, mask_hot) if w.gate is not None else None
            a = torch.where(mask_hot, w.combine(up, gate), 0.0)
            return gpu_axpy(gpu, w.down_t, a, mask_hot)
        up = cpu.gather_matvec(w.up, x, mask_hot, threads=self.threads)
        gate = cpu.gather_matvec(w.gate, x, mask_hot, threads=self.threads) if w.gate is not None else None
        a = torch.where(mask_hot, w.combine(up, gate), 0.0)
        return cpu.sparse_axpy(w.down_t, a, mask_hot, threads=self.threads)

    def _cold(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w = self.weights
        up = cpu.gather_matvec(w.up, x, mask, threads=self.threads)
        gate = cpu.gather_matvec(w.gate, x, mask, threads=self.threads) if w.gate is not None else None
        a = torch.where(mask, w.combine(up, gate), 0.0)
        return cpu.sparse_axpy(w.down_t, a, mask, threads=self.threads)


def _triton_args(w):
    if isinstance(w, QuantTensor):
        return w.data, w.qtype.name.lower()
    return w, None


def gpu_matvec(gpu, w, x, mask):
    data, qtype = _triton_args(w)
    return gpu.hot_gather_matvec(data, x, mask, qtype=qtype)


def gpu_axpy(gpu, w, a, mask):
    data, qtype = _triton_args(w)
    return gpu.hot_axpy(data, a, mask, qtype=qtype)
