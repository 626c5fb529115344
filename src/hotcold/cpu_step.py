"""A llama-family decode step on the CPU in one C call (`hc_decode_step`): one token of one sequence, or one token
of each sequence of a batch. Per layer the same calls the layers make one by one (the q/k/v group over the rows
with the attention norm folded, RoPE attention over each row's own caches: `hc_decode_head`'s calls; o
projection, residual, the FFN with its norm, residual: `hc_decode_tail` or `hc_dense_tail`, and for one token the
thresholded and input-sparse tails), so the same bits, without the interpreter between the layers (about 50 us a
layer on a 2-core machine: a sparse Q4_0 1B-shaped token measured 1.17x faster in one call, a dense one 1.05x; a
batch of 8 on the F16 1B synthetic 0.89x the step time, 35.3 against 39.7 ms).

A plan holds each layer's arguments for one sequence (its KV cache) and one kind of forward (sparse, or
`dense`), built on the first token that can use it; a batch's call takes each sequence's own plan (its caches;
the weights are the same in all). It applies where every layer would have made those C calls itself: one new
token a sequence, no profiling (observe, keep_masks) and no hot neurons on a GPU, every layer on the CPU with a C
q/k/v group and a C tail (`FFN.c_tail`); a batch not over thresholded or input-sparse layers (their calls take one
token; the C call says so before computing anything), and below the GEMM size (where a dense tail's matrices run
in C for any row count, as for one). Elsewhere `CPUDecoder` returns None and the layers run as before.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from hotcold.kernels import build
from hotcold.kernels.build import HCLayer, nthreads
from hotcold.kernels.cpu import GEMM_MIN_TOKENS
from hotcold.ops import check_context

CPU = torch.device("cpu")


class CPUDecoder:
    """`decoder(x, ctx)` -> the last layer's residual [rows, D] for a decode step (one token of one sequence, or
    one token of each sequence of a batch), or None (not applicable)."""

    def __init__(self, model):
        self.model = model
        self._plans: dict[tuple[int, bool], _Plan | None] = {}  # (id of the sequence's KV cache, dense)
        self._lock = threading.Lock()

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        n = len(ctx.seqs)
        if ctx.rows != n or ctx.keep_masks or ctx.observe is not None:
            return None
        # a batch under the GEMM size (every row its own bits), never a dense reference forward (one sequence)
        if n > 1 and (ctx.dense or n >= GEMM_MIN_TOKENS):
            return None
        if any(seq.hot is not None and any(h is not None for h in seq.hot) for seq in ctx.seqs):
            return None
        if x.device.type != "cpu" or x.dtype != torch.float32 or build.get_lib() is None:
            return None
        plans = []
        with self._lock:  # the server's slots decode on one model from several threads
            for seq in ctx.seqs:
                plan = self._plan(seq, bool(ctx.dense))
                if plan is None:
                    return None
                plans.append(plan)
        return _run(plans, x, ctx)

    def _plan(self, seq, dense: bool) -> _Plan | None:
        """The plan for seq's KV cache (caller holds the lock), built on first use."""
        key = (id(seq.kv), dense)
        plan = self._plans.get(key, False)
        if plan is False or (plan is not None and plan.kv() is not seq.kv):
            # a new cache (or a new one at a dropped cache's address): plans hold their cache weakly,
            # so the plans of dropped engines go, not their caches' memory
            self._plans = {k: p for k, p in self._plans.items() if p is not None and p.kv() is not None}
            plan = self._plans[key] = _Plan.build(self.model, seq.kv, dense)
        return plan


def _run(plans: list[_Plan], x: torch.Tensor, ctx) -> torch.Tensor | None:
    """One decode token of each of len(plans) sequences (plan j: sequence j's) through every layer in one C call;
    None where the call does not take the batch (nothing computed: the layers run it)."""
    n = len(plans)
    for seq, pos in zip(ctx.seqs, ctx.starts):
        check_context(pos + 1, seq.kv.k[0].shape[0])
    cos, sin = (t.contiguous() for t in plans[0].rope.rows(list(ctx.starts), CPU))
    out = x.reshape(n, -1).to(torch.float32, copy=True).contiguous()
    rc = build.get_lib().hc_decode_step(
        len(plans[0].n_ff), n, (_LAYERS * n)(*[p.layers_ptr for p in plans]), out.data_ptr(), out.shape[1],
        (ctypes.c_int64 * n)(*ctx.starts), cos.data_ptr(), sin.data_ptr(), (_FIRED * n)(*[p.fired_ptr for p in plans]),
        plans[0].threads,
    )  # fmt: skip
    if rc == -2:  # a layer whose tail takes one token, in a batch
        return None
    if rc != 0:
        raise MemoryError("hc_decode_step failed")
    for seq, plan in zip(ctx.seqs, plans):
        for i, f in enumerate(plan.n_ff):
            seq.count(i, int(plan.fired[i]), f)
    return out


_LAYERS = ctypes.POINTER(HCLayer)
_FIRED = ctypes.POINTER(ctypes.c_int64)


class _Plan:
    def __init__(self, kv, rope, threads: int, layers: list, keep: list, n_ff: list[int]):
        self.kv = weakref.ref(kv)  # the layers point into its tensors: used only while it lives
        self.rope, self.threads = rope, threads
        self.layers = (HCLayer * len(layers))(*layers)
        self.keep = keep  # the tensors and structs the layers' pointers point into
        self.n_ff = n_ff
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
        layers, keep, n_ff = [], [], []
        for i, layer in enumerate(model.layers):
            group = layer.qkv.c_group
            norm = layer.attn_norm
            kc, vc = kv.k[i], kv.v[i]
            if (
                layer.device.type != "cpu"
                or group is None
                or group.rows != [h * dh, hkv * dh, hkv * dh]
                or not norm.rms
                or not all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in (kc, vc))
                or kc.shape[1:] != (hkv, dh)
                or vc.shape != kc.shape
            ):
                return None
            c_tail = getattr(layer.ffn, "c_tail", None)  # MoE layers have none
            tail = c_tail(layer.wo, dense=dense) if c_tail is not None else None
            if tail is None:
                return None
            attn_w = norm.weight.to(torch.float32).contiguous()
            fields = dict(tail["fields"])
            for name in ("wo", "fc1", "fc2", "up", "gate", "down", "score", "score_in"):
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
                    kc=kc.data_ptr(), vc=vc.data_ptr(), H=h, Hkv=hkv, Dh=dh, R=r, neox=0,
                    window=c.sliding_window or 0, **fields,
                )
            )  # fmt: skip
            keep += [group, attn_w, tail["keep"], fields]
            n_ff.append(layer.ffn.n_ff)
        threads = nthreads(getattr(model.layers[0].ffn, "threads", None))  # the layers' own C calls use it
        return cls(kv, model.rope, threads, layers, keep, n_ff)
