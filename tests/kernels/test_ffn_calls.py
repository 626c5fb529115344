"""The FFN steps as single C calls (kernels/ffn_calls.py) against `cpu`'s ops one by one: the sparse step,
the dense decode tail and the activation."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu, ffn_calls
from tests.kernels.test_cpu import D_QUANT


def ffn_steps(up, gate, down_t, kind, bias, x, mask):
    """The sparse FFN step op by op (as SparseFFN's unfused path computes it)."""
    live, g = mask, None
    if gate is not None:
        g = torch.relu(cpu.gather_matvec(gate, x, mask))
        live = mask & (g != 0)
    v = cpu.gather_matvec(up, x, live)
    v = v + bias if bias is not None else v
    a = {"gated": lambda: g * v, "gated_both": lambda: g * torch.relu(v), "plain": lambda: torch.relu(v)}[
        kind
    ]()
    return cpu.sparse_axpy(down_t, torch.where(live, a, torch.zeros(())), live)


@pytest.mark.parametrize("kind", ["gated", "gated_both", "plain"])
@pytest.mark.parametrize("t", [1, 3])
def test_sparse_ffn_plan_equals_op_by_op(backend, kind, t):
    """Never None: one C call, or the same steps in torch; bit-identical to the ops called one by one."""
    gen = torch.Generator().manual_seed(15)
    f, d, r = 300, D_QUANT, 32
    up = QuantTensor.from_float(torch.randn(f, d, generator=gen), Q.Q8_0)
    gate = None if kind == "plain" else torch.randn(f, d, generator=gen).half()
    down_t = torch.randn(f, d, generator=gen).bfloat16()
    bias = torch.randn(f, generator=gen) if kind == "plain" else None
    fc1 = torch.randn(r, d, generator=gen).half()
    fc2 = QuantTensor.from_float(torch.randn(f, r, generator=gen), Q.Q8_0)
    x, p = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    norm = (torch.rand(d, generator=gen) + 0.5, 1e-5)
    plan = ffn_calls.SparseFFNPlan(up, gate, down_t, kind=kind, up_bias=bias, fc1=fc1, fc2=fc2, threshold=0.5)
    out, mask, fired = plan(x, p, norm=norm, threads=2)
    want_mask = cpu.gather_matvec(fc2, torch.relu(cpu.gather_matvec(fc1, p, None)), None) >= 0.5
    assert torch.equal(mask, want_mask) and fired == int(want_mask.sum()) and 0 < fired < t * f
    assert torch.equal(out, ffn_steps(up, gate, down_t, kind, bias, cpu.rms_norm(x, *norm), mask))
    given = torch.rand(t, f, generator=gen) < 0.3
    no_pred = ffn_calls.SparseFFNPlan(up, gate, down_t, kind=kind, up_bias=bias)
    out2, mask2, fired2 = no_pred(x, rows=given)
    assert torch.equal(mask2, given) and fired2 == int(given.sum())
    assert torch.equal(out2, ffn_steps(up, gate, down_t, kind, bias, x, given))


@pytest.mark.parametrize("t", [1, 3])
def test_sparse_ffn_plan_with_packed_predictor(backend, t):
    """Q4_0 predictors (the original's quantize writes them) are packed at load; the plan then runs them
    through the packed GEMV, so its mask is the one `matmul` (what Predictor calls) gives, bit for bit."""
    gen = torch.Generator().manual_seed(16)
    f, d, r = 300, D_QUANT, 64
    up, gate, down_t = (torch.randn(f, d, generator=gen).half() for _ in range(3))
    fc1 = cpu.pack(QuantTensor.from_float(torch.randn(r, d, generator=gen), Q.Q4_0))
    fc2 = cpu.pack(QuantTensor.from_float(torch.randn(f, r, generator=gen), Q.Q4_0))
    assert (fc1.packed is not None) == (backend == "c")
    x = torch.randn(t, d, generator=gen)
    logits = cpu.matmul(fc2, torch.relu(cpu.matmul(fc1, x)))
    threshold = 0.5
    if backend == "c":  # a threshold the packed logits reach and the row kernel's do not: only the packed
        # GEMV gives the mask asserted below (the row kernel sums in another order, a few ulps apart)
        rows = cpu.gather_matvec(fc2, torch.relu(cpu.gather_matvec(fc1, x, None)), None)
        above = ((logits > rows) & (logits > 0)).nonzero()
        assert len(above), "the two kernels' logits should differ somewhere"
        threshold = float(logits[tuple(above[len(above) // 2])])
    plan = ffn_calls.SparseFFNPlan(up, gate, down_t, fc1=fc1, fc2=fc2, threshold=threshold)
    out, mask, fired = plan(x, x, threads=2)
    want_mask = logits >= threshold
    assert torch.equal(mask, want_mask) and 0 < fired < t * f
    assert torch.equal(out, ffn_steps(up, gate, down_t, "gated", None, x, mask))


def test_sparse_ffn_plan_rejects_what_it_cannot_take(backend):
    w = torch.randn(64, 32).half()
    with pytest.raises(ValueError, match="needs a gate"):
        ffn_calls.SparseFFNPlan(w, None, w, kind="gated")
    with pytest.raises(ValueError, match="down_t has shape"):
        ffn_calls.SparseFFNPlan(w, w, torch.randn(64, 64).half())
    with pytest.raises(ValueError, match="both fc1 and fc2"):
        ffn_calls.SparseFFNPlan(w, w, w, fc1=torch.randn(8, 32).half())
    with pytest.raises(ValueError, match="CPU kernels need CPU weights|2-D"):
        ffn_calls.SparseFFNPlan(w, w, torch.randn(64, 32).double())


def test_ffn_combine_swiglu_oai(backend):
    """gpt-oss's clamped SwiGLU in C (the one-call MoE tail's and, on the CPU, the eager experts'): within float32
    rounding of float64 over values past the clamp on both sides, with the gate and up biases; NaN kept; a gate
    bias only for that kind."""
    from hotcold.sparse.ffn_weights import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    gen = torch.Generator().manual_seed(31)
    u, g = torch.randn(3, 515, generator=gen) * 9, torch.randn(3, 515, generator=gen) * 9
    ub, gb = torch.randn(515, generator=gen), torch.randn(515, generator=gen)
    g[0, 0] = float("nan")
    got = ffn_calls.ffn_combine("swiglu_oai", "silu", u, g, ub, gb)
    if backend == "torch":
        assert got is None
        return
    gg = (g.double() + gb.double()).clamp(max=SWIGLU_OAI_LIMIT)
    uu = (u.double() + ub.double()).clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    ref = gg / (1 + torch.exp(-SWIGLU_OAI_ALPHA * gg)) * (uu + 1)
    # float32's own rounding of gate + bias (amplified by exp(-alpha g)) and up + bias + 1 (cancellation near up =
    # -1) bounds the error
    scale = (
        (gg / (1 + torch.exp(-SWIGLU_OAI_ALPHA * gg))).abs()
        * (uu.abs() + 1)
        * (1 + SWIGLU_OAI_ALPHA * gg.abs())
    )
    ok = torch.isfinite(ref)
    assert ((got.double() - ref).abs() <= 4e-7 * scale + 1e-30)[ok].all() and got[0, 0].isnan()
    assert ffn_calls.ffn_combine("gated", "silu", u, g, ub, gb) is None  # a gate bias: swiglu_oai's only


def test_ffn_combine_silu_and_relu(backend):
    """The C activations: relu with torch's bits, silu within 2 ulp of float64 (torch's own is as far), the
    same bits for every token count and thread count (a row's activation never depends on its batch), NaN
    kept, overflow as torch's x / (1 + exp(-x)) gives it (-0 where exp(-x) is inf)."""
    gen = torch.Generator().manual_seed(30)
    u, g = torch.randn(5, 777, generator=gen) * 6, torch.randn(5, 777, generator=gen) * 6
    g[0, :5] = torch.tensor([float("nan"), float("inf"), -100.0, 100.0, 0.0])
    bias = torch.randn(777, generator=gen)
    got = ffn_calls.ffn_combine("gated", "silu", u, g, None)
    if backend == "torch":
        assert got is None  # the callers use torch's ops
        return
    ref = torch.nn.functional.silu(g.double()) * u.double()
    ok = torch.isfinite(ref) & (ref.abs() > 1e-30)
    ulps = (got.view(torch.int32).long() - ref.float().view(torch.int32).long()).abs()[ok]
    assert ulps.max() <= 3  # silu's 2 ulp and the product's rounding
    assert got[0, 0].isnan() and got[0, 1].isnan() == (u[0, 1] == 0) and got[0, 2] == 0 and got[0, 4] == 0
    rows = torch.cat(
        [ffn_calls.ffn_combine("gated", "silu", u[i : i + 1], g[i : i + 1], None) for i in range(5)]
    )
    bits = lambda z: z.view(torch.int32)  # noqa: E731  (NaN included)
    assert torch.equal(bits(rows), bits(got))
    big_u, big_g = u.repeat(40, 1), g.repeat(40, 1)  # 200 x 777: past the one-thread size
    torch.set_num_threads(2)
    assert torch.equal(bits(ffn_calls.ffn_combine("gated", "silu", big_u, big_g, None)[:5]), bits(got))
    relu = {
        "gated": torch.relu(g) * (u + bias),
        "gated_both": torch.relu(g) * torch.relu(u + bias),
        "plain": torch.relu(u + bias),
    }
    for kind, want in relu.items():
        c = ffn_calls.ffn_combine(kind, "relu", u, None if kind == "plain" else g, bias)
        assert torch.equal(bits(c), bits(want)), kind
    silu_both = ffn_calls.ffn_combine("gated_both", "silu", u, g, None)
    assert torch.equal(
        bits(silu_both),
        bits(
            ffn_calls.ffn_combine("plain", "silu", g, None, None)
            * ffn_calls.ffn_combine("plain", "silu", u, None, None)
        ),
    )
    # gelu: the C kernels' erf form, within float rounding of torch's (both paths of a layer use the C one)
    gelu = ffn_calls.ffn_combine("plain", "gelu", u, None, None)
    want = torch.nn.functional.gelu(u.double()).float()
    assert torch.allclose(gelu, want, rtol=1e-6, atol=1e-6)
    gelu_tanh = ffn_calls.ffn_combine("plain", "gelu_tanh", u, None, None)  # Gemma's
    want = torch.nn.functional.gelu(u.double(), approximate="tanh").float()
    assert torch.allclose(gelu_tanh, want, rtol=1e-6, atol=1e-6)
    assert (
        ffn_calls.ffn_combine("gated", "tanh", u, g, None) is None
        and ffn_calls.ffn_combine("gated", "silu", u.double(), g.double(), None) is None
    )


def dense_tail_ops(wo, up, gate, down, down_is_t, kind, act, bias, attn, x, norm):
    """A dense decode layer after attention op by op (as the models and DenseFFN compute it)."""
    y1 = x + cpu.matmul(wo, attn)
    h = cpu.rms_norm(y1, *norm)
    if gate is not None:
        u, g = (
            cpu.MatvecGroup([up, gate])(h)
            if (getattr(up, "packed", None) is None) == (getattr(gate, "packed", None) is None)
            else (cpu.matmul(up, h), cpu.matmul(gate, h))
        )
    else:
        u, g = cpu.matmul(up, h), None
    a = ffn_calls.ffn_combine(kind, act, u, g, bias)
    return y1, y1 + (cpu.sparse_axpy(down, a, None) if down_is_t else cpu.matmul(down, a))


@pytest.mark.parametrize(
    "kind, act",
    [
        ("gated", "silu"),
        ("gated", "relu"),
        ("gated_both", "silu"),
        ("plain", "relu"),
        ("plain", "gelu"),
        ("gated", "gelu_tanh"),
    ],
)
@pytest.mark.parametrize("t", [1, 3])
def test_dense_tail_equals_op_by_op(backend, kind, act, t):
    """hc_dense_tail (o projection, residual, norm, up/gate, activation, down, residual) has the bits of
    the ops one by one, for packed and row-layout weights, down [D, F] and down_t [F, D], any thread count."""
    if backend == "torch":
        assert ffn_calls.DenseTail(*(torch.randn(8, 8).half() for _ in range(4)), down_is_t=False, kind="gated",
                             activation="silu")(torch.randn(1, 8), torch.randn(1, 8), norm=(torch.ones(8), 1e-5)) is None  # fmt: skip
        return
    gen = torch.Generator().manual_seed(31)
    f, d = 320, D_QUANT  # down [D, F] in Q4_0 needs F a multiple of 32
    q4 = lambda r, c: QuantTensor.from_float(torch.randn(r, c, generator=gen) / 4, Q.Q4_0)  # noqa: E731
    wo = cpu.pack(q4(d, d))
    bias = torch.randn(f, generator=gen) if kind == "plain" else None
    layouts = {
        "packed, down": (cpu.pack(q4(f, d)), cpu.pack(q4(f, d)), cpu.pack(q4(d, f)), False),
        "rows, down_t": (torch.randn(f, d, generator=gen).half(), q4(f, d), q4(f, d), True),
        "mixed": (cpu.pack(q4(f, d)), q4(f, d), torch.randn(d, f, generator=gen).bfloat16(), False),
    }
    attn, x = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    norm = (torch.rand(d, generator=gen) + 0.5, 1e-5)
    for name, (up, gate, down, down_is_t) in layouts.items():
        gate = None if kind == "plain" else gate
        tail = ffn_calls.DenseTail(
            wo, up, gate, down, down_is_t=down_is_t, kind=kind, activation=act, up_bias=bias
        )
        want = dense_tail_ops(wo, up, gate, down, down_is_t, kind, act, bias, attn, x, norm)
        for threads in (1, 2):
            y1, y2 = tail(attn, x, norm=norm, threads=threads)
            assert torch.equal(y1, want[0]) and torch.equal(y2, want[1]), (name, threads)
    with pytest.raises(ValueError, match="tanh"):
        ffn_calls.DenseTail(wo, up, gate, down, down_is_t=False, kind=kind, activation="tanh")
    with pytest.raises(ValueError, match="down has shape"):
        ffn_calls.DenseTail(
            wo, q4(f, d), q4(f, d), q4(f, d), down_is_t=False, kind="gated", activation="silu"
        )


def thresholded_ops(score, up, gate, down_t, scale, threshold, h):
    """The thresholded SwiGLU step op by op, as ThresholdedFFN computes it without its plan."""
    silu = lambda v: ffn_calls.ffn_combine("plain", "silu", v, None, None)  # noqa: E731
    act = silu(cpu.matmul(score, h))
    s = act.abs() if scale is None else act.abs() * scale
    mask = s > threshold
    if gate is not None:  # a probe scored: the exact gate of the kept rows
        act = silu(cpu.gather_matvec(gate, h, mask))
    a = torch.where(mask, act * cpu.gather_matvec(up, h, mask), 0.0)
    return cpu.sparse_axpy(down_t, a, mask), mask


@pytest.mark.parametrize("probe", [False, True])
@pytest.mark.parametrize("wina", [False, True])
@pytest.mark.parametrize(
    "t, up_type, thr",
    [
        (1, "q8_0", 0.3),
        (3, "q8_0", 0.3),
        (12, "q8_0", 0.3),
        (12, "f16", 0.3),  # about half kept
        (12, "f16", 10.0),  # about a third kept
    ],
)
def test_thresholded_plan_equals_op_by_op(backend, probe, wina, t, up_type, thr):
    """hc_thresholded_ffn / hc_thresholded_tail (score matvec, kept rows, exact gate with a probe, up, SiLU
    product, axpy; the o projection and residuals around it) have the bits of the ops one by one."""
    gen = torch.Generator().manual_seed(41 + t)
    f, d = 320, D_QUANT
    gate = torch.randn(f, d, generator=gen).half() * 2
    up = torch.randn(f, d, generator=gen)
    up = up.half() if up_type == "f16" else QuantTensor.from_float(up, Q.Q8_0)
    down_t = torch.randn(f, d, generator=gen).bfloat16()
    score = cpu.pack(QuantTensor.from_float(gate.float(), Q.Q4_0)) if probe else gate
    scale = torch.rand(f, generator=gen) + 0.5 if wina else None
    h = torch.randn(t, d, generator=gen)
    plan = ffn_calls.ThresholdedPlan(score, up, gate if probe else None, down_t, threshold=thr, scale=scale)
    wo = cpu.pack(QuantTensor.from_float(torch.randn(d, d, generator=gen) / 4, Q.Q4_0))
    norm = (torch.rand(d, generator=gen) + 0.5, 1e-5)
    if backend == "torch":
        assert plan(h) is None and plan.tail(wo, h, h, norm=norm) is None
        return
    want, want_mask = thresholded_ops(score, up, gate if probe else None, down_t, scale, thr, h)
    assert 0 < int(want_mask.sum()) < t * f  # some kept, some not
    for threads in (1, 2):
        out, mask, kept = plan(h, threads=threads)
        assert torch.equal(mask, want_mask) and kept == int(want_mask.sum())
        assert torch.equal(out, want), threads
    out, mask, _ = plan(h, norm=norm)  # the norm folded in
    want, want_mask = thresholded_ops(
        score, up, gate if probe else None, down_t, scale, thr, cpu.rms_norm(h, *norm)
    )
    assert torch.equal(mask, want_mask) and torch.equal(out, want)
    attn, x = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    y1, y2, mask, kept = plan.tail(wo, attn, x, norm=norm, threads=2)
    assert torch.equal(y1, x + cpu.matmul(wo, attn))
    out, want_mask = thresholded_ops(
        score, up, gate if probe else None, down_t, scale, thr, cpu.rms_norm(y1, *norm)
    )
    assert torch.equal(mask, want_mask) and kept == int(want_mask.sum()) and torch.equal(y2, y1 + out)


def test_thresholded_plan_rejects_what_it_cannot_take():
    w = torch.randn(64, 32).half()
    with pytest.raises(ValueError, match="down_t has shape"):
        ffn_calls.ThresholdedPlan(w, w, None, torch.randn(32, 64).half(), threshold=0.1)
    with pytest.raises(ValueError, match="scale has shape"):
        ffn_calls.ThresholdedPlan(w, w, None, w, threshold=0.1, scale=torch.ones(3))
