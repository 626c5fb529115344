"""The FFN block of every family, computed densely (the reference) or sparsely (only firing neurons).

One call for every kind: `ffn(x, ctx)` with x the residual stream [T, D] and ctx the forward's batch
(state.Batch: which rows belong to which sequence);
the FFN applies its own norm (as an mlx-lm block owns its post-attention norm), feeds the un-normed x to
its predictor (every family's predictor input is the residual the FFN receives: reference §0 fact 5),
counts what it computed into each row's sequence, and returns its output [T, D] on x's device. `ffn.apply(h, p, ctx)`
takes an already-normed input (MoE experts). A family says how gate and up combine (`kind`) and which
activation it uses; the loader chooses dense, sparse or hybrid. Neuron i is row i of up, gate and down_t.
"""

from __future__ import annotations

import torch

from hotcold.kernels import cpu, ffn_calls
from hotcold.ops import LinearGroup, Norm, Weight, linear, uses_c_kernels
from hotcold.runtime.state import Batch
from hotcold.sparse import tails
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.predictor import Predictor

CPU = torch.device("cpu")

# ------------------------------------------------------------------------------------------------
# The steps: dense, and the one sparse step (CPU path and both halves of the hybrid path)
# ------------------------------------------------------------------------------------------------


def dense_step(w: FFNWeights, h: torch.Tensor, up_gate: LinearGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every neuron: (output [T, D] without the down bias, activation [T, F])."""
    if w.gate is not None:
        up, gate = up_gate(h)
    else:
        up, gate = linear(h, w.up), None
    a = w.combine(up, gate)
    if w.down is not None:
        return linear(a, w.down), a
    down_t = w.down_t
    if isinstance(down_t, torch.Tensor) and (down_t.dtype == torch.float32 or down_t.device.type != "cpu"):
        return (a.to(down_t.dtype) @ down_t).float(), a
    return cpu.sparse_axpy(down_t, a, None), a


def row_plan(w: FFNWeights) -> ffn_calls.SparseFFNPlan | None:
    """The sparse step as one C call for a given mask, where it applies: ReLU, CPU weights of the
    kernels' types, the C backend. Built at load; None means `sparse_step` runs it op by op."""
    if w.activation != "relu" or w.down_t is None or cpu.backend() != "c":
        return None
    if any(m is not None and _device(m).type != "cpu" for m in (w.up, w.gate, w.down_t)):
        return None
    try:
        return ffn_calls.SparseFFNPlan(w.up, w.gate, w.down_t, kind=w.kind, up_bias=w.up_bias)
    except ValueError:  # a weight type without a C kernel
        return None


def sparse_step(
    w: FFNWeights,
    h: torch.Tensor,
    mask: torch.Tensor,
    plan: ffn_calls.SparseFFNPlan | None,
    threads: int | None,
) -> torch.Tensor:
    """The rows of `mask` [T, F] only: gate first (where relu(gate) is 0, a predictor's false positive, up
    need not be read), up, the activation, the axpy over down_t -> [T, D] without the down bias. On the
    CPU. `plan` (row_plan) does the same in one C call, bit for bit."""
    if plan is not None:
        return plan(h, rows=mask, threads=threads)[0]
    live, gate = mask, None
    if w.gate is not None:
        gate = cpu.gather_matvec(w.gate, h, mask, threads=threads)
        if w.activation == "relu":
            live = mask & (torch.relu(gate) != 0)
    up = cpu.gather_matvec(w.up, h, live, threads=threads)
    # inactive neurons contribute exactly 0, even where a bias would make act(b) nonzero (OPT)
    a = torch.where(live, w.combine(up, gate), 0.0)
    return cpu.sparse_axpy(w.down_t, a, live, threads=threads)


def _device(weight: Weight) -> torch.device:
    return weight.device if isinstance(weight, torch.Tensor) else weight.data.device


# ------------------------------------------------------------------------------------------------
# The FFN kinds
# ------------------------------------------------------------------------------------------------


class FFN:
    """Base of every FFN kind: `ffn(x, ctx)` norms x and calls `apply(h, p, ctx)`.

    layer: the layer index (ctx's counts and records are per layer); expert: the expert index inside a
    MoE layer (experts are not observed one by one, and their masks are not kept)."""

    weights: FFNWeights
    norm: Norm | None
    layer: int
    expert: int | None
    tail_type = (
        None  # the layer tail class (sparse/tails.py) a layer with this FFN gets at load; None: op by op
    )

    def __call__(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor:
        return self.apply(self.norm(x) if self.norm is not None else x, x, ctx)

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        raise NotImplementedError

    @property
    def n_ff(self) -> int:
        return self.weights.n_ff

    def step_parts(self, device: torch.device) -> tuple | None:
        """(weights, predictor or None, norm) where a fixed-shape decode step on `device` can take this FFN
        whole (decode_step.from_model then checks each tensor's device), else None."""
        return None

    def record(self, ctx: Batch, p: torch.Tensor, mask: torch.Tensor, fired: int | None) -> None:
        """A sparse step's computed neurons (fired: the mask's sum when the kernel counted it) and, when
        profiling keeps them, its masks with the predictor input p."""
        ctx.count(self.layer, mask, fired)
        if ctx.keep_masks and self.expert is None:
            ctx.keep(self.layer, p, self.weights.in_file_order(mask))

    def dense_down(self) -> tuple[Weight, bool]:
        """The down projection the dense path multiplies: (ffn_down [D, F], False) or (ffn_down_t, True)."""
        w = self.weights
        return (w.down, False) if w.down is not None else (w.down_t, True)

    def _dense(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch, up_gate: LinearGroup):
        out, a = dense_step(self.weights, h, up_gate)
        if ctx.observe is not None and self.expert is None:
            ctx.observe(self.layer, h, p, self.weights.in_file_order(a))
        ctx.count_all(self.layer, a)
        return self.weights.add_down_bias(out)


class DenseFFN(FFN):
    """Every neuron: the reference path (`--dense`) and the path for dense GGUF files."""

    tail_type = tails.DenseTail

    def __init__(
        self, weights: FFNWeights, *, layer: int, norm: Norm | None = None, expert: int | None = None
    ):
        self.weights, self.norm, self.layer, self.expert = weights, norm, layer, expert
        self.up_gate = LinearGroup([weights.up, weights.gate]) if weights.gate is not None else None

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        return self._dense(h, p, ctx, self.up_gate)

    def step_parts(self, device: torch.device) -> tuple | None:
        return (self.weights, None, self.norm) if self.norm is not None else None


class SparseFFN(FFN):
    """Only the neurons the predictor selects, per token, on the CPU: row-gather GEMV for gate and up, axpy
    over down_t. For a few tokens with a CPU predictor of the kernels' types the whole step (predictor,
    norm included) is one C call, same bits as op by op."""

    tail_type = tails.SparseTail

    def __init__(
        self,
        weights: FFNWeights,
        predictor: Predictor,
        *,
        layer: int,
        norm: Norm | None = None,
        threads: int | None = None,
        expert: int | None = None,
    ):
        if weights.down_t is None:
            raise ValueError("sparse FFN needs the PowerInfer layout (ffn_down_t)")
        self.weights, self.predictor, self.norm = weights, predictor, norm
        self.layer, self.expert, self.threads = layer, expert, threads
        self.up_gate = LinearGroup([weights.up, weights.gate]) if weights.gate is not None else None
        self.rows_plan = row_plan(weights)
        self.fused_plan = self._fused_plan()

    def _fused_plan(self) -> ffn_calls.SparseFFNPlan | None:
        """Predictor + step in one C call. The predictor's matmuls must run in the C kernels (not float32
        tensors, which `linear` hands to torch) for the bits to equal the op-by-op path."""
        w, pred = self.weights, self.predictor
        if not isinstance(pred, Predictor) or self.rows_plan is None:
            return None
        if not all(uses_c_kernels(m) for m in (pred.fc1, pred.fc2)):
            return None
        try:
            return ffn_calls.SparseFFNPlan(
                w.up,
                w.gate,
                w.down_t,
                kind=w.kind,
                up_bias=w.up_bias,
                fc1=pred.fc1,
                fc2=pred.fc2,
                threshold=pred.threshold,
            )
        except ValueError:
            return None

    def _fuses(self, h: torch.Tensor, ctx: Batch) -> bool:
        plan = self.fused_plan
        return (
            plan is not None
            and not ctx.dense
            and h.shape[0] < cpu.GEMM_MIN_TOKENS  # a prefill batch's predictor goes to torch's GEMM
            and plan.threshold == self.predictor.threshold
        )

    def __call__(self, x: torch.Tensor, ctx: Batch) -> torch.Tensor:
        out_device, x = x.device, x.to(CPU)  # the CPU kernels run here even when attention is on a GPU
        fuses = self._fuses(x, ctx)
        if fuses and self.norm is not None and self.norm.folds_into_c(x):
            return self._apply(x, x, ctx, fuses=True, norm=self.norm).to(out_device)
        h = self.norm(x) if self.norm is not None else x
        return self._apply(h, x, ctx, fuses=fuses, norm=None).to(out_device)

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        return self._apply(h.to(CPU), p, ctx, fuses=self._fuses(h, ctx), norm=None).to(h.device)

    def step_parts(self, device: torch.device) -> tuple | None:  # a CPU placement standing in for the GPU
        return (
            (self.weights, self.predictor, self.norm)
            if self.expert is None and self.norm is not None
            else None
        )

    def _apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch, *, fuses: bool, norm: Norm | None):
        """h: the FFN input, or with `norm` the residual it is the RMS norm of (folded into the C call);
        fuses: whether the one-call plan runs (`_fuses`, decided once per call)."""
        if ctx.dense:
            return self._dense(h, p, ctx, self.up_gate)
        w = self.weights
        if fuses:
            norm_args = norm.c_args if norm is not None else None
            out, mask, fired = self.fused_plan(h, p.to(CPU), norm=norm_args, threads=self.threads)
        else:
            mask = self.predictor(p).to(CPU)  # [T, F] bool
            out, fired = sparse_step(w, h, mask, self.rows_plan, self.threads), int(mask.sum())
        self.record(ctx, p, mask, fired)
        return w.add_down_bias(out)
