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

import threading
import time

import torch

from hotcold.device import same_device
from hotcold.gguf.quants import QuantTensor
from hotcold.kernels.launches import host_wait
from hotcold.kernels.triton_args import QTYPES
from hotcold.ops import Norm
from hotcold.runtime.state import Batch
from hotcold.sparse.ffn import CPU, FFN, DenseFFN, row_plan, sparse_step
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.predictor import Predictor


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
        one_token: bool | None = None,
    ):
        """one_token: decode tokens through the fused kernels (OneToken); None: where they apply on a GPU.
        Tests force it on a CPU placement under the Triton interpreter."""
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
        if one_token is None:
            one_token = self.device.type == "cuda"
        self.one_token = OneToken.build(self) if one_token else None
        # benchmarks set a list here: each call then appends its LayerClock times (a sync at its end)
        self.profile: list[dict] | None = None

    def __call__(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor:
        norm = self.norm
        if norm is not None and norm.rms and not ctx.dense:
            # a decode token: the RMS norm runs inside the predictor's first kernel
            out = self._fused_token(x, x, ctx, norm=norm)
            if out is not None:
                return out
        return super().__call__(x, ctx)

    def _fused_token(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch, *, norm=None) -> torch.Tensor | None:
        """OneToken's output for one token where it applies, else None; also None after a launch raised,
        which switches the fused paths off (nothing is counted or kept before its last kernel)."""
        one = self.one_token
        if (
            one is None
            or h.shape[0] != 1
            or not one.td.FusedPaths.enabled
            or not same_device(h.device, one.device)
            or not same_device(p.device, one.device)
        ):
            return None
        try:
            return self._add_down_bias(one(self, h, p, ctx, norm=norm))
        except Exception as exc:
            one.td.FusedPaths.fail(exc)
            return None

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        out_device = h.device
        if ctx.dense:
            return self.reference.apply(h.to(CPU), p.to(CPU), ctx).to(out_device)
        out = self._fused_token(h, p, ctx)
        if out is not None:
            return out
        clock = LayerClock(self.device) if self.profile is not None else None
        mask = self.predictor(p)  # [T, F] bool, on the predictor's device
        # all hot: only the mask crosses (for the counts); else the FFN input too, for the cold rows
        copies, ready = to_host([mask] if self.all_hot else [mask, h], wait=False)
        clock and clock.hot_start()
        hot_out = self._hot(h.to(self.device, non_blocking=True), mask.to(self.device)[:, self.hot_idx_fast])
        clock and clock.hot_end()
        host_wait(ready)  # the predictor and the copies; the hot kernels run on
        clock and clock.mark("waited")
        mask_cpu = copies[0]
        if self.all_hot:
            out = hot_out.to(out_device)
        else:
            cold_out = sparse_step(
                self.weights, copies[1], mask_cpu & self.cold, self.cold_plan, self.threads
            )
            clock and clock.mark("cold")
            out = hot_out.to(out_device) + to_device(cold_out, out_device)
        ctx.count(self.layer, mask_cpu)
        if ctx.keep_masks and self.expert is None:
            ctx.keep(self.layer, p, mask_cpu)
        clock and self.profile.append(clock.done())
        return self._add_down_bias(out)

    def step_parts(self, device: torch.device) -> tuple | None:
        """The fixed-shape step takes a hybrid layer only when every neuron is hot on that device."""
        if self.all_hot and same_device(self.device, device) and self.norm is not None:
            return self.hot_weights, self.predictor, self.norm
        return None

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


class OneToken:
    """A hybrid layer's decode token through the fused kernels (kernels/triton_decode.py), eight launches
    a layer where the general path takes ~16 kernels (and the norm's 6) and their Python:
    predictor fc1 + ReLU, fc2 + threshold -> int8 mask [F] and its 16-neuron block counts (logits in fp32);
    the FFN input and the mask, side by side in one device buffer, to pinned memory in one copy with an event
    behind it; gate/up over the compacted list of firing neurons (ascending; a cold one's lane reads nothing:
    neuron i is hot row pos[i], -1 when cold) and the down_t axpy's split sums over that list, queued;
    one host wait; the cold firing rows on the CPU while the GPU works; the cold result back through a
    pinned buffer without blocking and added to the hot splits in one last kernel. Built at load where it
    applies: float predictor on the hot rows' device, gated FFN, ReLU or SiLU, no up bias (else None: the
    general path).

    Its buffers (device scratch, the pinned staging both ways, the event) are made once and reused every
    call, one call at a time (a lock: server slots share the model). Reuse needs no further waits: the
    device buffers are only touched in stream order, and when the host refills a pinned buffer the copy that
    read it last is done, since the host has since waited on an event recorded after that copy."""

    def __init__(self, ffn: HybridFFN, td, *, fc1, fc2, threshold: float, gate, up, down, qtypes, down_qtype,
                 width: int, hot_idx: torch.Tensor):  # fmt: skip
        self.td, self.device = td, ffn.device
        self.fc1, self.fc2, self.threshold = fc1, fc2, threshold  # the predictor [R, D], [F, R]
        self.gate, self.up, self.down = gate, up, down  # the hot rows [K, D] (float, or uint8 ggml blocks)
        self.qtypes, self.down_qtype = qtypes, down_qtype  # their block types (None: float)
        self.width, self.hot_idx = width, hot_idx  # D; the hot rows' neuron ids on the device
        self.n_hot = len(ffn.hot_idx)
        self.splits = td.axpy_splits(self.n_hot, self.width, self.device)[0]
        dev, f32 = self.device, dict(dtype=torch.float32, device=self.device)
        self.count_sink = torch.zeros(1, dtype=torch.int32, device=dev)  # counts come from the mask
        self.no_cold = torch.zeros(width, **f32)  # all hot: nothing to add
        self.r = torch.zeros(fc1.shape[0], **f32)  # the predictor's hidden layer
        n_ff = fc2.shape[0]
        self.a = torch.zeros(n_ff, **f32)  # the list's activations (a cold neuron's: 0)
        self.list = td.Compact.empty(n_ff, dev)  # the firing neurons, compacted on the device
        pos = torch.full((n_ff,), -1, dtype=torch.int32)
        pos[ffn.hot_idx] = torch.arange(self.n_hot, dtype=torch.int32)
        self.pos = pos.to(dev)  # neuron -> its hot row, -1: cold
        self.partial = torch.zeros(self.splits, width, **f32)
        # what the host needs, side by side for one copy: the FFN input h (fp32 [D]), then the mask (int8 [F])
        self.stage = torch.zeros(4 * width + n_ff, dtype=torch.uint8, device=dev)
        self.h, self.mask = (
            self.stage[: 4 * width].view(torch.float32),
            self.stage[4 * width :].view(torch.int8),
        )
        # the host's copy of the stage (the stage itself where a CPU stands in for the GPU), the cold
        # result's pinned buffer and its device copy, the event behind the copy out
        cuda = dev.type == "cuda"
        host = (
            self.stage
            if dev.type == "cpu"
            else torch.zeros(self.stage.shape, dtype=torch.uint8, pin_memory=cuda)
        )
        self.host, self.host_h, self.host_mask = (
            host,
            host[: 4 * width].view(torch.float32),
            host[4 * width :].view(torch.int8),
        )
        self.host_cold = torch.zeros(width, dtype=torch.float32, pin_memory=cuda)
        self.cold = torch.zeros(width, **f32)
        self.ready = torch.cuda.Event() if cuda else "meta" if dev.type == "meta" else None
        self._lock = threading.Lock()

    @classmethod
    def build(cls, ffn: HybridFFN) -> OneToken | None:
        from hotcold.kernels import triton as gpu

        w, pred = ffn.hot_weights, ffn.predictor
        if not gpu.available() or ffn.expert is not None or len(ffn.hot_idx) == 0:
            return None
        if (
            w.kind not in ("gated", "gated_both")
            or w.activation not in ("relu", "silu")
            or w.up_bias is not None
        ):
            return None
        fc = [getattr(pred, "fc1", None), getattr(pred, "fc2", None)]
        if not all(
            isinstance(t, torch.Tensor) and same_device(t.device, ffn.device) and t.stride(-1) == 1
            for t in fc
        ):
            return None
        from hotcold.kernels import triton_decode as td

        def rows(t):  # (tensor, block type) as the fused kernels take them
            if isinstance(t, QuantTensor):
                return t.data, t.qtype.name.lower()
            return t, None

        (gate, gq), (up, uq), (down, dq) = rows(w.gate), rows(w.up), rows(w.down_t)
        if not {gq, uq, dq} <= {None, *QTYPES}:  # a CPU stand-in keeps every block type; the kernels read two
            return None
        width = ffn.weights.down_t.shape[1]  # D, in values
        parts = dict(fc1=fc[0], fc2=fc[1], threshold=float(pred.threshold), gate=gate, up=up, down=down,
                     qtypes=(gq, uq), down_qtype=dq, width=width, hot_idx=ffn.hot_idx_fast)  # fmt: skip
        return cls(ffn, td, **parts)

    def __call__(
        self, ffn: HybridFFN, h: torch.Tensor, p: torch.Tensor, ctx: Batch, *, norm=None
    ) -> torch.Tensor:
        """h, p [1, D] on the hot rows' device -> the FFN output [1, D] there (the down bias not added).
        With `norm` (an RMS Norm), h is the layer's un-normed input: the predictor's first kernel writes
        norm(h) on the side, so the norm costs no launch of its own."""
        with self._lock:
            return self._token(ffn, h, p, ctx, norm)

    def _token(self, ffn: HybridFFN, h: torch.Tensor, p: torch.Tensor, ctx: Batch, norm) -> torch.Tensor:
        td, dev, w = self.td, self.device, ffn.hot_weights
        clock = LayerClock(dev) if ffn.profile is not None else None
        if norm is not None:  # fc1 writes norm(h) into the stage
            td.gemv(self.fc1, p[0], out=self.r, relu=True, norm=norm.weight, eps=norm.eps, normed_out=self.h)
            h = self.h
        else:
            td.gemv(self.fc1, p[0], out=self.r, relu=True)
            if not ffn.all_hot:  # the cold rows need h on the host: into the stage, beside the mask
                h = self.h.copy_(h[0])
            else:
                h = h[0]
        td.gemv(self.fc2, self.r, out=self.r, threshold=self.threshold, mask_out=self.mask, count=self.count_sink,
                block_counts=self.list.block_counts)  # fmt: skip
        if self.host is not self.stage:  # one copy out (all hot: the mask alone), the event behind it
            part = slice(4 * self.width, None) if ffn.all_hot else slice(None)
            self.host[part].copy_(self.stage[part], non_blocking=True)
        if isinstance(self.ready, torch.cuda.Event):
            self.ready.record(torch.cuda.current_stream(dev))
        clock and clock.hot_start()
        td.gate_up(self.gate, self.up, h, self.mask, self.a, kind=w.kind, activation=w.activation,
                   qtypes=self.qtypes, compact=self.list, neuron_rows=self.pos)  # fmt: skip
        partial = td.down_axpy_partial(
            self.down, self.a, self.partial, qtype=self.down_qtype, compact=self.list
        )
        clock and clock.hot_end()
        host_wait(self.ready)  # the predictor and the copy; the hot kernels run on
        clock and clock.mark("waited")
        fired = self.host_mask.view(1, -1) != 0  # [1, F] bool (a new tensor: the caller may keep it)
        if ffn.all_hot:
            cold = self.no_cold  # only read
        else:
            cold_out = sparse_step(ffn.weights, self.host_h.view(1, -1), fired & ffn.cold, ffn.cold_plan,
                                   ffn.threads)  # fmt: skip
            clock and clock.mark("cold")
            if dev.type == "cpu":
                cold = cold_out[0]
            else:  # back through the pinned buffer, without blocking
                self.host_cold.copy_(cold_out[0])
                cold = self.cold.copy_(self.host_cold, non_blocking=True)
        out = td.reduce_residual(partial, cold, torch.empty(self.width, dtype=torch.float32, device=dev))
        ctx.count(ffn.layer, fired)
        if ctx.keep_masks:
            ctx.keep(ffn.layer, p, fired)
        clock and ffn.profile.append(clock.done())
        return out.view(1, -1)


class LayerClock:
    """One hybrid layer call's times, for benchmarks (HybridFFN.profile), in ms: `launch` host time up to
    the host wait (the predictor, the copies, the hot kernels' launches), `wait` the host wait, `cpu_cold`
    the CPU's cold rows, `tail` the rest of the host's work, `gpu_hot` the hot kernels on the device (CUDA
    events; a CPU stand-in computes them on the host, inside `launch`), `sync` what the host then waits for
    the device at the end (a sync this clock adds), and `overlap`: the hot kernels' time that ran while the
    CPU computed (gpu_hot - sync, within [0, min(gpu_hot, cpu_cold)]; 0 on a CPU stand-in)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.t = {"start": time.perf_counter()}
        self.events: list = []

    def mark(self, name: str) -> None:
        self.t[name] = time.perf_counter()

    def hot_start(self) -> None:
        self._hot_mark("hot_start")

    def hot_end(self) -> None:
        self._hot_mark("hot_end")

    def _hot_mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.events.append(event)
        self.mark(name)

    def done(self) -> dict:
        self.mark("end")
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        t = self.t
        synced = time.perf_counter()
        launched = t.get("hot_end", t["start"])
        waited = t.get("waited", launched)
        cold = t.get("cold", waited)
        ms = {
            "launch": launched - t["start"],
            "wait": waited - launched,
            "cpu_cold": cold - waited,
            "tail": t["end"] - cold,
            "sync": synced - t["end"],
        }
        if self.cuda and len(self.events) == 2:
            ms["gpu_hot"] = self.events[0].elapsed_time(self.events[1]) / 1e3
        else:
            ms["gpu_hot"] = t.get("hot_end", 0.0) - t.get("hot_start", 0.0)
        out = {k: v * 1e3 for k, v in ms.items()}
        hidden = min(out["gpu_hot"] - out["sync"], out["gpu_hot"], out["cpu_cold"])
        out["overlap"] = max(0.0, hidden) if self.cuda else 0.0
        return out


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
