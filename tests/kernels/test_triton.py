"""hotcold.kernels.triton against a float64 reference.

The CPU cases run under the Triton interpreter in ONE subprocess started with TRITON_INTERPRET=1:
triton reads that variable when `triton.language` is imported (its own tl.sum, tl.max, ... are
@jit functions decorated then), so it cannot be switched on inside a test process that may have
imported triton already, and setting it here would leak into every later test. This process never
imports triton unless a CUDA device is present (the `gpu` tests).

Rows that must not be read are filled with NaN (float) or NaN block scales (ggml): one stray read
of them shows up as NaN in the output.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

FORMATS = ["f16", "bf16", "f32", "q8_0", "q4_0"]
SHAPES = [(64, 128), (37, 96)]  # (K hot rows, D)
TOKENS = [1, 3, 20]  # 20: the tensor-core (tl.dot) path
BLOCK = {"q8_0": 34, "q4_0": 18}
FLOAT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


# ---------------------------------------------------------------- reference (independent of the kernels)


def dequantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 [K, D] from a float tensor or ggml Q8_0 / Q4_0 blocks, straight from the format."""
    if fmt in FLOAT:
        return w.double()
    b = w.contiguous().numpy().reshape(w.shape[0], -1, BLOCK[fmt])  # [K, n_blocks, block_bytes]
    d = b[..., :2].copy().view(np.float16).astype(np.float64)  # [K, nb, 1]
    if fmt == "q8_0":
        q = b[..., 2:].copy().view(np.int8).astype(np.float64)  # [K, nb, 32]
    else:
        qs = b[..., 2:].astype(np.int64)  # [K, nb, 16]: value j low nibble, value j + 16 high nibble
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64) - 8.0
    return torch.from_numpy((d * q).reshape(w.shape[0], -1))


def random_weights(gen: torch.Generator, k: int, d: int, fmt: str, poison: torch.Tensor) -> torch.Tensor:
    """Random weights; rows in `poison` hold NaN (float) or NaN scales (ggml blocks)."""
    if fmt in FLOAT:
        w = torch.randn(k, d, generator=gen).to(FLOAT[fmt])
        w[poison] = float("nan")
        return w
    nb = d // 32
    w = torch.randint(0, 256, (k, nb, BLOCK[fmt]), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(k, nb, generator=gen) * 0.04 - 0.02).to(torch.float16)
    scale[poison] = float("nan")
    w[..., :2] = scale.view(torch.uint8).view(k, nb, 2)
    return w.view(k, nb * BLOCK[fmt])


def make_case(
    fmt: str, k: int, d: int, t: int, seed: int, *, strided: bool = False, density: float = 0.35
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(t, k, generator=gen) < density  # [T, K]
    if k >= 32:
        mask[:, 16:32] = False  # a whole idle row block: skipped before any weight is read
    dead = ~mask.any(0)
    a = torch.randn(t, k, generator=gen)
    a[torch.rand(t, k, generator=gen) < 0.2] = 0.0  # fired rows with a == 0: not read by hot_axpy
    a[~mask] = float("nan")  # only fired entries of `a` may be read
    no_coef = ~(mask & (a != 0)).any(0)
    x = torch.randn(t, d, generator=gen)
    w = random_weights(gen, k, d, fmt, dead)
    w_t = random_weights(gen, k, d, fmt, no_coef)
    if strided:  # row strides wider than the rows: views into bigger buffers
        x = torch.cat([x, torch.randn(t, 7, generator=gen)], 1)[:, :d]
        mask = torch.cat([mask, torch.ones(t, 5, dtype=torch.bool)], 1)[:, :k]
        a = torch.cat([a, torch.ones(t, 5)], 1)[:, :k]
        w = torch.cat([w, w[:, :8]], 1)[:, : w.shape[1]]
    return dict(w=w, w_t=w_t, x=x, a=a, mask=mask, qtype=None if fmt in FLOAT else fmt, fmt=fmt)


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    mask = case["mask"]
    w = dequantize(case["w"], case["fmt"])
    w[~mask.any(0)] = 0.0  # never-fired rows: NaN in the data, no contribution in the maths
    matvec = (case["x"].double() @ w.T) * mask  # [T, K]
    coef = torch.where(mask, case["a"].double(), 0.0)  # [T, K]
    w_t = dequantize(case["w_t"], case["fmt"])
    w_t[~(coef != 0).any(0)] = 0.0
    return matvec, coef @ w_t  # [T, D]


def assert_matches(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """fp32 accumulation vs float64: the error is bounded by a few ulps of sum |products|."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all(), "a row that must not be read was read (NaN in the output)"
    err = (out.double() - ref).abs()
    bound = 1e-5 * scale + 1e-6
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


def check_case(case: dict, matvec: torch.Tensor, axpy: torch.Tensor) -> None:
    ref_mv, ref_ax = reference(case)
    mask = case["mask"]
    w = dequantize(case["w"], case["fmt"]).nan_to_num(0.0).abs()
    assert_matches(matvec, ref_mv, case["x"].double().abs() @ w.T)
    assert (matvec[~mask] == 0).all(), "outputs of rows the predictor did not fire must be exactly 0"
    coef = torch.where(mask, case["a"].double(), 0.0).abs()
    assert_matches(axpy, ref_ax, coef @ dequantize(case["w_t"], case["fmt"]).nan_to_num(0.0).abs())


def test_reference_reads_the_layout_hotcold_quants_writes():
    from gguf import GGMLQuantizationType as Q

    from hotcold.gguf import quants

    gen = torch.Generator().manual_seed(5)
    values = torch.randn(6, 96, generator=gen)
    for fmt, qtype in (("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)):
        raw = torch.from_numpy(quants.quantize(values, qtype)).view(torch.uint8).reshape(6, -1)
        assert torch.equal(dequantize(raw, fmt).float(), quants.dequantize_torch(raw, qtype))


# ---------------------------------------------------------------- interpreter cases, in one subprocess

CASES = {
    f"{fmt}-K{k}-D{d}-T{t}": (fmt, k, d, t, i)
    for i, (fmt, (k, d), t) in enumerate((f, s, t) for f in FORMATS for s in SHAPES for t in TOKENS)
}
EXTRA = {
    **{
        f"{fmt}-strided": dict(fmt=fmt, k=40, d=64, t=3, seed=100 + i, strided=True)
        for i, fmt in enumerate(FORMATS)
    },
    **{
        f"{fmt}-nothing-fires": dict(fmt=fmt, k=48, d=64, t=2, seed=200 + i, density=0.0)
        for i, fmt in enumerate(FORMATS)
    },
    "f16-all-fire-T20": dict(fmt="f16", k=64, d=128, t=20, seed=300, density=1.0),
    # few rows: hot_axpy runs as a single split that writes its output directly
    "q4_0-one-split-T1": dict(fmt="q4_0", k=16, d=64, t=1, seed=400),
    "f32-one-split-T20": dict(fmt="f32", k=12, d=64, t=20, seed=401),
}

_CHILD = textwrap.dedent(
    """
    import sys, traceback
    import torch
    import hotcold.kernels.triton as kt

    cases = torch.load(sys.argv[1])
    res = {"available": kt.available()}
    for name, c in cases.items():
        try:
            res[name] = (
                kt.hot_gather_matvec(c["w"], c["x"], c["mask"], qtype=c["qtype"]),
                kt.hot_axpy(c["w_t"], c["a"], c["mask"], qtype=c["qtype"]),
            )
        except Exception:
            res[name] = traceback.format_exc()

    def error(fn):
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    w, x, m = torch.randn(8, 64).half(), torch.randn(2, 64), torch.ones(2, 8, dtype=torch.bool)
    q = torch.zeros(8, 2 * 34, dtype=torch.uint8)
    res["errors"] = {
        "bad qtype": error(lambda: kt.hot_gather_matvec(q, x, m, qtype="q5_k")),
        "uint8 without qtype": error(lambda: kt.hot_gather_matvec(q, x, m)),
        "float with qtype": error(lambda: kt.hot_gather_matvec(w, x, m, qtype="q8_0")),
        "partial block": error(lambda: kt.hot_gather_matvec(q[:, :40], x, m, qtype="q8_0")),
        "x width": error(lambda: kt.hot_gather_matvec(w, x[:, :32], m)),
        "mask shape": error(lambda: kt.hot_axpy(w, torch.randn(2, 8), m[:, :4])),
        "a width": error(lambda: kt.hot_axpy(w, torch.randn(2, 7), m)),
        "3-D weights": error(lambda: kt.hot_axpy(w[None], torch.randn(2, 8), m)),
        "bad out": error(lambda: kt.hot_axpy(w, torch.randn(2, 8), m, out=torch.empty(2, 63))),
        "odd address": error(lambda: kt.hot_axpy(q.view(-1)[1 : 1 + 4 * 68].view(4, 68), x[:, :4], m[:, :4], qtype="q8_0")),
    }
    from gguf import GGMLQuantizationType as Q

    c, c16 = cases["q4_0-K37-D96-T3"], cases["f16-K37-D96-T3"]
    res["qtype names"] = [
        torch.equal(kt.hot_gather_matvec(c["w"], c["x"], c["mask"], qtype=q), res["q4_0-K37-D96-T3"][0])
        for q in (Q.Q4_0, int(Q.Q4_0), "Q4_0")
    ] + [torch.equal(kt.hot_axpy(c16["w_t"], c16["a"], c16["mask"], qtype=Q.F16), res["f16-K37-D96-T3"][1])]
    res["errors"]["float qtype mismatch"] = error(lambda: kt.hot_gather_matvec(w, x, m, qtype="bf16"))
    res["empty"] = (
        kt.hot_gather_matvec(w[:0], x, m[:, :0]).shape,
        kt.hot_axpy(w[:0], torch.randn(2, 0), m[:, :0]).shape,
        kt.hot_gather_matvec(w, x[:0], m[:0]).shape,
    )
    out, out_t = torch.full((2, 8), 7.0), torch.full((2, 64), 7.0)
    a = torch.randn(2, 8)
    res["out"] = (
        kt.hot_gather_matvec(w, x, m, out=out) is out and kt.hot_axpy(w, a, m, out=out_t) is out_t,
        (out.clone(), x.double() @ w.double().T),
        (out_t.clone(), a.double() @ w.double()),
    )
    torch.save(res, sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    cases = {name: make_case(*spec[:4], seed=spec[4]) for name, spec in CASES.items()}
    cases.update({name: make_case(**spec) for name, spec in EXTRA.items()})
    tmp = tmp_path_factory.mktemp("triton_interpret")
    torch.save(cases, tmp / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp / "cases.pt"), str(tmp / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreter subprocess failed:\n{proc.stderr[-4000:]}")
    return cases, torch.load(tmp / "out.pt")


def _result(interpreted, name):
    cases, results = interpreted
    got = results[name]
    if isinstance(got, str):
        pytest.fail(f"{name} raised in the interpreter:\n{got}")
    return cases[name], got


@pytest.mark.parametrize("name", list(CASES) + list(EXTRA))
def test_interpreted_kernels_match_float64(interpreted, name):
    case, (matvec, axpy) = _result(interpreted, name)
    check_case(case, matvec, axpy)


def test_interpreter_reports_available(interpreted):
    assert interpreted[1]["available"] is True


def test_qtype_as_gguf_enum_number_or_name(interpreted):
    assert interpreted[1]["qtype names"] == [True] * 4


def test_empty_and_out(interpreted):
    results = interpreted[1]
    assert results["empty"] == (torch.Size([2, 0]), torch.Size([2, 64]), torch.Size([0, 8]))
    same, *pairs = results["out"]
    assert same
    for out, ref in pairs:
        assert torch.allclose(out.double(), ref, atol=1e-4)


@pytest.mark.parametrize(
    "name, message",
    [
        ("bad qtype", "ValueError: hot_gather_matvec: unsupported qtype 'q5_k'"),
        ("uint8 without qtype", "need qtype='q8_0' or 'q4_0'"),
        ("float with qtype", "q8_0 weights must be uint8 ggml blocks"),
        ("partial block", "rows of 40 bytes are not whole 34-byte blocks"),
        ("x width", "x must be [T, 64]"),
        ("mask shape", "mask_hot must be [T, K] = [2, 8]"),
        ("a width", "a must be [T, 8]"),
        ("3-D weights", "weights must be 2-D"),
        ("bad out", "out must be a contiguous float32 [2, 64]"),
        ("odd address", "rows must start at even byte addresses"),
        ("float qtype mismatch", "qtype bf16 does not match weights of dtype torch.float16"),
    ],
)
def test_bad_inputs(interpreted, name, message):
    assert message in interpreted[1]["errors"][name]


# ---------------------------------------------------------------- a real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _to(case: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 2, 5, 8, 37, 130])
def test_gpu_kernels_match_float64(fmt, t):
    import hotcold.kernels.triton as kt

    case = make_case(fmt, 2048 + 37, 4096, t, seed=t, density=0.25)
    dev = _to(case, "cuda")
    matvec = kt.hot_gather_matvec(dev["w"], dev["x"], dev["mask"], qtype=case["qtype"]).cpu()
    axpy = kt.hot_axpy(dev["w_t"], dev["a"], dev["mask"], qtype=case["qtype"]).cpu()
    if t >= kt.DOT_MIN_TOKENS and fmt != "f32":
        # tensor cores take x and a as TF32 (10-bit mantissa, like ggml's fp16 activations)
        ref_mv, ref_ax = reference(case)
        w = dequantize(case["w"], fmt).nan_to_num(0.0).abs()
        assert torch.isfinite(matvec).all() and torch.isfinite(axpy).all()
        assert ((matvec.double() - ref_mv).abs() <= 2e-3 * (case["x"].double().abs() @ w.T) + 1e-5).all()
        coef = torch.where(case["mask"], case["a"].double(), 0.0).abs()
        w_t = dequantize(case["w_t"], fmt).nan_to_num(0.0).abs()
        assert ((axpy.double() - ref_ax).abs() <= 2e-3 * (coef @ w_t) + 1e-5).all()
    else:
        check_case(case, matvec, axpy)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 37])
def test_gpu_axpy_is_deterministic(t):
    import hotcold.kernels.triton as kt

    dev = _to(make_case("f16", 8192, 4096, t, seed=1, density=0.5), "cuda")
    first = kt.hot_axpy(dev["w_t"], dev["a"], dev["mask"])
    for _ in range(3):
        assert torch.equal(kt.hot_axpy(dev["w_t"], dev["a"], dev["mask"]), first)
