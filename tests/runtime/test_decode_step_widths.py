"""hotcold.runtime.decode_step over layers of different FFN widths (#46): the down_axpy scratch is sized for the
widest layer, and a narrower layer must add only its own row splits (it summed the splits a wider layer
had left there: error 82.6 against a reference maximum of 63.1). The fused step runs under the Triton
interpreter in a subprocess (see tests/kernels/test_triton.py for why this process must not import
triton) against a float64 reference of the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hotcold.runtime import decode_step

D, H, HKV, DH, R, N_CTX, V = 64, 4, 2, 16, 24, 16, 40
WIDTHS = (128, 16, 96)  # interpreter: 4, 1 and 3 row splits of down_axpy (kernels.triton._sm_count is 2)
EPS = 1e-5


def random_decoder(kernels: str, *, seed: int = 0) -> decode_step.StaticDecoder:
    """Three layers whose FFN widths differ (the first and last sparse, the middle one dense), random float
    weights, thresholds where about a third of the neurons fire."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).float()

    layers = []
    for i, f in enumerate(WIDTHS):
        sparse = i != 1
        layers.append(
            decode_step.StepLayer(
                attn_norm=rnd(D).abs() + 0.5,
                wqkv=rnd((H + 2 * HKV) * DH, D, scale=D**-0.5),
                wo=rnd(D, H * DH, scale=(H * DH) ** -0.5),
                ffn_norm=rnd(D).abs() + 0.5,
                up=rnd(f, D, scale=D**-0.5),
                gate=rnd(f, D, scale=D**-0.5),
                down_t=rnd(f, D, scale=f**-0.5),
                down=None,
                fc1=rnd(R, D, scale=D**-0.5) if sparse else None,
                fc2=rnd(f, R, scale=R**-0.5) if sparse else None,
                threshold=0.2,
            )
        )
    from hotcold.ops import rope_tables

    cos, sin = rope_tables(N_CTX, DH, 10000.0, 1.0)
    shape = decode_step.StepShape(H, HKV, DH, EPS, "gated", "relu")
    return decode_step.StaticDecoder(
        layers, shape, rnd(D).abs() + 0.5, rnd(V, D, scale=D**-0.5), cos, sin, kernels=kernels, capture=False
    )


def reference_step(decoder: decode_step.StaticDecoder, ks, vs, x: torch.Tensor, pos: int):
    """The step in float64, written out from the math (not from either kernel set): logits [V] and the
    firing counts. ks / vs: float64 caches [N_CTX, Hkv, Dh] per layer, written at pos."""
    s = decoder.shape

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean() + EPS) * w.double()

    cos, sin = decoder.cos.double()[pos], decoder.sin.double()[pos]
    x = x.double()
    counts = []
    for i, la in enumerate(decoder.layers):
        y = la.wqkv.double() @ norm(x, la.attn_norm)
        qd, kvd = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        qk = y[: qd + kvd].view(-1, s.head_dim // 2, 2)
        qk = torch.stack(
            (qk[..., 0] * cos - qk[..., 1] * sin, qk[..., 0] * sin + qk[..., 1] * cos), -1
        ).flatten()
        ks[i][pos] = qk[qd:].view(s.n_head_kv, s.head_dim)
        vs[i][pos] = y[qd + kvd :].view(s.n_head_kv, s.head_dim)
        q = qk[:qd].view(s.n_head, s.head_dim)
        group = s.n_head // s.n_head_kv
        heads = []
        for h in range(s.n_head):
            k, v = ks[i][: pos + 1, h // group], vs[i][: pos + 1, h // group]
            heads.append(torch.softmax(k @ q[h] * s.head_dim**-0.5, 0) @ v)
        x2 = x + la.wo.double() @ torch.cat(heads)
        hn = norm(x2, la.ffn_norm)
        fire = torch.ones(la.up.shape[0], dtype=torch.bool)
        if la.fc1 is not None:
            fire = la.fc2.double() @ torch.relu(la.fc1.double() @ x2) >= la.threshold  # llama: p = x2
            counts.append(int(fire.sum()))
        else:
            counts.append(0)
        a = torch.where(fire, torch.relu(la.gate.double() @ hn) * (la.up.double() @ hn), 0.0)
        x = x2 + a @ la.down_t.double()
    return decoder.head.double() @ norm(x, decoder.head_norm), counts


def run_steps(kernels: str, n: int = 3) -> dict:
    """n steps of the random decoder against the float64 reference: the worst error relative to the
    reference's largest logit, the splits each layer's down_axpy uses, and whether the counts agree."""
    from types import SimpleNamespace

    decoder = random_decoder(kernels)
    kv = SimpleNamespace(
        k=[torch.zeros(N_CTX, HKV, DH) for _ in WIDTHS],
        v=[torch.zeros(N_CTX, HKV, DH) for _ in WIDTHS],
        n_ctx=N_CTX,
    )
    ks = [torch.zeros(N_CTX, HKV, DH, dtype=torch.float64) for _ in WIDTHS]
    vs = [torch.zeros(N_CTX, HKV, DH, dtype=torch.float64) for _ in WIDTHS]
    gen = torch.Generator().manual_seed(5)
    worst, ref_max, same_counts, fired = 0.0, 0.0, True, 0
    for pos in range(n):
        x = torch.randn(D, generator=gen)
        got, counts = decoder.step(kv, x, pos)
        ref, ref_counts = reference_step(decoder, ks, vs, x, pos)
        worst = max(worst, (got.double() - ref).abs().max().item())
        ref_max = max(ref_max, ref.abs().max().item())
        same_counts &= counts == ref_counts
        fired += sum(counts)
    splits = [decoder.kernels.partial_rows(la) for la in decoder.layers]
    return dict(err=worst, ref_max=ref_max, same_counts=same_counts, fired=fired, splits=splits)


def test_torch_step_over_layers_of_different_widths():
    got = run_steps("torch")
    assert got["err"] < 1e-5 * got["ref_max"] and got["same_counts"] and got["fired"] > 0, got


SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    from tests.runtime.test_decode_step_widths import run_steps
    print(json.dumps(run_steps("triton")))
    """
)


def test_fused_step_over_layers_of_different_widths():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=root)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["splits"][0] > got["splits"][1] >= 1, got  # the narrow layer after a wider one: stale rows
    assert got["err"] < 1e-5 * got["ref_max"] and got["same_counts"] and got["fired"] > 0, got
