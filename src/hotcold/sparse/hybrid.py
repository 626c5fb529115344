"""Hybrid FFN: the hot neurons' rows live on the fast device (a compact copy), the CPU keeps the full
matrices and computes the cold neurons that fire; both parts run at the same time and are added.

Order per call, with one host wait a layer:
1. the predictor on the layer's device -> mask; the mask and the FFN input are copied to pinned host
   memory without blocking, and an event is recorded behind the copies;
2. the hot part is launched on the fast device (asynchronous on CUDA), queued after the copies;
3. the host waits for the event: the predictor and the two copies, not the hot kernels;
4. the CPU computes the cold firing rows (the C kernel releases the GIL) while the GPU runs the hot ones;
5. the cold result goes back through pinned memory without blocking, and the sum is queued on the GPU.
Both halves are `sparse_step` (gate first, one C call on the CPU); on CUDA the hot half is the Triton
kernels. Any device can stand in for the GPU: tests use a second "cpu" placement and get the same
numbers, and the `meta` device to count launches and waits (kernels/launches.py).
"""

from __future__ import annotations

import torch

from hotcold.kernels.launches import host_wait
from hotcold.kernels.triton_args import QTYPES
from hotcold.ops import Norm
from hotcold.quants import QuantTensor
from hotcold.sparse.ffn import CPU, FFN, DenseFFN, FFNWeights, row_plan, sparse_step
from hotcold.sparse.predictor import Predictor
from hotcold.state import Batch


def _rows_to(weight, rows: torch.Tensor, device: torch.device):
    if weight is None:
        return None
    if isinstance(weight, QuantTensor):
        if device.type != "cpu" and weight.qtype.name.lower() not in QTYPES:
            # the Triton kernels read Q8_0 and Q4_0 blocks; other types' hot rows go over as F16
            return weight.dequantize(rows).half().to(device)
        return weight.select_rows(rows).to(device)
    return weight.index_select(0, rows).to(device).contiguous()


class HybridFFN(FFN):
    def __init__(
        self,
        weights: FFNWeights,
        predictor: Predictor,
        hot: torch.Tensor,
        device: torch.device | str,
        *,
        layer: int,
        norm: Norm | None = None,
        threads: int | None = None,
        expert: int | None = None,
    ):
        if weights.down_t is None:
            raise ValueError("hybrid FFN needs the PowerInfer layout (ffn_down_t)")
        self.weights, self.predictor, self.norm = weights, predictor, norm
        self.layer, self.expert, self.threads = layer, expert, threads
        self.device = torch.device(device)
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
        self.cold_plan = row_plan(weights)
        self.hot_plan = row_plan(self.hot_weights)  # the CPU stand-in's hot half
        self.reference = DenseFFN(weights, layer=layer, expert=expert)  # ctx.dense: every neuron, on the CPU
        self._down_bias: dict[
            torch.device, torch.Tensor
        ] = {}  # the down bias where the output goes, moved once

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        out_device = h.device
        if ctx.dense:
            return self.reference.apply(h.to(CPU), p.to(CPU), ctx).to(out_device)
        mask = self.predictor(p)  # [T, F] bool, on the predictor's device
        # all hot: only the mask crosses (for the counts); else the FFN input too, for the cold rows
        copies, ready = to_host([mask] if self.all_hot else [mask, h], wait=False)
        hot_out = self._hot(h.to(self.device, non_blocking=True), mask.to(self.device)[:, self.hot_idx_fast])
        host_wait(ready)  # the predictor and the copies; the hot kernels run on
        mask_cpu = copies[0]
        if self.all_hot:
            out = hot_out.to(out_device)
        else:
            cold_out = sparse_step(
                self.weights, copies[1], mask_cpu & self.cold, self.cold_plan, self.threads
            )
            out = hot_out.to(out_device) + to_device(cold_out, out_device)
        ctx.count(self.layer, mask_cpu)
        if ctx.keep_masks and self.expert is None:
            ctx.keep(self.layer, p, mask_cpu)
        return self._add_down_bias(out)

    def _add_down_bias(self, out: torch.Tensor) -> torch.Tensor:
        bias = self.weights.down_bias
        if bias is None:
            return out
        placed = self._down_bias.get(out.device)
        if placed is None:
            placed = self._down_bias[out.device] = bias.to(out.device)
        return out + placed

    def _hot(self, h: torch.Tensor, mask_hot: torch.Tensor) -> torch.Tensor:
        w = self.hot_weights
        if self.device.type == "cpu":  # a CPU placement standing in for the GPU
            return sparse_step(w, h, mask_hot, self.hot_plan, self.threads)
        from hotcold.kernels import triton as gpu

        up = gpu_matvec(gpu, w.up, h, mask_hot)
        gate = gpu_matvec(gpu, w.gate, h, mask_hot) if w.gate is not None else None
        a = torch.where(mask_hot, w.combine(up, gate), 0.0)
        return gpu_axpy(gpu, w.down_t, a, mask_hot)


def to_host(tensors: list[torch.Tensor], *, wait: bool = True):
    """Tensors copied to the host without blocking (CUDA ones through pinned memory; host ones as they
    are), then one wait for all of them: the list of host copies, or with wait=False (copies, event) for
    the caller's `host_wait(event)`."""
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    meta = any(t.device.type == "meta" for t in tensors)
    if cuda is None and not meta:
        return tensors if wait else (tensors, None)
    copies = []
    for t in tensors:
        if t.device.type == "cuda":
            copies.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
        else:  # the host already (a CPU predictor's mask), or meta (counting: no data to wait for)
            copies.append(t.to(CPU, non_blocking=True))
    event = "meta"
    if cuda is not None:  # behind every copy above, on the stream that ran them
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(cuda))
    if not wait:
        return copies, event
    host_wait(event)
    return copies


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host result onto the device without blocking the host (through pinned memory on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
