"""The fused decode kernels (hotcold.kernels.triton_decode) on 7B shapes on a CUDA GPU: each kernel's time and
effective GB/s of the weight rows it reads, at 10% and 100% of the FFN rows firing (the FFN kernels over
16-row blocks, and over the compacted firing list: `_list`), and a sweep of the row kernels' tile, each
timed in a CUDA graph over operands larger than the L2 (benchmarks/gpu_timing).
benchmarks/gpu.py runs `benchmark` in its one GPU call.

    python benchmarks/gpu_fused.py     # prints JSON (needs a CUDA GPU)
"""

from __future__ import annotations

import json
import sys

import torch

from hotcold.kernels.triton_decode import (
    GPU_TILE,
    MASK_GROUP,
    Compact,
    attention,
    axpy_splits,
    down_axpy,
    gate_up,
    gemv,
    qkv_rope,
)

SHAPE_7B = dict(D=4096, F=11008, H=32, Dh=128, ctx=2048, R=1024)


def benchmark(device: str | torch.device = "cuda", *, shape: dict | None = None, sweep: bool = True) -> dict:
    """Each fused kernel on 7B shapes (D 4096, F 11008, 32 heads, context 2048), F16 weights: microseconds
    a call and effective GB/s of the weight rows actually read, at 10% and 100% of the FFN rows firing.
    Every kernel is timed in a CUDA graph over copies of its operands that together hold 3x the L2
    (benchmarks/gpu_timing: neither Python's launches nor L2 hits in the figure). For benchmarks/gpu.py.
    On the CPU under TRITON_INTERPRET=1 with a tiny `shape`: a check of this function, not a figure."""
    from benchmarks.gpu_timing import copies_for, graph_seconds, l2_bytes

    device = torch.device(device)
    sh = dict(SHAPE_7B, **(shape or {}))
    D, F, H, Dh, ctx, R = (sh[k] for k in ("D", "F", "H", "Dh", "ctx", "R"))
    l2 = l2_bytes(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dtype=torch.float16):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    def copies(make, nbytes: int) -> list:
        return [make() for _ in range(copies_for(nbytes, l2))]

    def row(fn, n_copies: int, nbytes: float) -> dict:
        us = graph_seconds(fn, n_copies, device=device) * 1e6
        return {"us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1), "copies": n_copies}

    x, nw = rnd(D, dtype=torch.float32), torch.ones(D, device=device)
    out = {}
    wqkv = copies(lambda: rnd(3 * D, D), 3 * D * D * 2)
    wo = copies(lambda: rnd(D, D), D * D * 2)
    cos = sin = torch.zeros(ctx, Dh // 2, device=device)
    kv = copies(lambda: (rnd(ctx, H, Dh), rnd(ctx, H, Dh)), 2 * ctx * H * Dh * 2)
    q, att, y = torch.zeros(D, device=device), torch.zeros(D, device=device), torch.zeros(D, device=device)
    pos = torch.tensor([ctx - 1], device=device)
    out["qkv_rope"] = row(lambda i: qkv_rope(wqkv[i], x, nw, 1e-5, pos, cos, sin, q, *kv[i % len(kv)], n_q=D,
                                             n_kv=D), len(wqkv), 3 * D * D * 2)  # fmt: skip
    out[f"attention_ctx{ctx}"] = row(lambda i: attention(q, *kv[i], pos, att, n_head=H, head_dim=Dh), len(kv),
                                     2 * ctx * H * Dh * 2)  # fmt: skip
    out["o_residual"] = row(lambda i: gemv(wo[i], att, out=y, residual=x), len(wo), D * D * 2)
    fc1, fc2 = copies(lambda: rnd(R, D), R * D * 2), copies(lambda: rnd(F, R), F * R * 2)
    r, h = torch.zeros(R, device=device), torch.zeros(D, device=device)
    mask, count = (
        torch.zeros(F, dtype=torch.int8, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
    )
    out["predictor_fc1"] = row(lambda i: gemv(fc1[i], x, out=r, relu=True, norm=nw, eps=1e-5, normed_out=h),
                               len(fc1), R * D * 2)  # fmt: skip
    out["predictor_fc2"] = row(lambda i: gemv(fc2[i], r, out=r, threshold=0.0, mask_out=mask, count=count),
                               len(fc2), F * R * 2)  # fmt: skip
    ffn = copies(lambda: (rnd(F, D), rnd(F, D), rnd(F, D)), 3 * F * D * 2)  # gate, up, down_t
    a = torch.zeros(F, device=device)
    splits, _ = axpy_splits(F, D, device)
    partial = torch.zeros(splits, D, device=device)
    for density in (0.1, 1.0):
        fire = torch.rand(F, generator=gen, device=device) < density
        m = fire.to(torch.int8)
        n = int(fire.sum())
        tag = f"{int(density * 100)}pct"
        out[f"gate_up_{tag}"] = row(lambda i, m=m: gate_up(ffn[i][0], ffn[i][1], h, m, a, kind="gated",
                                                           activation="relu"), len(ffn), 2 * n * D * 2)  # fmt: skip
        coef = torch.where(fire, torch.rand(F, generator=gen, device=device) + 0.1, 0.0)
        out[f"down_axpy_{tag}"] = row(lambda i, c=coef: down_axpy(ffn[i][2], c, x, partial, y), len(ffn),
                                      n * D * 2)  # fmt: skip
        # the same rows through the compacted firing list (what the fixed-shape step runs): block counts as
        # the threshold kernel writes them, then the list's rows in ascending order and their coefficients
        blocks = torch.nn.functional.pad(fire.to(torch.int32), (0, -F % MASK_GROUP)).view(-1, MASK_GROUP)
        lst = Compact(blocks.sum(1, dtype=torch.int32), torch.zeros(F, dtype=torch.int32, device=device))
        out[f"gate_up_{tag}_list"] = row(lambda i, m=m, lst=lst: gate_up(ffn[i][0], ffn[i][1], h, m, a, kind="gated",
                                         activation="relu", compact=lst), len(ffn), 2 * n * D * 2)  # fmt: skip
        listed = fire.nonzero()[:, 0]
        lst.rows[:n] = listed.to(torch.int32)
        a_list = torch.zeros(F, device=device)
        a_list[:n] = coef[listed]
        out[f"down_axpy_{tag}_list"] = row(lambda i, c=a_list, lst=lst: down_axpy(ffn[i][2], c, x, partial, y,
                                           compact=lst), len(ffn), n * D * 2)  # fmt: skip
        if density == 0.1:
            ten = dict(m=m, lst=lst, a_list=a_list, n=n)
    if sweep:  # the row kernels' tile: which [rows, columns] x warps reads a dense F x D matrix fastest
        a_out = torch.zeros(F, device=device)
        tiles, default = {}, dict(GPU_TILE)
        try:
            for rows, cols, warps in ((16, 256, 4), (8, 256, 4), (32, 256, 8), (16, 512, 8), (8, 512, 4),
                                      (4, 1024, 4)):  # fmt: skip
                GPU_TILE.update(rows=rows, cols=cols, warps=warps)
                fn = lambda i: gate_up(ffn[i][0], ffn[i][1], x, None, a_out, kind="gated", activation="relu")  # noqa: E731
                tiles[f"{rows}x{cols}/w{warps}"] = row(fn, len(ffn), 2 * F * D * 2)
        finally:
            GPU_TILE.update(default)
        out["dense_gate_up_tiles"] = tiles
        out |= list_sweep(row, ffn, h, x, partial, y, a, D=D, **ten)
    return out


def list_sweep(row, ffn, h, x, partial, y, a, *, D: int, m, lst, a_list, n: int) -> dict:
    """The compacted-list kernels at 10% firing over their two knobs: rows a gate_up program takes
    (GPU_TILE["compact_rows"]) and the pipelined loops' depth (GPU_TILE["stages"])."""
    out: dict = {"list_gate_up_rows_10pct": {}, "list_stages_10pct": {}}

    def listed_gate_up(i):
        return gate_up(ffn[i][0], ffn[i][1], h, m, a, kind="gated", activation="relu", compact=lst)

    def listed_down(i):
        return down_axpy(ffn[i][2], a_list, x, partial, y, compact=lst)

    default = dict(GPU_TILE)
    try:
        for rows in (4, 8, 16, 32):
            GPU_TILE.update(compact_rows=rows)
            out["list_gate_up_rows_10pct"][f"{rows} rows"] = row(listed_gate_up, len(ffn), 2 * n * D * 2)
        GPU_TILE.update(default)
        for stages in (1, 2, 3, 4):
            GPU_TILE.update(stages=stages)
            out["list_stages_10pct"][f"gate_up {stages}"] = row(listed_gate_up, len(ffn), 2 * n * D * 2)
            out["list_stages_10pct"][f"down_axpy {stages}"] = row(listed_down, len(ffn), n * D * 2)
    finally:
        GPU_TILE.update(default)
    return out


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU")
    print(json.dumps(benchmark("cuda"), indent=2))
