"""Kernel timing that measures the GPU, not Python or the L2 cache (#46), for benchmarks/gpu.py and
benchmarks/gpu_fused.py:

- operands are rotated over several copies whose sum is a few times the L2 cache (H200: 50 MB), so every
  call reads its weights from HBM as a decode step does (a 22 MB matrix timed alone stays in L2);
- the calls are captured in one CUDA graph (one call per copy, in turn) and the graph is replayed, so the
  time is the kernels' and not the launches' (a Triton launch from Python costs ~20-40 us of host time,
  longer than many of these kernels).

Off a GPU (device "cpu", the Triton interpreter) `graph_seconds` calls each copy twice in a plain loop and
`l2_bytes` is 0 (two copies): a check of the plumbing, never a figure.
"""

from __future__ import annotations

import math
import time

import torch

L2_DEFAULT = 50 << 20  # H200 (and H100: 50 MB)


def l2_bytes(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 0  # off a GPU nothing is a figure: the fewest copies
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_DEFAULT)


def copies_for(nbytes: int, l2: int, *, factor: float = 3.0, cap: int = 64) -> int:
    """Copies of an operand of nbytes that together hold at least factor x the L2 (at least 2, so no call
    reads what the call before it left in L2; at most cap)."""
    return max(2, min(cap, math.ceil(factor * l2 / max(1, nbytes))))


def graph_seconds(fn, n_copies: int, *, device: torch.device | str, rounds: int = 5,
                  min_calls: int = 16) -> float:  # fmt: skip
    """Seconds a call of fn(i) (i: which copy of the operands) takes: a CUDA graph of calls over every copy
    in turn (at least min_calls), replayed `rounds` times after a warm-up; the best round. Every copy is
    called once before the capture (Triton compiles then, outside the graph)."""
    device = torch.device(device)
    calls = n_copies * math.ceil(min_calls / n_copies)
    for i in range(n_copies):
        fn(i)
    if device.type != "cuda":  # the plumbing only: one more pass over the copies
        start = time.perf_counter()
        for i in range(n_copies):
            fn(i)
        return (time.perf_counter() - start) / n_copies
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for k in range(calls):
            fn(k % n_copies)
    current.wait_stream(stream)
    graph.replay()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    del graph
    return best
