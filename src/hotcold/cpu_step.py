"""A llama-family decode token on the CPU in one C call (`hc_decode_layers`): per layer the same two calls the
layers make one by one (q/k/v + RoPE attention: `hc_decode_head`; o projection, residual, the FFN with its
norm, residual: `hc_decode_tail` or `hc_dense_tail`), so the same bits, without the interpreter between
the layers (about 50 us a layer on a 2-core machine: a sparse Q4_0 1B-shaped token measured 1.17x faster in one
call, a dense one 1.05x).

A plan holds each layer's arguments for one sequence (its KV cache) and one kind of forward (sparse, or
`dense`), built on the first token that can use it. It applies where every layer would have made those C
calls itself: one sequence, one new token, no profiling (observe, keep_masks) and no hot neurons on a GPU,
every layer on the CPU with a C q/k/v group and a C tail (`FFN.c_tail`). Elsewhere `CPUDecoder` returns
None and the layers run as before.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from hotcold.kernels import build
from hotcold.kernels.build import HCLayer, nthreads
from hotcold.ops import check_context

CPU = torch.device("cpu")


class CPUDecoder:
    """`decoder(x, ctx)` -> the last layer's residual [1, D] for one decode token, or None (not applicable)."""

    def __init__(self, model):
        self.model = model
        self._plans: dict[tuple[int, bool], _Plan | None] = {}  # (id of the sequence's KV cache, dense)
        self._lock = threading.Lock()

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        if len(ctx.seqs) != 1 or ctx.rows != 1 or ctx.keep_masks or ctx.observe is not None:
            return None
        seq = ctx.seqs[0]
        if seq.hot is not None and any(h is not None for h in seq.hot):
            return None
        if x.device.type != "cpu" or x.dtype != torch.float32 or build.get_lib() is None:
            return None
        key = (id(seq.kv), bool(ctx.dense))
        with self._lock:  # the server's slots decode on one model from several threads
            plan = self._plans.get(key, False)
            if plan is False or (plan is not None and plan.kv() is not seq.kv):
                # a new cache (or a new one at a dropped cache's address): plans hold their cache weakly,
                # so the plans of dropped engines go, not their caches' memory
                self._plans = {k: p for k, p in self._plans.items() if p is not None and p.kv() is not None}
                plan = self._plans[key] = _Plan.build(self.model, seq.kv, bool(ctx.dense))
        return None if plan is None else plan.run(x, ctx.starts[0], seq)


class _Plan:
    def __init__(self, kv, rope, threads: int, layers: list, keep: list, n_ff: list[int]):
        self.kv = weakref.ref(kv)  # the layers point into its tensors: used only while it lives
        self.rope, self.threads = rope, threads
        self.layers = (HCLayer * len(layers))(*layers)
        self.keep = keep  # the tensors and structs the layers' pointers point into
        self.n_ff = n_ff
        self.fired = (ctypes.c_int64 * len(layers))()

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

    def run(self, x: torch.Tensor, pos: int, seq) -> torch.Tensor:
        check_context(pos + 1, seq.kv.k[0].shape[0])
        cos, sin = (t.contiguous() for t in self.rope(pos, 1, CPU))
        out = x.reshape(1, -1).to(torch.float32, copy=True).contiguous()
        rc = build.get_lib().hc_decode_layers(
            len(self.n_ff), self.layers, out.data_ptr(), out.shape[1], pos, cos.data_ptr(), sin.data_ptr(),
            self.fired, self.threads,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("hc_decode_layers failed")
        for i, f in enumerate(self.n_ff):
            seq.count(i, int(self.fired[i]), f)
        return out
