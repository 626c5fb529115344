"""The fused decode kernels (hotcold.kernels.triton_decode) on 7B shapes on a CUDA GPU: each kernel's time and
effective GB/s of the weight rows it reads, at 10% and 100% of the FFN rows firing, and a sweep of the row
kernels' tile. benchmarks/gpu.py runs `benchmark` in its one GPU call.

    python benchmarks/gpu_fused.py     # prints JSON (needs a CUDA GPU)
"""

from __future__ import annotations

import json
import sys

import torch

from hotcold.kernels.triton_decode import GPU_TILE, attention, axpy_splits, down_axpy, gate_up, gemv, qkv_rope


def benchmark(device: str | torch.device = "cuda", *, reps: int = 50) -> dict:
    """Each fused kernel on 7B shapes (D 4096, F 11008, 32 heads, context 2048), F16 weights: microseconds
    a call and effective GB/s of the weight rows actually read, at 10% and 100% of the FFN rows firing.
    For benchmarks/gpu.py (one GPU call); CUDA events, best of `reps` after a warm-up."""
    device = torch.device(device)
    D, F, H, Dh, ctx, R = 4096, 11008, 32, 128, 2048, 1024
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dtype=torch.float16):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3)
        return best

    def row(us: float, nbytes: int) -> dict:
        return {"us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1)}

    x, nw = rnd(D, dtype=torch.float32), torch.ones(D, device=device)
    out = {}
    wqkv, wo = rnd(3 * D, D), rnd(D, D)
    cos = sin = torch.zeros(ctx, Dh // 2, device=device)
    kc, vc = rnd(ctx, H, Dh), rnd(ctx, H, Dh)
    q, att, y = torch.zeros(D, device=device), torch.zeros(D, device=device), torch.zeros(D, device=device)
    pos = torch.tensor([ctx - 1], device=device)
    out["qkv_rope"] = row(timed(lambda: qkv_rope(wqkv, x, nw, 1e-5, pos, cos, sin, q, kc, vc, n_q=D, n_kv=D)),
                          wqkv.numel() * 2)  # fmt: skip
    out["attention_ctx2048"] = row(timed(lambda: attention(q, kc, vc, pos, att, n_head=H, head_dim=Dh)),
                                   2 * kc.numel() * 2)  # fmt: skip
    out["o_residual"] = row(timed(lambda: gemv(wo, att, out=y, residual=x)), wo.numel() * 2)
    fc1, fc2 = rnd(R, D), rnd(F, R)
    r, h = torch.zeros(R, device=device), torch.zeros(D, device=device)
    mask, count = (
        torch.zeros(F, dtype=torch.int8, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
    )
    out["predictor_fc1"] = row(timed(lambda: gemv(fc1, x, out=r, relu=True, norm=nw, eps=1e-5, normed_out=h)),
                               fc1.numel() * 2)  # fmt: skip
    out["predictor_fc2"] = row(timed(lambda: gemv(fc2, r, out=r, threshold=0.0, mask_out=mask, count=count)),
                               fc2.numel() * 2)  # fmt: skip
    gate, up, down_t = rnd(F, D), rnd(F, D), rnd(F, D)
    a = torch.zeros(F, device=device)
    splits, _ = axpy_splits(F, D, device)
    partial = torch.zeros(splits, D, device=device)
    for density in (0.1, 1.0):
        fire = torch.rand(F, generator=gen, device=device) < density
        mask.copy_(fire)
        n = int(fire.sum())
        tag = f"{int(density * 100)}pct"
        out[f"gate_up_{tag}"] = row(timed(lambda: gate_up(gate, up, h, mask, a, kind="gated", activation="relu")),
                                    2 * n * D * 2)  # fmt: skip
        coef = torch.where(fire, torch.rand(F, generator=gen, device=device) + 0.1, 0.0)
        out[f"down_axpy_{tag}"] = row(timed(lambda c=coef: down_axpy(down_t, c, x, partial, y)), n * D * 2)
    # the row kernels' tile: which [rows, columns] x warps reads a dense 11008 x 4096 matrix fastest
    a_out = torch.zeros(F, device=device)
    sweep, default = {}, dict(GPU_TILE)
    try:
        for rows, cols, warps in (
            (16, 256, 4),
            (8, 256, 4),
            (32, 256, 8),
            (16, 512, 8),
            (8, 512, 4),
            (4, 1024, 4),
        ):
            GPU_TILE.update(rows=rows, cols=cols, warps=warps)
            us = timed(lambda: gate_up(gate, up, x, None, a_out, kind="gated", activation="relu"))
            sweep[f"{rows}x{cols}/w{warps}"] = row(us, 2 * F * D * 2)
    finally:
        GPU_TILE.update(default)
    out["dense_gate_up_tiles"] = sweep
    return out


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU")
    print(json.dumps(benchmark("cuda"), indent=2))
