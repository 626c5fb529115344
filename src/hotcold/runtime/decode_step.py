"""A one-token decode step with fixed shapes for a llama-family model that lives entirely on one device
(gpt-fast's recipe): every buffer preallocated, the position a device tensor, the KV cache written in
place at that position, attention over a length mask in the cache's dtype, the firing counts kept on the
device. Nothing in a step reads a device value on the host, so on CUDA the whole step is captured once per
KV cache in a CUDA graph and replayed per token; the only host traffic per token is the token's embedding
row in and one copy of [logits, firing counts] out.

Per layer eight kernel launches with the fused Triton kernels (kernels/triton_decode.py):
qkv + norm + RoPE + KV write, attention, o projection + residual, then for a sparse FFN the predictor's
fc1 (writing the normed FFN input on the side), fc2 + threshold -> mask + count + per-block counts,
gate/up of the firing rows (a compacted list of them in ascending row order, built inside the kernel from
the block counts), down_t axpy over that list, sum + residual. `TorchKernels` (kernels/torch_decode.py) is
the same step in plain torch ops (fixed shapes, no syncs): the reference the fused kernels are tested
against, and the fallback where Triton is missing.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from hotcold.device import same_device
from hotcold.kernels.torch_decode import TorchKernels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLayer:
    """One layer's tensors on the step's device: float matrices [rows, D] row-major, float32 vectors."""

    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [qd + 2 kvd, D]: q, k, v rows (q and k in the GGUF order: RoPE on adjacent pairs)
    wo: torch.Tensor  # [D, qd]
    ffn_norm: torch.Tensor  # [D]
    up: torch.Tensor  # [F, D]
    gate: torch.Tensor  # [F, D]
    down_t: torch.Tensor | None  # [F, D] (sparse files), or
    down: torch.Tensor | None  # [D, F] (dense layout)
    fc1: torch.Tensor | None = None  # [R, D]: the predictor (None: dense FFN)
    fc2: torch.Tensor | None = None  # [F, R]
    threshold: float = 0.0
    # the FFN matrices' ggml block types ("q8_0", "q4_0": uint8 [F, row bytes], read by the fused kernels
    # as the file stores them); None: float
    gate_qtype: str | None = None
    up_qtype: str | None = None
    down_qtype: str | None = None


@dataclass(frozen=True)
class StepShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    kind: str  # "gated" | "gated_both"
    activation: str  # "relu" | "silu"
    window: int = 0  # sliding window (0: none)


def triton_kernels():
    """The fused Triton kernels as an object with TorchKernels' methods (imports triton)."""
    from hotcold.kernels import triton_decode as td

    class TritonKernels:
        gemv = staticmethod(td.gemv)
        qkv_rope = staticmethod(td.qkv_rope)
        attention = staticmethod(td.attention)
        gate_up = staticmethod(td.gate_up)
        down_axpy = staticmethod(td.down_axpy)
        compact = staticmethod(td.Compact.empty)  # the compacted firing list's scratch

        @staticmethod
        def partial_rows(layer: StepLayer) -> int:
            return td.axpy_splits(layer.down_t.shape[0], layer.wo.shape[0], layer.down_t.device)[0]

    return TritonKernels()


class _Buffers:
    """Everything one step writes besides the KV cache, preallocated on the device."""

    def __init__(self, layers: list[StepLayer], shape: StepShape, n_vocab: int, device, partial_rows: int):
        D = layers[0].wo.shape[0]  # wo is float [D, qd]
        n_ff = max(layer.up.shape[0] for layer in layers)
        rank = max((layer.fc1.shape[0] for layer in layers if layer.fc1 is not None), default=1)
        f32 = dict(dtype=torch.float32, device=device)
        self.x = torch.zeros(D, **f32)  # the residual stream; the embedding row comes in here
        self.x2 = torch.zeros(D, **f32)
        self.h = torch.zeros(D, **f32)  # the normed FFN input
        self.q = torch.zeros(shape.n_head * shape.head_dim, **f32)
        self.attn = torch.zeros_like(self.q)
        self.r = torch.zeros(rank, **f32)  # the predictor's hidden layer
        # the FFN's activations: one a row (0 where a neuron did not fire), or the fused kernels' compacted
        # list (a[e] for row compact.rows[e])
        self.a = torch.zeros(n_ff, **f32)
        self.mask = torch.zeros(n_ff, dtype=torch.int8, device=device)
        self.partial = torch.zeros(partial_rows, D, **f32)
        self.compact = None  # the kernels' compacted-list scratch (StaticDecoder sets it)
        # what comes back to the host each token, in one copy: logits [V], then per-layer firing counts
        self.result = torch.zeros(n_vocab + len(layers), **f32)
        self.logits = self.result[:n_vocab]
        self.counts = self.result[n_vocab:].view(torch.int32)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)


class StaticDecoder:
    """The fixed-shape decode step over `layers` on one device; `head_norm` [D], `head` [V, D]; `cos`/`sin`
    [n_ctx, Dh/2] float32 RoPE tables. kernels: "triton" or "torch"."""

    def __init__(self, layers: list[StepLayer], shape: StepShape, head_norm, head, cos, sin, *,
                 kernels: str = "triton", capture: bool | None = None):  # fmt: skip
        self.layers, self.shape = layers, shape
        self.head_norm, self.head = head_norm, head
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self.device = head.device
        self.fused = kernels == "triton"
        self.kernels = triton_kernels() if self.fused else TorchKernels()
        self.n_ff = [layer.up.shape[0] for layer in layers]
        self.sparse = [layer.fc1 is not None for layer in layers]
        self._lock = threading.Lock()  # one set of buffers: one step at a time (server slots share a model)
        self.steps = 0  # steps completed
        self.failure: str | None = None  # why the engine stopped using this step (its first step raised)
        rows = max((self.kernels.partial_rows(la) for la in layers if la.down_t is not None), default=1)
        self.buf = _Buffers(layers, shape, head.shape[0], self.device, rows)
        self.buf.compact = self.kernels.compact(max(self.n_ff), self.device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KV cache -> CUDA graph
        self._host = torch.zeros(self.buf.result.shape, dtype=torch.float32, pin_memory=self.capture)

    def covers(self, kv, pos: int) -> bool:
        """Whether a step at `pos` of this cache is inside the RoPE tables and the cache."""
        return pos < self.cos.shape[0] and pos < kv.n_ctx

    def run(self, k_caches, v_caches) -> None:
        """One step on the buffers: x (the embedding row) and pos in, result (logits, counts) out."""
        b, s, k = self.buf, self.shape, self.kernels
        qd = s.n_head * s.head_dim
        kvd = s.n_head_kv * s.head_dim
        b.counts.zero_()
        for i, layer in enumerate(self.layers):
            k.qkv_rope(layer.wqkv, b.x, layer.attn_norm, s.eps, b.pos, self.cos, self.sin, b.q,
                       k_caches[i], v_caches[i], n_q=qd, n_kv=kvd)  # fmt: skip
            k.attention(b.q, k_caches[i], v_caches[i], b.pos, b.attn, n_head=s.n_head, head_dim=s.head_dim,
                        window=s.window)  # fmt: skip
            k.gemv(layer.wo, b.attn, out=b.x2, residual=b.x)  # x2 = x + attention's output
            n_ff = layer.up.shape[0]
            a = b.a[:n_ff]
            if layer.fc1 is not None:
                r = b.r[: layer.fc1.shape[0]]
                mask = b.mask[:n_ff]
                k.gemv(layer.fc1, b.x2, out=r, relu=True, norm=layer.ffn_norm, eps=s.eps, normed_out=b.h)
                list_ = b.compact and b.compact.first(
                    n_ff
                )  # the firing rows as a list: a[e] is row rows[e]'s
                k.gemv(layer.fc2, r, out=r, threshold=layer.threshold, mask_out=mask, count=b.counts[i : i + 1],
                       block_counts=list_ and list_.block_counts)  # fmt: skip
                k.gate_up(layer.gate, layer.up, b.h, mask, a, kind=s.kind, activation=s.activation,
                          qtypes=(layer.gate_qtype, layer.up_qtype), compact=list_)  # fmt: skip
            else:  # dense FFN: every row, the norm computed inside the gate/up kernel
                list_ = None
                k.gate_up(layer.gate, layer.up, b.x2, None, a, kind=s.kind, activation=s.activation,
                          norm=layer.ffn_norm, eps=s.eps, qtypes=(layer.gate_qtype, layer.up_qtype))  # fmt: skip
            if layer.down_t is not None:
                k.down_axpy(layer.down_t, a, b.x2, b.partial, b.x, qtype=layer.down_qtype, compact=list_)
            else:
                k.gemv(layer.down, a, out=b.x, residual=b.x2)
        k.gemv(self.head, b.x, out=b.logits, norm=self.head_norm, eps=s.eps)

    def step(self, kv, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, list[int]]:
        """One token: its embedding row x [D] (on the host) at `pos` of the sequence whose cache is `kv`
        (state.KVCache on this device) -> (logits [V] float32 on the host, firing counts per layer)."""
        with self._lock:
            out = self._step(kv, x, pos)
            self.steps += 1
            return out

    def _step(self, kv, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, list[int]]:
        if not self.covers(kv, pos):
            raise ValueError(
                f"position {pos} is past the context ({min(kv.n_ctx, self.cos.shape[0])} tokens)"
            )
        b = self.buf
        if self.capture:
            b.x.copy_(x, non_blocking=True)
            b.pos.fill_(pos)
            graph = self._graphs.get(kv)
            if graph is None:  # the first step of this cache runs eagerly, then the step is captured
                self._graphs[kv] = self._run_and_capture(kv)
            else:
                graph.replay()
            self._host.copy_(b.result, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the one wait of the token
        else:
            b.x.copy_(x)
            b.pos.fill_(pos)
            self.run(kv.k, kv.v)
            self._host.copy_(b.result)
        n_vocab = self.head.shape[0]
        return self._host[:n_vocab].clone(), self._host[n_vocab:].view(torch.int32).tolist()

    def _run_and_capture(self, kv):
        """This token's step run eagerly on a side stream (also the warm-up CUDA graphs want before a
        capture), then a CUDA graph of the same step over this cache's tensors (their addresses are baked in)."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.run(kv.k, kv.v)
            # thread_local: another thread's eager work on the GPU (a server slot's prefill) does not
            # invalidate this capture
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.run(kv.k, kv.v)
        current.wait_stream(stream)
        return graph


# ------------------------------------------------------------------------------------------------
# From a loaded model
# ------------------------------------------------------------------------------------------------


class _NoStep(Exception):
    """Why a model cannot take the fused step (from_model returns it as text)."""


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_TYPES = ("q8_0", "q4_0")  # the fused kernels read these ggml blocks as stored


def _matrix(t, device: torch.device, what: str) -> torch.Tensor:
    """A float matrix on `device`. Block-quantized CPU matrices (the CPU stand-in) are dequantized: what
    the loader's placement gives a GPU (as fp16) for everything but hot FFN rows."""
    from hotcold.gguf.quants import QuantTensor

    if isinstance(t, QuantTensor) and same_device(t.device, device) and device.type == "cpu":
        return t.dequantize()
    if not isinstance(t, torch.Tensor) or not same_device(t.device, device) or t.dtype not in _FLOATS:
        raise _NoStep(f"{what} is not a float matrix on {device}")
    if t.dim() != 2 or t.stride(-1) != 1:  # the fused kernels read rows with unit column stride
        raise _NoStep(f"{what} is not a row-major matrix")
    return t


def _ffn_matrix(t, device: torch.device, what: str, fused: bool) -> tuple[torch.Tensor, str | None]:
    """(matrix, block type): Q8_0 / Q4_0 blocks stay blocks for the fused kernels; else a float matrix."""
    from hotcold.gguf.quants import QuantTensor

    if (
        fused
        and isinstance(t, QuantTensor)
        and same_device(t.device, device)
        and t.qtype.name.lower() in _BLOCK_TYPES
    ):
        return t.data, t.qtype.name.lower()
    return _matrix(t, device, what), None


def _ffn_parts(ffn, device: torch.device):
    """(FFNWeights, predictor or None, norm) of a layer's FFN when all of it computes on `device`: the FFN
    answers (FFN.step_parts; a kind without the method, a MoE layer, never does)."""
    parts = getattr(ffn, "step_parts", lambda device: None)(device)
    if parts is None:
        raise _NoStep(f"the FFN ({type(ffn).__name__}) is not all on {device}")
    return parts


def from_model(
    model, *, kernels: str | None = None, capture: bool | None = None, ctx_size: int | None = None
):
    """(StaticDecoder, None) for a llama-family model whose every layer, FFN and head live on one device
    (float matrices; FFN rows may be Q8_0 / Q4_0 blocks for the fused kernels), else (None, why not).
    Sparse layers must be all-hot (every neuron on that device)."""
    for i, layer in enumerate(model.layers):
        spec = getattr(layer, "spec", None)
        what = (
            "no layer description"
            if spec is None
            else spec.beyond_llama() or (spec.input_sparse and "input sparsity")
        )
        if what:
            return None, f"layer {i}: {what} takes the eager step"
    c = model.config
    device = model.head.device
    if kernels is None:
        kernels = "triton" if device.type == "cuda" and _triton_ok() else "torch"
    fused = kernels == "triton"
    if c.rope_dim != c.head_dim or c.head_dim & (c.head_dim - 1):
        return None, "partial RoPE or a head size that is not a power of two"
    if not model.layers[0].attn_norm.rms:
        return None, "LayerNorm models take the eager step"
    try:
        layers = [_step_layer(i, layer, device, fused) for i, layer in enumerate(model.layers)]
        head = _matrix(model.head.weight, device, "the output head")
    except _NoStep as why:
        return None, str(why)
    kinds = {(w.kind, w.activation) for w, _ in layers}
    if len(kinds) != 1:
        return None, f"layers mix FFN kinds {sorted(kinds)}"
    kind, activation = kinds.pop()
    cos, sin = model.rope.tables(max(c.n_ctx_train, ctx_size or 0), device)
    shape = StepShape(c.n_head, c.n_head_kv, c.head_dim, model.layers[0].attn_norm.eps, kind, activation,
                      window=c.sliding_window or 0)  # fmt: skip
    step_layers = [step for _, step in layers]
    decoder = StaticDecoder(step_layers, shape, model.head.norm.weight, head, cos, sin,
                            kernels=kernels, capture=capture)  # fmt: skip
    return decoder, None


def _step_layer(i: int, layer, device: torch.device, fused: bool):
    """(FFN weights, StepLayer) of model layer i, or _NoStep."""
    if not same_device(layer.device, device):
        raise _NoStep(f"layer {i}'s attention is on {layer.device}, the head on {device}")
    try:
        w, predictor, norm = _ffn_parts(layer.ffn, device)
    except _NoStep as why:
        raise _NoStep(f"layer {i}: {why}") from None
    if w.kind not in ("gated", "gated_both") or w.activation not in ("relu", "silu") or w.up_bias is not None:
        raise _NoStep(f"layer {i}'s FFN ({w.kind}, {w.activation}, bias) has no fused step")
    wq, wk, wv = layer.qkv.weights
    mats = [_matrix(t, device, f"layer {i}'s attention") for t in (wq, wk, wv)]
    # on a GPU the group already holds q/k/v as one matrix (ops.LinearGroup.fused); the CPU stand-in stacks
    wqkv = layer.qkv.fused if layer.qkv.fused is not None else torch.cat(mats)
    gate, gate_q = _ffn_matrix(w.gate, device, f"layer {i}'s ffn_gate", fused)
    up, up_q = _ffn_matrix(w.up, device, f"layer {i}'s ffn_up", fused)
    if w.down_t is not None:
        down_t, down_q = _ffn_matrix(w.down_t, device, f"layer {i}'s ffn_down_t", fused)
        down = None
    else:
        down_t, down_q, down = None, None, _matrix(w.down, device, f"layer {i}'s ffn_down")
    fc1 = fc2 = None
    if predictor is not None:
        fc1 = _matrix(predictor.fc1, device, f"layer {i}'s predictor")
        fc2 = _matrix(predictor.fc2, device, f"layer {i}'s predictor")
    step = StepLayer(
        attn_norm=layer.attn_norm.weight,
        wqkv=wqkv,
        wo=_matrix(layer.wo, device, f"layer {i}'s attn_output"),
        ffn_norm=norm.weight.to(device),
        up=up,
        gate=gate,
        down_t=down_t,
        down=down,
        fc1=fc1,
        fc2=fc2,
        threshold=float(predictor.threshold) if predictor is not None else 0.0,
        gate_qtype=gate_q,
        up_qtype=up_q,
        down_qtype=down_q,
    )
    return w, step


def _triton_ok() -> bool:
    try:
        from hotcold.kernels import triton as gpu
    except ImportError:
        return False
    return gpu.available()
