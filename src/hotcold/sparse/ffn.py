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
from hotcold.kernels.build import hc_weight
from hotcold.ops import LinearGroup, Norm, Weight, linear, uses_c_kernels
from hotcold.sparse.ffn_weights import FFNWeights
from hotcold.sparse.predictor import Predictor
from hotcold.state import Batch

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
    _tail: ffn_calls.DenseTail | bool | None = (
        None  # the one-call dense tail, built on first use; False: none
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

    def decode_tail(self, attn: torch.Tensor, x: torch.Tensor, wo: Weight, ctx: Batch) -> torch.Tensor | None:
        """The rest of the layer after attention in one call, where a subclass has one (else None)."""
        return None

    def c_tail(self, wo: Weight, *, dense: bool, norm: Norm | None = None) -> dict | None:
        """The fields of this layer's tail in a one-token C decode (build.HCLayer: sparse or dense, the
        tail's weight structs, which the returned "keep" holds alive), or None where the layer's own
        decode_tail would not make that C call; the caller checks the forward (one sequence, one row, not
        observed). norm: the norm the tail applies, given by a MoE layer for its experts (which norm once for
        all of them; default: this FFN's own, and an expert then has none). None here: a subclass says so."""
        return None

    def _tail_norm(self, norm: Norm | None) -> Norm | None:
        """c_tail's norm: the one given (a MoE layer's, for its expert), else this FFN's own unless it is an
        expert (whose tail is its MoE layer's)."""
        if norm is not None:
            return norm
        return None if self.expert is not None else self.norm

    def _record(self, ctx: Batch, p: torch.Tensor, mask: torch.Tensor, fired: int | None) -> None:
        """A sparse step's computed neurons (fired: the mask's sum when the kernel counted it) and, when
        profiling keeps them, its masks with the predictor input p."""
        ctx.count(self.layer, mask, fired)
        if ctx.keep_masks and self.expert is None:
            ctx.keep(self.layer, p, self.weights.in_file_order(mask))

    def _c_tail_fields(self, wo: Weight, d: int, keep: object, norm: Norm, **fields) -> dict | None:
        """c_tail's result for a tail plan `keep` taking D = d: wo's struct (None if wo does not map d), the
        FFN norm (RMS, or a LayerNorm with its bias), the down bias, the given fields; "keep" holds what the
        fields point into."""
        wo_struct = hc_weight(wo)
        if wo_struct.rows != d:
            return None
        norm_w, eps = cpu.norm_weight(norm.c_args, d)
        vectors = [norm_w]
        fields.update(wo=wo_struct, ffn_norm=norm_w.data_ptr(), ffn_eps=eps)
        if not norm.rms:  # a LayerNorm (falcon, opt): hc_layer_norm, then the FFN of its output
            fields["ffn_ln"] = 1
            if norm.bias is not None:
                vectors.append(cpu.norm_weight((norm.bias, eps), d)[0])
                fields["ffn_norm_b"] = vectors[-1].data_ptr()
        if self.weights.down_bias is not None:
            vectors.append(cpu.norm_weight((self.weights.down_bias, 0.0), d)[0])
            fields["down_bias"] = vectors[-1].data_ptr()
        return dict(fields=fields, keep=(keep, wo, wo_struct, vectors))

    def _c_tail_weights_ok(self, wo: Weight) -> bool:
        """What every C tail needs: a wo and FFN matrices that `linear` multiplies in C for one token
        (`ops.uses_c_kernels`: float32 goes to torch, whose bits the C kernels do not have)."""
        w = self.weights
        down, _ = self._dense_down()
        mats = [m for m in (wo, w.up, w.gate, down) if m is not None]
        return all(uses_c_kernels(m) and cpu.runs_c_kernel(m, 1) for m in mats)

    def _dense_c_tail(self, wo: Weight, norm: Norm | None) -> dict | None:
        """c_tail's fields for the dense tail: every neuron, as dense_step computes them (the up / gate group,
        ffn_combine, down or the axpy over down_t), any norm, biases and activation the C combine has."""
        w = self.weights
        if norm is None or not self._c_tail_weights_ok(wo) or w.activation not in ffn_calls.C_ACTIVATIONS:
            return None
        if w.kind not in ffn_calls.FFN_KINDS or w.gate_bias is not None:  # gpt-oss's experts: not in C yet
            return None
        down, down_is_t = self._dense_down()
        structs = [hc_weight(m) for m in (w.up, w.gate, down)]
        d, f = wo.shape[0], w.n_ff
        down_shape = (f, d) if down_is_t else (d, f)
        shapes = [(f, d), (f, d), down_shape]
        if any(s is not None and (s.rows, s.cols) != shape for s, shape in zip(structs, shapes)):
            return None
        bias = None if w.up_bias is None else w.up_bias.to(torch.float32).contiguous()
        fields = dict(
            up=structs[0], gate=structs[1], down=structs[2], sparse=0, down_is_t=int(down_is_t),
            up_bias=cpu.ptr(bias), kind=ffn_calls.FFN_KINDS[w.kind], act=ffn_calls.C_ACTIVATIONS[w.activation],
        )  # fmt: skip
        return self._c_tail_fields(wo, d, (w, structs, bias), norm, **fields)

    def _dense_down(self) -> tuple[Weight, bool]:
        """The down projection the dense path multiplies: (ffn_down [D, F], False) or (ffn_down_t, True)."""
        w = self.weights
        return (w.down, False) if w.down is not None else (w.down_t, True)

    def _dense_tail_plan(self, wo: Weight, t: int) -> ffn_calls.DenseTail | None:
        """The one-call dense tail for t tokens (built once per layer, its wo), or None where it does not
        apply (gelu, an expert, a down bias, weights `matmul` would not multiply in C)."""
        w = self.weights
        down, down_is_t = self._dense_down()
        mats = [m for m in (wo, w.up, w.gate, down) if m is not None]
        if (
            not 0 < t < cpu.GEMM_MIN_TOKENS
            or self.expert is not None
            or self.norm is None
            or not self.norm.rms
            or w.down_bias is not None
            or not all(uses_c_kernels(m) and cpu.runs_c_kernel(m, t) for m in mats)
        ):
            return None
        if self._tail is None or self._tail.weights[0] is not wo:
            try:
                self._tail = ffn_calls.DenseTail(
                    wo, w.up, w.gate, down, down_is_t=down_is_t, kind=w.kind, activation=w.activation,
                    up_bias=w.up_bias,
                )  # fmt: skip
            except ValueError:  # gelu, or shapes the C call does not take
                self._tail = False
        return self._tail or None

    def _dense_tail(self, attn: torch.Tensor, x: torch.Tensor, wo: Weight, ctx: Batch) -> torch.Tensor | None:
        """x + o + ffn(x + o) with o = linear(attn, wo) and every neuron, for a few tokens on the CPU, in one
        C call (ffn_calls.DenseTail: the same bits as the ops one by one); None where it does not apply."""
        t = x.shape[0] if x.dim() == 2 else 0
        if (
            x.device.type != "cpu"
            or ctx.observe is not None
            or self.norm is None
            or not self.norm.folds_into_c(x)
        ):
            return None
        tail = self._dense_tail_plan(wo, t)
        threads = getattr(self, "threads", None)  # SparseFFN's; DenseFFN has none (torch's count)
        got = None if tail is None else tail(attn, x, norm=self.norm.c_args, threads=threads)
        if got is None:
            return None
        # count_all reads only the activation's shape: a meta tensor of it, no memory
        ctx.count_all(self.layer, torch.empty(t, self.n_ff, device="meta"))
        return got[1]

    def _dense(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch, up_gate: LinearGroup):
        out, a = dense_step(self.weights, h, up_gate)
        if ctx.observe is not None and self.expert is None:
            ctx.observe(self.layer, h, p, self.weights.in_file_order(a))
        ctx.count_all(self.layer, a)
        return self.weights.add_down_bias(out)


class DenseFFN(FFN):
    """Every neuron: the reference path (`--dense`) and the path for dense GGUF files."""

    def __init__(
        self, weights: FFNWeights, *, layer: int, norm: Norm | None = None, expert: int | None = None
    ):
        self.weights, self.norm, self.layer, self.expert = weights, norm, layer, expert
        self.up_gate = LinearGroup([weights.up, weights.gate]) if weights.gate is not None else None

    def apply(self, h: torch.Tensor, p: torch.Tensor, ctx: Batch) -> torch.Tensor:
        return self._dense(h, p, ctx, self.up_gate)

    def step_parts(self, device: torch.device) -> tuple | None:
        return (self.weights, None, self.norm) if self.norm is not None else None

    def decode_tail(self, attn: torch.Tensor, x: torch.Tensor, wo: Weight, ctx: Batch) -> torch.Tensor | None:
        return self._dense_tail(attn, x, wo, ctx)

    def c_tail(self, wo: Weight, *, dense: bool, norm: Norm | None = None) -> dict | None:
        return self._dense_c_tail(wo, self._tail_norm(norm))


class SparseFFN(FFN):
    """Only the neurons the predictor selects, per token, on the CPU: row-gather GEMV for gate and up, axpy
    over down_t. For a few tokens with a CPU predictor of the kernels' types the whole step (predictor,
    norm included) is one C call, same bits as op by op."""

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

    def decode_tail(self, attn: torch.Tensor, x: torch.Tensor, wo: Weight, ctx: Batch) -> torch.Tensor | None:
        """x + o + ffn(x + o) with o = linear(attn, wo), for a few tokens on the CPU, in one C call (the same
        bits as the layer's ops one by one); None where that call does not apply (the caller runs the ops).
        A dense forward (ctx.dense) takes the dense tail."""
        if ctx.dense:
            return self._dense_tail(attn, x, wo, ctx)
        if (
            x.device.type != "cpu"
            or x.shape[0] >= cpu.GEMM_MIN_TOKENS  # a prefill batch's predictor goes to torch's GEMM
            or not self._sparse_tail_ready(wo)
            or not self.norm.folds_into_c(x)
        ):
            return None
        got = self.fused_plan.tail(wo, attn, x, norm=self.norm.c_args, threads=self.threads)
        if got is None:
            return None
        y1, y2, mask, fired = got
        self._record(ctx, y1, mask, fired)
        return y2

    def _sparse_tail_ready(self, wo: Weight) -> bool:
        """What the sparse tail needs whatever the tokens (decode_tail and c_tail): the fused plan with its
        predictor at the predictor's threshold, an RMS norm to fold, no down bias, and a wo that `matmul`
        multiplies in C (the op-by-op path multiplies a float32 wo in torch)."""
        plan = self.fused_plan
        return (
            plan is not None
            and plan.fc1 is not None
            and plan.threshold == self.predictor.threshold
            and self.norm is not None
            and self.norm.rms
            and self.weights.down_bias is None
            and uses_c_kernels(wo)
        )

    def c_tail(self, wo: Weight, *, dense: bool, norm: Norm | None = None) -> dict | None:
        """As FFN.c_tail; the sparse tail (predictor, row gathers, axpy) unless the forward is dense. Any norm
        and a down bias (the C decode layer's general tail: falcon, opt), where decode_tail takes RMS only."""
        norm = self._tail_norm(norm)
        if dense:
            return self._dense_c_tail(wo, norm)
        plan = self.fused_plan
        if (
            plan is None
            or plan.fc1 is None
            or plan.threshold != self.predictor.threshold
            or norm is None
            or not uses_c_kernels(wo)
        ):
            return None
        return self._c_tail_fields(
            wo, plan.d, plan, norm, fc1=plan.fc1, fc2=plan.fc2, thr=plan.threshold, up=plan.up, gate=plan.gate,
            down=plan.down_t, sparse=1, up_bias=cpu.ptr(plan.bias), kind=plan.kind,
        )  # fmt: skip

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
        self._record(ctx, p, mask, fired)
        return w.add_down_bias(out)
