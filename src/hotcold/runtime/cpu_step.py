"""A llama-family decode step on the CPU in one C call (`hc_decode_step`): one token of one sequence, or one token
of each sequence of a batch. Per layer the same calls the layers make one by one (the q/k/v group over the rows
with the attention norm folded, RoPE attention over each row's own caches: `hc_decode_head`'s calls; o
projection, residual, the FFN with its norm, residual: `hc_decode_tail` or `hc_dense_tail`, and for one token the
thresholded and input-sparse tails), so the same bits, without the interpreter between the layers (about 50 us a
layer on a 2-core machine: a sparse Q4_0 1B-shaped token measured 1.17x faster in one call, a dense one 1.05x; a
batch of 8 on the F16 1B synthetic 0.89x the step time, 35.3 against 39.7 ms).

Whether a model decodes this way is decided once, at load (`unsupported`, read by decoders.choose_decoder). A
plan holds each layer's arguments for one sequence (its KV cache) and one kind of forward (sparse, or `dense`),
built on the first token that can use it and kept in that sequence's state; a batch's call takes each sequence's
own plan (its caches; the weights are the same in all). It applies where every layer would have made those C calls itself: one new
token a sequence, no profiling (observe, keep_masks) and no hot neurons on a GPU, every layer on the CPU with a C
q/k/v group and a C tail (`model.tails`: sparse/tails.py); a batch not over thresholded or input-sparse layers (their calls take one
token; the C call says so before computing anything), and below the GEMM size (where a dense tail's matrices run
in C for any row count, as for one). Elsewhere `CPUDecoder` returns None and the layers run as before.
"""

from __future__ import annotations

import ctypes
import math

import torch

from hotcold.kernels import build
from hotcold.kernels.build import HCLayer, nthreads
from hotcold.kernels.cpu import GEMM_MIN_TOKENS
from hotcold.ops import check_context

CPU = torch.device("cpu")


def unsupported(model) -> str | None:
    """Why the one-call step cannot run this model's decode tokens, or None where it can: read once, at load
    (decoders.choose_decoder), from the layer descriptions, where the layers live and the kernels they hold.
    Conditions of one forward (profiling, a dense batch, a cache the plan cannot point into) are checked per
    step: there the layers run that forward."""
    if build.get_lib() is None:
        return "no C kernels on this machine"
    c = model.config
    if not model.layers or c.n_head % c.n_head_kv:
        return "no layers, or query heads not a multiple of the KV heads"
    rope = getattr(model, "rope", None)
    if rope is None or rope.tables(1, CPU)[0].shape[-1] * 2 > c.head_dim:
        return "no RoPE tables of at most the head size"
    plan = getattr(model, "plan", None)
    if plan is not None and plan.hot is not None and any(len(h) for h in plan.hot if h is not None):
        return "hot neurons on the fast device: hybrid layers run one by one"
    h, hkv, dh = c.n_head, c.n_head_kv, c.head_dim
    for i, layer in enumerate(model.layers):
        if layer.device.type != "cpu":
            return f"layer {i} is on {layer.device}"
        group = layer.qkv.c_group
        if any(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in layer.qkv.weights):
            return (
                f"layer {i}: float32 q/k/v (torch multiplies float32; the C layer runs F16, BF16 and blocks)"
            )
        if group is None or group.rows != [h * dh, hkv * dh, hkv * dh]:
            return f"layer {i}: q/k/v not one C group"
        if model.tails[i] is None or model.tails[i].c_fields(dense=False) is None:
            return f"layer {i}: its FFN has no C tail"
        if layer.spec.input_sparse and layer.inputs.c_fields() is None:
            return f"layer {i}: its input-sparse q/k/v and o have no C form"
    return None


class CPUDecoder:
    """`decoder(x, ctx)` -> the last layer's residual [rows, D] for a decode step (one token of one sequence, or
    one token of each sequence of a batch), or None where this forward is not one it runs (then the layers do).
    Chosen at load (decoders.choose_decoder, after `unsupported`); each sequence's plan lives in its state."""

    def __init__(self, model, *, on_failure=None):
        self.model = model
        self.steps = (
            0  # decode steps run; a failure before the first one hands the model to the eager decoder
        )
        self.on_failure = on_failure  # on_failure(why): decoders.fall_back

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        n = len(ctx.seqs)
        if ctx.rows != n or ctx.keep_masks or ctx.observe is not None:
            return None
        # a batch under the GEMM size (every row its own bits), never a dense reference forward (one sequence)
        if n > 1 and (ctx.dense or n >= GEMM_MIN_TOKENS):
            return None
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        plans = []
        for seq in ctx.seqs:
            plan = self._plan(seq, bool(ctx.dense))
            if plan is None:
                return None
            plans.append(plan)
        try:
            out = _run(plans, x, ctx)
        except MemoryError as exc:
            if self.steps or self.on_failure is None:  # it has worked before: out of memory now, a real error
                raise
            self.on_failure(f"{type(exc).__name__}: {exc}")
            return None
        self.steps += out is not None
        return out

    def _plan(self, seq, dense: bool) -> _Plan | None:
        """The plan for seq's KV cache, built on its first decode token and kept in its state (a sequence
        belongs to one thread at a time, so no lock); None where this cache or a dense forward has none."""
        plan = seq.decode_plans.get(dense, False)
        if plan is False or (plan is not None and plan.kv is not seq.kv):
            plan = seq.decode_plans[dense] = _Plan.build(self.model, seq.kv, dense)
        return plan


def _run(plans: list[_Plan], x: torch.Tensor, ctx) -> torch.Tensor | None:
    """One decode token of each of len(plans) sequences (plan j: sequence j's) through every layer in one C call;
    None where the call does not take the batch (nothing computed: the layers run it)."""
    n = len(plans)
    for seq, pos in zip(ctx.seqs, ctx.starts):
        check_context(pos + 1, seq.kv.k[0].shape[0])
    cos, sin = (t.contiguous() for t in plans[0].rope.rows(list(ctx.starts), CPU))
    local = plans[0].rope_local  # Gemma 3's local layers' tables, or the same ones
    cos_l, sin_l = (
        (cos, sin) if local is None else (t.contiguous() for t in local.rows(list(ctx.starts), CPU))
    )
    out = x.reshape(n, -1).to(torch.float32, copy=True).contiguous()
    rc = build.get_lib().hc_decode_step(
        len(plans[0].n_ff), n, (_LAYERS * n)(*[p.layers_ptr for p in plans]), out.data_ptr(), out.shape[1],
        (ctypes.c_int64 * n)(*ctx.starts), cos.data_ptr(), sin.data_ptr(), cos_l.data_ptr(), sin_l.data_ptr(),
        (_FIRED * n)(*[p.fired_ptr for p in plans]),
        plans[0].threads,
    )  # fmt: skip
    if rc == -2:  # a layer whose tail takes one token, in a batch
        return None
    if rc != 0:
        raise MemoryError("hc_decode_step failed")
    for seq, plan in zip(ctx.seqs, plans):
        for i, f in enumerate(plan.n_ff):
            seq.count(i, int(plan.fired[i]), f)
        for i in plan.moe:  # as MoEFFN records it: the experts of the forward's rows, [1, k]
            seq.routing[i] = plan.routes[i : i + 1].clone()
    return out


_LAYERS = ctypes.POINTER(HCLayer)
_FIRED = ctypes.POINTER(ctypes.c_int64)


class _Plan:
    def __init__(
        self, kv, rope, threads: int, layers: list, keep: list, n_ff: list[int], routes, moe: list[int]
    ):
        self.kv = kv  # the layers point into its tensors (the plan lives in the state that owns it)
        self.rope, self.threads = rope, threads
        self.rope_local = None  # Gemma 3's local RoPE tables (the model's rope_local), set by build
        self.layers = (HCLayer * len(layers))(*layers)
        self.keep = keep  # the tensors and structs the layers' pointers point into
        self.n_ff = n_ff  # per layer, the neurons a token's counts are out of (a MoE layer: its experts')
        self.routes, self.moe = routes, moe  # [L, k] experts the C call wrote, for the MoE layers `moe`
        self.fired = (ctypes.c_int64 * len(layers))()
        self.layers_ptr, self.fired_ptr = ctypes.cast(self.layers, _LAYERS), ctypes.cast(self.fired, _FIRED)

    @classmethod
    def build(cls, model, kv, dense: bool) -> _Plan | None:
        c = model.config
        h, hkv, dh = c.n_head, c.n_head_kv, c.head_dim
        if not model.layers or h % hkv or not hasattr(model, "rope"):
            return None
        cos, _ = model.rope.tables(1, CPU)
        r = cos.shape[-1] * 2
        if r > dh:
            return None
        layers, keep, n_ff, moe = [], [], [], []
        k = getattr(model.config, "n_expert_used", 0) or 1
        routes = torch.zeros(len(model.layers), k, dtype=torch.int64)  # MoE layers' experts, row by layer
        for i, layer in enumerate(model.layers):
            group = layer.qkv.c_group
            norm = layer.attn_norm
            kc, vc = kv.k[i], kv.v[i]
            if (
                layer.device.type != "cpu"
                or group is None
                or group.rows != [h * dh, hkv * dh, hkv * dh]
                or not all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in (kc, vc))
                or kc.shape[1:] != (hkv, dh)
                or vc.shape != kc.shape
            ):
                return None
            tail = None if model.tails[i] is None else model.tails[i].c_fields(dense=dense)
            if tail is None:
                return None
            attn_w = norm.weight.to(torch.float32).contiguous()
            # LayerNorm families, biases, a parallel residual (falcon, opt): float32 vectors the struct points into
            spec, vectors, qk_eps, post_eps = layer.spec, {}, 0.0, 0.0
            if not norm.rms and norm.bias is not None:
                vectors["attn_norm_b"] = norm.bias
            for name in ("q_bias", "k_bias", "v_bias", "wo_bias", "sinks"):  # sinks [H]: gpt-oss
                if (b := getattr(layer, name, None)) is not None:
                    vectors[name] = b
            for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms [Dh]
                if (n := getattr(layer, name, None)) is not None:
                    vectors[name] = n.weight
                    qk_eps = n.eps
            for name, field in (("post_attn_norm", "attn_post_norm"), ("post_ffn_norm", "ffn_post_norm")):
                if (n := getattr(layer, name, None)) is not None:  # Gemma 3's sandwich norms [D]
                    vectors[field] = n.weight
                    post_eps = n.eps
            vectors = {k: v.to(torch.float32).contiguous() for k, v in vectors.items()}
            fields = dict(tail["fields"])
            fields.update({k: v.data_ptr() for k, v in vectors.items()})
            fields.update(
                attn_ln=int(not norm.rms), parallel=int(spec.residual == "parallel"), qk_eps=qk_eps,
                post_eps=post_eps, local_rope=int(spec.local_rope), early_router=int(spec.early_router),
                q_scale=spec.attn_scale * math.sqrt(dh) if spec.attn_scale else 0.0, attn_softcap=spec.attn_softcap,
            )  # fmt: skip
            if spec.moe:  # this sequence's experts of its last token land in its plan's row of routes
                fields["route_out"] = routes[i].data_ptr()
                moe.append(i)
            for name in ("wo", "fc1", "fc2", "up", "gate", "down", "score", "score_in", "router"):
                w = fields.get(name)
                fields[name] = ctypes.pointer(w) if w is not None else None
            inputs = None if dense else getattr(layer, "inputs", None)
            if inputs is not None:  # input-sparse q/k/v and o (attention_inputs.py)
                extra = inputs.c_fields()
                if extra is None or fields.get("sparse") != 2:
                    return None
                fields.update(extra["fields"])
                keep.append(extra["keep"])
            layers.append(
                HCLayer(
                    **group.c_fields, attn_norm=attn_w.data_ptr(), attn_eps=norm.eps,
                    kc=kc.data_ptr(), vc=vc.data_ptr(), H=h, Hkv=hkv, Dh=dh, R=0 if spec.nope else r,
                    neox=int(spec.rope_neox),
                    window=layer.spec.sliding_window, **fields,
                )
            )  # fmt: skip
            keep += [group, attn_w, vectors, tail["keep"], fields]
            n_ff.append(layer.ffn.n_ff)
        threads = nthreads(getattr(model.layers[0].ffn, "threads", None))  # the layers' own C calls use it
        plan = cls(kv, model.rope, threads, layers, keep + [routes], n_ff, routes, moe)
        plan.rope_local = getattr(model, "rope_local", None)
        return plan
