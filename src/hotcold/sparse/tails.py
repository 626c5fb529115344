"""A layer's tail, chosen once at load: the rest of a decode layer after attention (o projection, residual, the
FFN with its norm, residual) as one C call, with the bits of those ops one by one.

`layer_tail(ffn, wo)` builds it from the FFN's own class attribute `tail_type` (None: the FFN has no C tail, the
layer runs op by op), so no module tests FFN classes. A tail has two uses:
- `tail(attn, x, ctx)` in an eager forward: the layer's new residual, or None where this forward is not one the
  call takes (a GPU row, a prompt chunk, profiling, a norm the call cannot fold): the layer's ops run it, the one
  fallback contract (ARCHITECTURE.md). `eager` is False for tails only the one-call decode runs (MoE layers).
- `tail.c_fields(dense=...)` once per sequence plan of the one-call decode (cpu_step): the layer's tail fields of
  `HCLayer` and the objects they point into, or None where the C layer cannot take it.
A dense forward (`--dense`, ctx.dense) of any FFN takes the dense tail: every neuron.
"""

from __future__ import annotations

import ctypes

import torch

from hotcold.kernels import cpu, ffn_calls
from hotcold.kernels.build import HCWeight, hc_weight
from hotcold.kernels.decode_glue import GATINGS as GATING_CODES
from hotcold.ops import Norm, Weight, uses_c_kernels
from hotcold.runtime.state import Batch

_WEIGHTS = ctypes.POINTER(HCWeight)


def layer_tail(ffn, wo: Weight):
    """The tail of a layer with this FFN and o projection, or None (its FFN has none: op by op)."""
    kind = getattr(ffn, "tail_type", None)
    return None if kind is None else kind(ffn, wo)


class DenseTail:
    """Every neuron (`hc_dense_tail`): a dense FFN's tail, and a sparse one's for a dense forward. The C plan is
    made here, at load (None where it does not apply: an expert, a LayerNorm, a down bias, a kind or activation
    the C combine lacks, weights `matmul` multiplies in torch)."""

    eager = True

    def __init__(self, ffn, wo: Weight):
        self.ffn, self.wo = ffn, wo
        w = ffn.weights
        down, down_is_t = ffn.dense_down()
        self.mats = [m for m in (wo, w.up, w.gate, down) if m is not None]
        self.plan = None
        if (
            ffn.expert is None
            and ffn.norm is not None
            and ffn.norm.rms
            and w.down_bias is None
            and all(uses_c_kernels(m) for m in self.mats)
        ):
            try:
                self.plan = ffn_calls.DenseTail(
                    wo, w.up, w.gate, down, down_is_t=down_is_t, kind=w.kind, activation=w.activation,
                    up_bias=w.up_bias,
                )  # fmt: skip
            except ValueError:  # gelu, or shapes the C call does not take
                self.plan = None

    def __call__(self, attn: torch.Tensor, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
        return self.dense(attn, x, ctx)

    def dense(self, attn: torch.Tensor, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
        """x + o + ffn(x + o) with o = linear(attn, wo) and every neuron, for a few CPU rows, in one C call."""
        ffn, t = self.ffn, x.shape[0] if x.dim() == 2 else 0
        if (
            self.plan is None
            or x.device.type != "cpu"
            or ctx.observe is not None
            or not 0 < t < cpu.GEMM_MIN_TOKENS
            or not all(cpu.runs_c_kernel(m, t) for m in self.mats)
            or not ffn.norm.folds_into_c(x)
        ):
            return None
        threads = getattr(ffn, "threads", None)  # SparseFFN's; DenseFFN has none (torch's count)
        got = self.plan(attn, x, norm=ffn.norm.c_args, threads=threads)
        if got is None:
            return None
        # count_all reads only the activation's shape: a meta tensor of it, no memory
        ctx.count_all(ffn.layer, torch.empty(t, ffn.n_ff, device="meta"))
        return got[1]

    def c_fields(self, *, dense: bool, norm: Norm | None = None) -> dict | None:
        """The tail's HCLayer fields ("fields") and what they point into ("keep"), or None where the C layer
        cannot take it. norm: a MoE layer's, for its expert (which norm once for all of them); default: the
        FFN's own, and an expert then has none."""
        return self.dense_fields(self.norm_of(norm))

    def norm_of(self, norm: Norm | None) -> Norm | None:
        if norm is not None:
            return norm
        return None if self.ffn.expert is not None else self.ffn.norm

    def dense_fields(self, norm: Norm | None) -> dict | None:
        """Every neuron, as dense_step computes them (the up / gate group, ffn_combine, down or the axpy over
        down_t), any norm, biases and activation the C combine has."""
        w, expert = self.ffn.weights, self.ffn.expert is not None
        if norm is None or not self._weights_ok() or w.activation not in ffn_calls.C_ACTIVATIONS:
            return None
        # gpt-oss's experts (the clamped SwiGLU, a gate bias): through the MoE tail only, which takes their biases
        kinds = ffn_calls.COMBINE_KINDS if expert else ffn_calls.FFN_KINDS
        if w.kind not in kinds or (w.gate_bias is not None and not expert):
            return None
        down, down_is_t = self.ffn.dense_down()
        structs = [hc_weight(m) for m in (w.up, w.gate, down)]
        d, f = self.wo.shape[0], w.n_ff
        shapes = [(f, d), (f, d), (f, d) if down_is_t else (d, f)]
        if any(s is not None and (s.rows, s.cols) != shape for s, shape in zip(structs, shapes)):
            return None
        bias = None if w.up_bias is None else w.up_bias.to(torch.float32).contiguous()
        gate_bias = None if w.gate_bias is None else w.gate_bias.to(torch.float32).contiguous()
        fields = dict(
            up=structs[0], gate=structs[1], down=structs[2], sparse=0, down_is_t=int(down_is_t),
            up_bias=cpu.ptr(bias), kind=kinds[w.kind], act=ffn_calls.C_ACTIVATIONS[w.activation],
        )  # fmt: skip
        if gate_bias is not None:
            fields["gate_bias"] = cpu.ptr(gate_bias)  # an expert's: the MoE tail's e_gate_bias
        return self.fields(d, (w, structs, bias, gate_bias), norm, **fields)

    def _weights_ok(self) -> bool:
        """What every C tail needs: a wo and FFN matrices that `linear` multiplies in C for one token
        (`ops.uses_c_kernels`: float32 goes to torch, whose bits the C kernels do not have)."""
        return all(uses_c_kernels(m) and cpu.runs_c_kernel(m, 1) for m in self.mats)

    def fields(self, d: int, keep: object, norm: Norm, **fields) -> dict | None:
        """The fields of a tail plan `keep` taking D = d: wo's struct (None if wo does not map d), the FFN norm
        (RMS, or a LayerNorm with its bias), the down bias, the given fields; "keep" holds what they point into."""
        wo_struct = hc_weight(self.wo)
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
        if (down_bias := self.ffn.weights.down_bias) is not None:
            vectors.append(cpu.norm_weight((down_bias, 0.0), d)[0])
            fields["down_bias"] = vectors[-1].data_ptr()
        return dict(fields=fields, keep=(keep, self.wo, wo_struct, vectors))


class SparseTail(DenseTail):
    """The predictor, row gathers and axpy (`hc_decode_tail`) of a SparseFFN."""

    def __call__(self, attn: torch.Tensor, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
        if ctx.dense:
            return self.dense(attn, x, ctx)
        ffn = self.ffn
        if (
            x.device.type != "cpu"
            or x.shape[0] >= cpu.GEMM_MIN_TOKENS  # a prefill batch's predictor goes to torch's GEMM
            or not self._ready()
            or not ffn.norm.folds_into_c(x)
        ):
            return None
        got = ffn.fused_plan.tail(self.wo, attn, x, norm=ffn.norm.c_args, threads=ffn.threads)
        if got is None:
            return None
        y1, y2, mask, fired = got
        ffn.record(ctx, y1, mask, fired)
        return y2

    def _ready(self) -> bool:
        """What the eager sparse tail needs: the fused plan with its predictor at the predictor's threshold (it
        may change after load), an RMS norm to fold, no down bias, a wo `matmul` multiplies in C."""
        ffn, plan = self.ffn, self.ffn.fused_plan
        return (
            plan is not None
            and plan.fc1 is not None
            and plan.threshold == ffn.predictor.threshold
            and ffn.norm is not None
            and ffn.norm.rms
            and ffn.weights.down_bias is None
            and uses_c_kernels(self.wo)
        )

    def c_fields(self, *, dense: bool, norm: Norm | None = None) -> dict | None:
        """The sparse tail unless the forward is dense; any norm and a down bias (the C decode layer's general
        tail: falcon, opt), where the eager call takes RMS only."""
        norm = self.norm_of(norm)
        if dense:
            return self.dense_fields(norm)
        ffn, plan = self.ffn, self.ffn.fused_plan
        if (
            plan is None
            or plan.fc1 is None
            or plan.threshold != ffn.predictor.threshold
            or norm is None
            or not uses_c_kernels(self.wo)
        ):
            return None
        return self.fields(
            plan.d, plan, norm, fc1=plan.fc1, fc2=plan.fc2, thr=plan.threshold, up=plan.up, gate=plan.gate,
            down=plan.down_t, sparse=1, up_bias=cpu.ptr(plan.bias), kind=plan.kind,
        )  # fmt: skip


class ThresholdedTail(DenseTail):
    """The thresholded step (`hc_thresholded_tail`) of a ThresholdedFFN (`hotcold sparsify` files)."""

    def __call__(self, attn: torch.Tensor, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
        if ctx.dense:
            return self.dense(attn, x, ctx)
        ffn = self.ffn
        plan = ffn.plan_for(x, ctx)
        if plan is None or not self._ready() or not ffn.norm.folds_into_c(x):
            return None
        if ffn.prompt_rows_of(x, ctx) is not None:
            return None
        y1, y2, mask, kept = plan.tail(self.wo, attn, x, norm=ffn.norm.c_args, threads=ffn.threads)
        ffn.record(ctx, y1, mask, kept)
        return y2

    def _ready(self) -> bool:
        """An RMS norm to fold and a wo `matmul` multiplies in C (a float32 wo goes to torch)."""
        return self.ffn.norm is not None and self.ffn.norm.rms and uses_c_kernels(self.wo)

    def c_fields(self, *, dense: bool, norm: Norm | None = None) -> dict | None:
        if dense:
            return self.dense_fields(self.norm_of(norm))
        plan = self.ffn.plan
        if plan is None or norm is not None or not self._ready():
            return None
        return self.fields(
            plan.d, plan, self.ffn.norm, score=plan.score, scale=cpu.ptr(plan.scale), thr=plan.threshold,
            up=plan.up, gate=plan.gate, down=plan.down_t, sparse=2, score_in=plan.score_in, act=plan.act,
        )  # fmt: skip


class MoETail:
    """A mixture-of-experts layer in the one-call decode: the router and every expert's tail fields (the layer
    norms once for all). Eager forwards run the layer's ops (`eager` False: not called: llama.choose_ops)."""

    eager = False

    def __init__(self, ffn, wo: Weight):
        self.ffn, self.wo = ffn, wo
        self.experts = [layer_tail(e, wo) for e in ffn.experts]

    def c_fields(self, *, dense: bool) -> dict | None:
        """The router and every expert's FFN, as their own tails give them (cpu_step adds the sequence's routing
        buffer), or None where an expert has no C tail, the experts differ in kind, or the norm is not RMS."""
        moe = self.ffn
        if moe.stored:  # experts read from storage (storage/experts.py): no fixed addresses
            return None
        router_data = moe.router if isinstance(moe.router, torch.Tensor) else moe.router.data
        if not moe.norm.rms or router_data.device.type != "cpu":  # route multiplies a CPU router in C
            return None
        if any(t is None for t in self.experts):
            return None
        tails = [t.c_fields(dense=dense, norm=moe.norm) for t in self.experts]
        if any(t is None for t in tails):
            return None
        # ReLU experts over their live rows (relu_rows_ffn: relu_rows_apply's calls), as MoEFFN runs them
        relu_rows = not dense and all(moe.relu_rows)
        fields = [t["fields"] for t in tails]
        shared = ("sparse", "kind", "act", "down_is_t")
        if any(any(f.get(k) != fields[0].get(k) for k in shared) for f in fields):
            return None
        biases = {}  # gpt-oss: each expert's up, gate and down biases, as arrays of pointers (all experts or none)
        for name in ("up_bias", "gate_bias", "down_bias"):
            ptrs = [f.get(name) for f in fields]
            if any(p is None for p in ptrs) != all(p is None for p in ptrs):
                return None
            biases[name] = None if ptrs[0] is None else (ctypes.c_void_p * len(ptrs))(*ptrs)
        router = hc_weight(moe.router)
        if router.cols != self.wo.shape[0] or router.rows != len(moe.experts):
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
        # wo, the FFN norm and the shared fields; up (expert 0's) sizes the masks; the biases are per expert
        out = {k: v for k, v in fields[0].items() if k not in biases}
        router_bias = None if moe.router_bias is None else moe.router_bias.to(torch.float32).contiguous()
        out.update(
            router=router, n_expert=len(moe.experts), n_used=moe.n_used, e_thr=thr.data_ptr(),
            gating=GATING_CODES[moe.gating], relu_rows=int(relu_rows), **{f"e_{k}": v for k, v in arrays.items()},
            router_bias=cpu.ptr(router_bias),
            **{f"e_{k}": None if v is None else ctypes.addressof(v) for k, v in biases.items()},
        )  # fmt: skip
        return dict(fields=out, keep=(tails, router, moe.router, arrays, thr, router_bias, biases))
