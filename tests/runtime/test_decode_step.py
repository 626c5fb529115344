"""hotcold.runtime.decode_step: the fixed-shape decode step equals the eager engine step; the fused Triton kernels
(under the interpreter) equal the torch kernels; a step launches at most 8 kernels a layer and never syncs.

The Triton cases run in one subprocess with TRITON_INTERPRET=1 (see tests/kernels/test_triton.py for why
this process must not import triton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hotcold.kernels.launches import LaunchCounter
from hotcold.loader import load_model
from hotcold.ops import embed
from hotcold.runtime import decode_step
from hotcold.runtime.engine import Engine

PROMPT = list(range(3, 20))
STEPS = 6


@pytest.fixture()
def sparse_with_stats(tmp_path, tiny_sparse_gguf):
    """The tiny sparse file with activation statistics beside it, so a large budget puts every neuron on the
    fast device (the step needs every layer all hot)."""
    import shutil

    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(tiny_sparse_gguf, path)
    (tmp_path / "activation").mkdir()
    for i in range(2):
        torch.save(torch.arange(1280, 0, -1), tmp_path / "activation" / f"activation_{i}.pt")
    return path


def test_all_hot_cpu_stand_in_takes_the_step(sparse_with_stats):
    """What the gpu tests load, with a CPU placement standing in for the GPU: every neuron hot, every layer
    a HybridFFN, and the step attaches and equals the eager one."""
    from hotcold.sparse.hybrid import HybridFFN

    loaded = load_model(sparse_with_stats, device="cpu", fast_device="cpu", vram_budget=64)
    assert all(isinstance(layer.ffn, HybridFFN) and layer.ffn.all_hot for layer in loaded.model.layers)
    decoder, why = decode_step.from_model(loaded.model, kernels="torch")
    assert decoder is not None, why
    a, b = Engine(loaded.model, loaded.tokenizer, 64), Engine(loaded.model, loaded.tokenizer, 64)
    logits = a.prefill(PROMPT)
    b.prefill(PROMPT)
    x = embed_row(loaded.model, int(logits.argmax()))
    got, _ = decoder.step(a.seq.kv, x, len(PROMPT))
    with torch.inference_mode():
        ref = b.forward([int(logits.argmax())], len(PROMPT), last_only=True)[-1]
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def embed_row(model, token: int) -> torch.Tensor:
    return embed(model.token_embd, torch.tensor([token]))[0]


def eager_and_static(path, **load_args):
    """Greedy decode of PROMPT: the eager engine's logits, and the static step's over the same tokens."""
    loaded = load_model(path, device="cpu", **load_args)
    model = loaded.model
    decoder, why = decode_step.from_model(model, kernels="torch")
    assert decoder is not None, why
    eager, static = Engine(model, loaded.tokenizer, 64), Engine(model, loaded.tokenizer, 64)
    logits_e, logits_s = [eager.prefill(PROMPT)], [static.prefill(PROMPT)]
    counts_e, counts_s = [], []
    tokens = []
    for i in range(STEPS):
        token = int(logits_e[-1].argmax())
        tokens.append(token)
        pos = len(PROMPT) + i
        before = [c.computed for c in eager.seq.counts]
        with torch.inference_mode():
            logits_e.append(eager.forward([token], pos, last_only=True)[-1])
            x = embed_row(model, token)
            logits, counts = decoder.step(static.seq.kv, x, pos)
        logits_s.append(logits)
        counts_e.append([c.computed - b for c, b in zip(eager.seq.counts, before)])
        counts_s.append(counts)
    return torch.stack(logits_e[1:]), torch.stack(logits_s[1:]), counts_e, counts_s, tokens


def test_static_step_equals_eager_sparse(tiny_sparse_gguf):
    e, s, counts_e, counts_s, _ = eager_and_static(tiny_sparse_gguf)
    torch.testing.assert_close(s, e, rtol=0, atol=2e-5 * e.abs().max().item())
    assert (s.argmax(-1) == e.argmax(-1)).all()
    assert counts_s == counts_e and all(0 < sum(c) for c in counts_s)  # the same neurons fired


def test_static_step_equals_eager_dense(tiny_dense_gguf):
    e, s, counts_e, counts_s, _ = eager_and_static(tiny_dense_gguf)
    torch.testing.assert_close(s, e, rtol=0, atol=2e-5 * e.abs().max().item())
    assert all(c == [0, 0] for c in counts_s)  # no predictor: nothing counted


def test_engine_decodes_through_the_static_step(tiny_sparse_gguf):
    """What the loader attaches on a GPU, attached here on the CPU: the same text, the same neuron counts,
    and every decode token through the step."""
    import hotcold

    loaded = load_model(tiny_sparse_gguf, device="cpu")
    model = hotcold.Model(loaded)
    ref = model.generate("the quick brown fox", max_tokens=8, ignore_eos=True)
    ref_counts = (model.last_stats.neurons_computed, model.last_stats.neurons_total)
    decoder, _ = decode_step.from_model(loaded.model, kernels="torch")
    calls = []
    real_step = decoder.step
    decoder.step = lambda *a: calls.append(a[2]) or real_step(*a)
    loaded.model.static_step = decoder
    model = hotcold.Model(loaded)  # a new engine: no prefix cached from the first run
    assert model.generate("the quick brown fox", max_tokens=8, ignore_eos=True) == ref
    assert len(calls) >= 7 and calls == list(range(calls[0], calls[0] + len(calls)))  # every decode token
    assert (model.last_stats.neurons_computed, model.last_stats.neurons_total) == ref_counts


def test_static_step_is_deterministic_over_caches(tiny_sparse_gguf):
    """Two sequences' caches through one decoder: each step depends only on its own cache (what a graph
    per cache replays)."""
    loaded = load_model(tiny_sparse_gguf, device="cpu")
    decoder, _ = decode_step.from_model(loaded.model, kernels="torch")
    a, b = Engine(loaded.model, loaded.tokenizer, 64), Engine(loaded.model, loaded.tokenizer, 64)
    a.prefill(PROMPT)
    b.prefill(PROMPT[:5])
    x = embed_row(loaded.model, 7)
    first, _ = decoder.step(a.seq.kv, x, len(PROMPT))
    decoder.step(b.seq.kv, x, 5)  # another cache in between
    a.seq.kv.k[0][len(PROMPT)].zero_()  # the step rewrites its own position
    again, _ = decoder.step(a.seq.kv, x, len(PROMPT))
    assert torch.equal(first, again)


def test_models_without_a_fused_step_say_why(tiny_sparse_gguf):
    from dataclasses import replace

    loaded = load_model(tiny_sparse_gguf, device="cpu")
    loaded.model.layers[1] = replace(loaded.model.layers[1], device=torch.device("meta"))
    decoder, why = decode_step.from_model(loaded.model)
    assert decoder is None and why == "layer 1's attention is on meta, the head on cpu"


def test_the_ffn_answers_whether_the_step_takes_it(sparse_with_stats):
    """decode_step asks each FFN (FFN.step_parts) instead of testing its class: an all-hot hybrid layer gives
    its hot rows on its own device only; one with part of its neurons hot is refused, saying which layer."""
    from dataclasses import replace

    from hotcold.sparse.hybrid import HybridFFN

    loaded = load_model(sparse_with_stats, device="cpu", fast_device="cpu", vram_budget=64)
    ffn = loaded.model.layers[0].ffn
    assert ffn.step_parts(torch.device("cpu")) == (ffn.hot_weights, ffn.predictor, ffn.norm)
    assert ffn.step_parts(torch.device("meta")) is None
    half = HybridFFN(ffn.weights, ffn.predictor, torch.arange(ffn.n_ff // 2), "cpu", layer=0, norm=ffn.norm,
                     threads=1, one_token=False)  # fmt: skip
    loaded.model.layers[0] = replace(loaded.model.layers[0], ffn=half)
    decoder, why = decode_step.from_model(loaded.model, kernels="torch")
    assert decoder is None and why == "layer 0: the FFN (HybridFFN) is not all on cpu"


@pytest.fixture(scope="module")
def tiny_gguf_q(tmp_path_factory):
    from tests.fixtures import tiny_gguf

    return tiny_gguf(tmp_path_factory.mktemp("q") / "q.powerinfer.gguf", sparse=True)


def test_torch_step_never_syncs_on_meta():
    decoder = meta_decoder("torch", n_layer=2)
    with LaunchCounter("meta") as count:
        decoder.run(*meta_caches(n_layer=2))
    assert count.syncs == 0, count.sync_ops


def meta_decoder(kernels: str, *, n_layer: int, D=4096, F=11008, H=32, Hkv=32, R=1024, V=32000):
    """A 7B-shaped decoder of n_layer layers on the meta device (shapes only)."""
    meta = dict(device="meta")
    Dh = D // H

    def layer(sparse: bool):
        return decode_step.StepLayer(
            attn_norm=torch.empty(D, **meta),
            wqkv=torch.empty((H + 2 * Hkv) * Dh, D, dtype=torch.float16, **meta),
            wo=torch.empty(D, H * Dh, dtype=torch.float16, **meta),
            ffn_norm=torch.empty(D, **meta),
            up=torch.empty(F, D, dtype=torch.float16, **meta),
            gate=torch.empty(F, D, dtype=torch.float16, **meta),
            down_t=torch.empty(F, D, dtype=torch.float16, **meta),
            down=None,
            fc1=torch.empty(R, D, dtype=torch.float16, **meta) if sparse else None,
            fc2=torch.empty(F, R, dtype=torch.float16, **meta) if sparse else None,
        )

    shape = decode_step.StepShape(H, Hkv, Dh, 1e-5, "gated", "relu")
    cos = torch.empty(2048, Dh // 2, **meta)
    return decode_step.StaticDecoder(
        [layer(True) for _ in range(n_layer)],
        shape,
        torch.empty(D, **meta),
        torch.empty(V, D, dtype=torch.float16, **meta),
        cos,
        cos,
        kernels=kernels,
        capture=False,
    )


def meta_caches(*, n_layer: int, n_ctx=2048, Hkv=32, Dh=128):
    ks = [torch.empty(n_ctx, Hkv, Dh, dtype=torch.float16, device="meta") for _ in range(n_layer)]
    vs = [torch.empty(n_ctx, Hkv, Dh, dtype=torch.float16, device="meta") for _ in range(n_layer)]
    return ks, vs


# ---------------------------------------------------------------- the fused kernels, interpreted


def fused_attention_error(path) -> float:
    """models.base.fused_decode_attention (what a GPU layer's decode token takes, here under the
    interpreter) against the op-by-op path on a copy of the same cache, over a few positions: the worst
    error relative to the output's scale."""
    from hotcold.models.base import fused_decode_attention, rope_attention_segments
    from hotcold.runtime.state import Batch

    model = load_model(path, device="cpu").model
    c, layer = model.config, model.layers[0]
    layer.qkv.fused = torch.cat(layer.qkv.weights)  # what the group holds on a GPU
    heads = (c.n_head, c.n_head_kv, c.head_dim)
    a, b = model.new_sequence(32), model.new_sequence(32)
    gen = torch.Generator().manual_seed(2)
    worst = 0.0
    for pos in range(5):
        x = torch.randn(1, c.n_embd, generator=gen)
        got = fused_decode_attention(
            Batch.single(a, pos, 1), 0, layer.qkv, layer.attn_norm, x, model.rope, torch.device("cpu"),
            heads=heads, neox=False,
        )  # fmt: skip
        q, k, v = layer.qkv(x, layer.attn_norm)
        ref = rope_attention_segments(
            Batch.single(b, pos, 1), 0, q.view(1, c.n_head, c.head_dim), k.view(1, c.n_head_kv, c.head_dim),
            v.view(1, c.n_head_kv, c.head_dim), model.rope, torch.device("cpu"), neox=False,
        )  # fmt: skip
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    # a launch that raises (a GPU or Triton that cannot compile the kernels) turns the fused path off
    from hotcold.kernels import triton_decode as td

    real = td.qkv_rope

    def broken(*args, **kwargs):
        raise RuntimeError("PTX JIT compilation failed")

    td.qkv_rope = broken
    try:
        got = fused_decode_attention(
            Batch.single(a, 5, 1), 0, layer.qkv, layer.attn_norm, x, model.rope, torch.device("cpu"),
            heads=heads, neox=False,
        )  # fmt: skip
        fallback = dict(returned_none=got is None, switched_off=not td.FusedPaths.enabled,
                        why=td.FusedPaths.failure)  # fmt: skip
    finally:
        td.qkv_rope, td.FusedPaths.enabled, td.FusedPaths.failure = real, True, None
    return dict(err=worst, **fallback)


def fused_kernel_errors() -> dict[str, float]:
    """Each fused kernel against torch in float64 on tiny shapes (several row and column blocks), as
    max |error| / max |reference|. Runs where kernels.triton_decode can run (interpreter or GPU)."""
    import torch.nn.functional as F

    from hotcold.kernels import triton_decode as td
    from hotcold.kernels.decode_glue import apply_rope
    from hotcold.ops import rope_tables

    gen = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(dev)

    def err(got, ref):
        return ((got.double().cpu() - ref.cpu()).abs().max() / ref.abs().max().cpu()).item()

    out: dict[str, float] = {}
    D, R, eps = 96, 40, 1e-5
    w, x, nw = rnd(R, D, dtype=torch.float16), rnd(D), rnd(D).abs() + 0.5
    h = (x.double() * torch.rsqrt(x.double().pow(2).mean() + eps) * nw.double()).float()
    y = torch.empty(R, device=dev)
    out["gemv_norm"] = err(td.gemv(w, x, out=y, norm=nw, eps=eps), w.double() @ h.double())
    res = rnd(R)
    out["gemv_residual"] = err(td.gemv(w, x, out=y, residual=res), w.double() @ x.double() + res.double())
    normed = torch.empty(D, device=dev)
    td.gemv(w, x, out=y, relu=True, norm=nw, eps=eps, normed_out=normed)
    out["gemv_relu"] = err(y, torch.relu(w.double() @ x.double()))
    out["normed_out"] = err(normed, h.double())
    mask, count = torch.zeros(R, dtype=torch.int8, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    td.gemv(w, x, out=y, threshold=0.5, mask_out=mask, count=count)
    fire = (w.double() @ x.double()) >= 0.5
    out["threshold_wrong"] = float(
        (mask.bool().cpu() != fire.cpu()).sum() + abs(int(count) - int(fire.sum()))
    )

    H, Hkv, Dh, S = 4, 2, 16, 40
    qd, kvd = H * Dh, Hkv * Dh
    wqkv = rnd(qd + 2 * kvd, D, dtype=torch.float16)
    cos, sin = (t.float().contiguous().to(dev) for t in rope_tables(S, Dh, 10000.0, 1.0))
    kc, vc = torch.zeros(S, Hkv, Dh, device=dev), torch.zeros(S, Hkv, Dh, device=dev)
    q = torch.empty(qd, device=dev)
    td.qkv_rope(wqkv, x, nw, eps, torch.tensor([7], device=dev), cos, sin, q, kc, vc, n_q=qd, n_kv=kvd)
    ref = (wqkv.double() @ h.double()).float().cpu()
    c, s = cos[7:8].cpu(), sin[7:8].cpu()
    out["rope_q"] = err(q, apply_rope(ref[:qd].view(1, H, Dh), c, s, neox=False).flatten().double())
    out["rope_k"] = err(kc[7], apply_rope(ref[qd : qd + kvd].view(1, Hkv, Dh), c, s, neox=False)[0].double())
    out["v"] = err(vc[7].flatten(), ref[qd + kvd :].double())
    out["other_rows_untouched"] = float(kc[6].abs().max() + vc[8].abs().max())

    kc, vc = rnd(S, Hkv, Dh, dtype=torch.float16), rnd(S, Hkv, Dh, dtype=torch.float16)
    q, att = rnd(qd), torch.empty(qd, device=dev)
    for pos, window in ((0, 0), (33, 0), (33, 5)):
        td.attention(q, kc, vc, torch.tensor([pos], device=dev), att, n_head=H, head_dim=Dh, window=window)
        lo = max(0, pos - window + 1) if window else 0
        keys, values = kc[lo : pos + 1].double().cpu(), vc[lo : pos + 1].double().cpu()
        heads = []
        for hh in range(H):
            g = hh // (H // Hkv)
            scores = keys[:, g] @ q.double().cpu()[hh * Dh : (hh + 1) * Dh] * Dh**-0.5
            heads.append(torch.softmax(scores, 0) @ values[:, g])
        out[f"attention_{pos}_{window}"] = err(att, torch.cat(heads))

    n_ff = 50
    gate, up, hv = rnd(n_ff, D, dtype=torch.float16), rnd(n_ff, D, dtype=torch.float16), rnd(D)
    m = (torch.rand(n_ff, generator=gen) < 0.3).to(torch.int8).to(dev)
    a = torch.empty(n_ff, device=dev)
    g64, u64 = gate.double() @ hv.double(), up.double() @ hv.double()
    for kind in ("gated", "gated_both"):
        for act in ("relu", "silu"):
            fn = torch.relu if act == "relu" else F.silu
            ref = torch.where(m.bool(), fn(g64) * (fn(u64) if kind == "gated_both" else u64), 0.0)
            out[f"gate_up_{kind}_{act}"] = err(td.gate_up(gate, up, hv, m, a, kind=kind, activation=act), ref)
    hn = (hv.double() * torch.rsqrt(hv.double().pow(2).mean() + eps) * nw.double()).float()
    ref = F.silu(gate.double() @ hn.double()) * (up.double() @ hn.double())
    got = td.gate_up(gate, up, hv, None, a, kind="gated", activation="silu", norm=nw, eps=eps)
    out["gate_up_dense_norm"] = err(got, ref)

    down_t = rnd(n_ff, 72, dtype=torch.float16)
    coef = torch.relu(rnd(n_ff)) * (rnd(n_ff) > 0)
    res = rnd(72)
    splits, _ = td.axpy_splits(n_ff, 72, down_t.device)
    part, o = torch.empty(splits, 72, device=dev), torch.empty(72, device=dev)
    td.down_axpy(down_t, coef, res, part, o)
    out["down_axpy"] = err(o, res.double() + coef.double() @ down_t.double())
    out["axpy_splits"] = float(splits)

    out.update(compacted_list_errors(rnd, gen, dev))

    # ggml blocks as the file stores them (Q8_0 gate, Q4_0 up; Q4_0 and Q8_0 down_t): the same sums over
    # the dequantized values
    from gguf import GGMLQuantizationType as Q

    from hotcold.gguf import quants

    def blocks(values: torch.Tensor, qtype) -> tuple[torch.Tensor, torch.Tensor]:
        raw = quants.quantize(values.float().cpu(), qtype)
        return torch.from_numpy(raw).to(dev), quants.dequantize(raw, qtype, tuple(values.shape)).double()

    gq, g64 = blocks(rnd(n_ff, D), Q.Q8_0)
    uq, u64 = blocks(rnd(n_ff, D), Q.Q4_0)
    gate_q = g64 @ hv.double().cpu()
    up_q = u64 @ hv.double().cpu()
    ref = torch.where(m.bool().cpu(), torch.relu(gate_q) * up_q, 0.0)
    got = td.gate_up(gq, uq, hv, m, a, kind="gated", activation="relu", qtypes=("q8_0", "q4_0"))
    out["gate_up_q8_0_q4_0"] = err(got, ref)
    # rows of a hybrid layer's hot copy: row k is neuron idx[k] of the whole layer's mask
    idx = torch.randperm(3 * n_ff, generator=gen)[:n_ff].to(dev)
    wide = (torch.rand(3 * n_ff, generator=gen) < 0.3).to(torch.int8).to(dev)
    ref = torch.where(
        wide.cpu()[idx.cpu()].bool(), torch.relu(g64 @ hv.double().cpu()) * (u64 @ hv.double().cpu()), 0.0
    )
    got = td.gate_up(
        gq, uq, hv, wide, a, kind="gated", activation="relu", qtypes=("q8_0", "q4_0"), mask_rows=idx
    )
    out["gate_up_mask_rows"] = err(got, ref)
    for qtype in (Q.Q4_0, Q.Q8_0):
        dq, d64 = blocks(rnd(n_ff, 96), qtype)
        splits, _ = td.axpy_splits(n_ff, 96, dq.device)
        part, o, res96 = torch.empty(splits, 96, device=dev), torch.empty(96, device=dev), rnd(96)
        td.down_axpy(dq, coef, res96, part, o, qtype=qtype.name.lower())
        out[f"down_axpy_{qtype.name.lower()}"] = err(o, res96.double().cpu() + coef.double().cpu() @ d64)
    return out


def compacted_list_errors(rnd, gen, dev) -> dict[str, float]:
    """The compacted firing list (kernels/triton_ffn.py) at 0%, ~10% and 100% firing over a width that
    is not a whole number of 16-row blocks: the threshold kernel's block counts, the list's rows (ascending,
    against torch.nonzero), its activations (the dense-row gate_up's bits at those rows), down_axpy over the
    list against float64 and the same bits on a second run. `*_wrong` entries count mistakes."""
    from hotcold.kernels import triton_decode as td

    out: dict[str, float] = {}
    F, D, R, DO = 150, 64, 24, 72
    fc2, r = rnd(F, R, dtype=torch.float16), rnd(R)
    gate, up, h = rnd(F, D, dtype=torch.float16), rnd(F, D, dtype=torch.float16), rnd(D)
    down_t, res = rnd(F, DO, dtype=torch.float16), rnd(DO)
    logits = fc2.double().cpu() @ r.double().cpu()
    splits, _ = td.axpy_splits(F, DO, down_t.device)
    wrong = {"block_counts": 0, "rows": 0, "a_bits": 0, "a_tail": 0, "count": 0, "rerun_bits": 0}
    worst = 0.0
    for q in (1.01, 0.9, -0.01):  # the threshold at these quantiles of the logits: none, ~10%, all fire
        thr = float(torch.quantile(logits, min(max(q, 0.0), 1.0))) + (
            1.0 if q > 1 else -1.0 if q < 0 else 0.0
        )
        mask = torch.zeros(F, dtype=torch.int8, device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev)
        lst = td.Compact.empty(F, dev)
        lst.rows.fill_(-1)
        td.gemv(fc2, r, out=torch.empty(F, device=dev), threshold=thr, mask_out=mask, count=count,
                block_counts=lst.block_counts)  # fmt: skip
        fire = mask.bool().cpu()
        n = int(fire.sum())
        blocks = torch.nn.functional.pad(fire.int(), (0, -F % 16)).view(-1, 16).sum(1)
        wrong["block_counts"] += int((lst.block_counts.cpu() != blocks).sum())
        wrong["count"] += abs(int(count) - n)
        a_rows, a_list = torch.empty(F, device=dev), torch.full((F,), 7.0, device=dev)
        td.gate_up(gate, up, h, mask, a_rows, kind="gated", activation="silu")
        td.gate_up(gate, up, h, mask, a_list, kind="gated", activation="silu", compact=lst)
        rows = fire.nonzero()[:, 0]
        wrong["rows"] += int((lst.rows.cpu()[:n].long() != rows).sum())
        wrong["a_bits"] += int((a_list.cpu()[:n] != a_rows.cpu()[rows]).sum())
        wrong["a_tail"] += int((a_list.cpu()[n:] != 0).sum())
        got = []
        for _ in range(2):
            part, o = torch.full((splits, DO), float("nan"), device=dev), torch.empty(DO, device=dev)
            got.append(td.down_axpy(down_t, a_list, res, part, o, compact=lst).cpu())
        ref = res.double().cpu() + a_rows.double().cpu() @ down_t.double().cpu()
        worst = max(worst, ((got[0].double() - ref).abs().max() / ref.abs().max()).item())
        wrong["rerun_bits"] += int((got[0] != got[1]).sum())
    out["down_axpy_compacted"] = worst
    return out | {f"compacted_{k}_wrong": float(v) for k, v in wrong.items()}


INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from hotcold.runtime import decode_step
    from hotcold.runtime.engine import Engine
    from hotcold.kernels.launches import LaunchCounter
    from hotcold.loader import load_model
    from tests.runtime.test_decode_step import PROMPT, embed_row, fused_kernel_errors, meta_caches, meta_decoder

    from tests.runtime.test_decode_step import fused_attention_error

    out = {{"kernels": fused_kernel_errors(), "fused_attention": fused_attention_error({sparse!r})}}
    for name, path, args in (("sparse", {sparse!r}, {{}}), ("dense", {dense!r}, {{}}), ("blocks", {blocks!r}, {{}})):
        loaded = load_model(path, device="cpu", **args)
        fused, why = decode_step.from_model(loaded.model, kernels="triton")
        plain, _ = decode_step.from_model(loaded.model, kernels="torch")
        assert fused is not None, why
        a, b = Engine(loaded.model, loaded.tokenizer, 64), Engine(loaded.model, loaded.tokenizer, 64)
        logits = a.prefill(PROMPT)
        b.prefill(PROMPT)
        worst, same, counts = 0.0, True, True
        for i in range(3):
            token = int(logits.argmax())
            x = embed_row(loaded.model, token)
            got, c1 = fused.step(a.seq.kv, x, len(PROMPT) + i)
            logits, c2 = plain.step(b.seq.kv, x, len(PROMPT) + i)
            worst = max(worst, ((got - logits).abs().max() / logits.abs().max()).item())
            same &= int(got.argmax()) == int(logits.argmax())
            counts &= c1 == c2
        out[name] = dict(worst=worst, same_tokens=same, same_counts=counts)
    for n_layer in (1, 2):
        decoder = meta_decoder("triton", n_layer=n_layer)
        with LaunchCounter("meta") as count:
            decoder.run(*meta_caches(n_layer=n_layer))
        out[f"launches_{{n_layer}}"] = count.launches
        out[f"syncs_{{n_layer}}"] = count.syncs
        out["ops"] = dict(count.by_op)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted(tiny_sparse_gguf, tiny_dense_gguf, tiny_gguf_q):
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = INTERPRETED.format(
        root=root, sparse=str(tiny_sparse_gguf), dense=str(tiny_dense_gguf), blocks=str(tiny_gguf_q)
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"interpreter subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_kernels_match_float64(interpreted):
    check_kernel_errors(interpreted["kernels"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernels_match_float64_on_gpu():
    errors = fused_kernel_errors()
    errors["axpy_splits"] = max(errors["axpy_splits"], 2.0)  # D = 72 is one column block on a GPU
    check_kernel_errors(errors)


def check_kernel_errors(errors: dict[str, float]) -> None:
    assert errors.pop("threshold_wrong") == 0 and errors.pop("other_rows_untouched") == 0
    wrong = {k: errors.pop(k) for k in [k for k in errors if k.endswith("_wrong")]}
    assert len(wrong) == 6 and not any(wrong.values()), wrong
    assert errors.pop("axpy_splits") > 1  # the split sums are exercised
    rope_k, v = errors.pop("rope_k"), errors.pop("v")  # stored in the cache's dtype (float32 here)
    assert rope_k < 1e-5 and v < 1e-5
    assert all(e < 1e-5 for e in errors.values()), errors


@pytest.mark.parametrize("name", ["sparse", "dense", "blocks"])
def test_fused_kernels_equal_torch_step(interpreted, name):
    """blocks: a file with Q8_0 / Q4_0 / F16 / F32 tensors (hotcold.gguf.quants' blocks); the fused kernels read
    its Q8_0 FFN rows as stored, the torch step dequantized ones. (The eager CPU engine is no reference
    there: its block kernels quantize the activations to 8 bits, as llama.cpp does.)"""
    got = interpreted[name]
    assert got["worst"] < 1e-5 and got["same_tokens"] and got["same_counts"], got


def test_fused_decode_attention_equals_the_op_by_op_path(interpreted):
    """A GPU layer's decode attention in two fused launches gives the op-by-op path's output; a launch that
    raises hands the token back to that path and switches the fused paths off, saying why."""
    got = interpreted["fused_attention"]
    assert got["err"] < 1e-5, got
    assert got["returned_none"] and got["switched_off"] and "PTX" in got["why"], got


def test_fused_step_launches_and_syncs(interpreted):
    """At most 8 kernel launches a layer, none of them a host sync (the issue's bar); the per-token rest
    (zeroing the counts, the head) is the difference between 2 layers and 1."""
    per_layer = interpreted["launches_2"] - interpreted["launches_1"]
    assert per_layer == 8, interpreted["ops"]  # the compacted firing list costs no launch of its own
    assert interpreted["launches_1"] - per_layer <= 3, interpreted["ops"]
    assert interpreted["syncs_1"] == interpreted["syncs_2"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_step_equals_eager_step_on_gpu(sparse_with_stats):
    """On a GPU: the CUDA graph's replays give the eager step's bits, token after token."""
    loaded = load_model(sparse_with_stats, device="cuda", vram_budget=64)
    eager, _ = decode_step.from_model(loaded.model, capture=False)
    graphed, why = decode_step.from_model(loaded.model, capture=True)
    assert graphed is not None, why
    a, b = Engine(loaded.model, loaded.tokenizer, 64), Engine(loaded.model, loaded.tokenizer, 64)
    logits = a.prefill(PROMPT)
    b.prefill(PROMPT)
    for i in range(4):
        x = embed_row(loaded.model, int(logits.argmax()))
        logits, counts = graphed.step(a.seq.kv, x, len(PROMPT) + i)
        ref, ref_counts = eager.step(b.seq.kv, x, len(PROMPT) + i)
        assert torch.equal(logits, ref) and counts == ref_counts


def test_fused_kernels_compile_for_sm90(tmp_path):
    """The interpreter checks the arithmetic; only a compile shows what the GPU would run. Every variant the
    7B step launches compiles for sm_90 (Triton's compiler and ptxas, no GPU needed), F16 rows are read in
    16-byte loads, the FFN kernels' loops are software-pipelined (cp.async: loads issued stages ahead of the
    sums), and nothing spills registers."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "offline.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "triton_offline.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.exists(), proc.stderr[-3000:]
    kernels = json.loads(out.read_text())["kernels"]
    assert all(k["compiles"] for k in kernels.values()), {n: k.get("error") for n, k in kernels.items()}
    for name, k in kernels.items():
        if "q8_0" not in name and "q4_0" not in name and name != "reduce_residual":
            # plain 16-byte loads, or 16-byte cp.async where the loop is software-pipelined
            assert k["loads"].get("16B", 0) + k["loads"].get("cp.async 16B", 0) > 0, (name, k["loads"])
        if "q8_0" not in name and "q4_0" not in name and name not in ("attention", "reduce_residual"):
            # every F16 row kernel's loop is tl.range(num_stages=): its weight tiles issued ahead as cp.async
            assert k["loads"].get("cp.async 16B", 0) > 0, (name, k["loads"])
        assert k["spill_bytes"] in (0, None), (name, k)
    assert {"down_axpy f16 (compacted list)", "gate_up f16 sparse (compacted list)"} <= set(kernels)
    # ggml blocks: only their 4-byte-or-wider loads can go ahead (cp.async moves 4, 8 or 16 bytes)
    assert any(w.startswith("cp.async") for w in kernels["down_axpy q4_0 (compacted list)"]["loads"])


def test_engine_falls_back_when_the_first_step_fails(tiny_sparse_gguf):
    """A fused kernel that cannot compile on this GPU must not end the generation: the first step's error
    sends the model back to the eager step, and says why."""
    import hotcold

    loaded = load_model(tiny_sparse_gguf, device="cpu")
    ref = hotcold.Model(loaded).generate("the quick brown fox", max_tokens=5, ignore_eos=True)
    decoder, _ = decode_step.from_model(loaded.model, kernels="torch")

    def broken(*args):
        raise RuntimeError("PTX JIT compilation failed")

    decoder.run = broken
    loaded.model.static_step = decoder
    assert hotcold.Model(loaded).generate("the quick brown fox", max_tokens=5, ignore_eos=True) == ref
    assert loaded.model.static_step is None and "PTX JIT" in decoder.failure


def test_from_model_ignores_a_missing_device_index(tiny_sparse_gguf):
    """On a GPU the plan says "cuda" and the tensors say "cuda:0" (torch.device("cuda") != "cuda:0"): the
    CPU analogue, a plan device with an explicit index, must still take the step."""
    from dataclasses import replace

    model = load_model(tiny_sparse_gguf, device="cpu").model
    model.layers = [replace(layer, device=torch.device("cpu", 0)) for layer in model.layers]
    decoder, why = decode_step.from_model(model, kernels="torch")
    assert decoder is not None, why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_step_on_gpu_launches_8_a_layer_and_never_syncs(sparse_with_stats):
    loaded = load_model(sparse_with_stats, device="cuda", vram_budget=64)
    decoder, why = decode_step.from_model(loaded.model, kernels="triton", capture=False)
    assert decoder is not None, why
    engine = Engine(loaded.model, loaded.tokenizer, 64)
    engine.prefill(PROMPT)
    decoder.step(engine.seq.kv, embed_row(loaded.model, 5), len(PROMPT))  # compile first
    with LaunchCounter("cuda") as count:
        decoder.run(engine.seq.kv.k, engine.seq.kv.v)
    n_layer = len(loaded.model.layers)
    assert count.syncs == 0, count.sync_ops
    assert count.launches <= 8 * n_layer + 2, dict(count.by_op)
