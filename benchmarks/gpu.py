"""GPU benchmark, one call on a borrowed NVIDIA machine (keep under ~8 minutes):

1. the GPU's measured copy bandwidth (device-to-device);
2. a 7B-shaped synthetic ReLU-LLaMA F16 file (~10% firing, skewed), with `--vram-budget 8`:
   hybrid sparse decode (hot neurons on the GPU, cold on the CPU) vs dense `-ngl N` layer offload at the
   same budget, measured in one run (issue #6 target: hybrid >= 8x);
3. the same model entirely on the GPU: dense decode (target: >= 60% of copy bandwidth) and sparse decode;
4. the Triton kernel tests on the real GPU (`pytest -m gpu`).

    python benchmarks/gpu.py --out $OUT/gpu.json [--shape 7b] [--n-gen 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def copy_bandwidth_gb_s(n_bytes: int = 1 << 30) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = max(best, 2 * n_bytes / (time.perf_counter() - start) / 1e9)  # read + write
    return best


def tg(path: Path, n_gen: int, **load_args) -> dict:
    """Decode speed of one configuration (tokens/s, firing rate, effective GB/s of weights read)."""
    import hotcold
    from hotcold.cli.bench import measure, weight_bytes

    start = time.perf_counter()
    llm = hotcold.load(path, ctx_size=n_gen + 8, **load_args)
    load_s = time.perf_counter() - start
    measure(llm, "tg", 4)  # warm-up
    seconds, rate = measure(llm, "tg", n_gen)
    sizes = weight_bytes(llm.loaded.file)
    sparse = not llm.loaded.dense
    per_token = (
        sizes["other"] + sizes["ffn"] * (rate if sparse else 1.0) + (sizes["predictor"] if sparse else 0)
    )
    result = {
        "load_seconds": load_s,
        "tokens_per_s": n_gen / seconds,
        "firing_rate": rate if sparse else 1.0,
        "effective_gb_s": n_gen / seconds * per_token / 1e9,
        "notes": llm.loaded.notes,
    }
    del llm
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gpu.json")
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--workdir", default="/tmp/hotcold-gpu")
    ap.add_argument("--budget", type=float, default=8.0, help="GiB for the hybrid vs -ngl comparison")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure", file=sys.stderr)
        return 1
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(),
        "threads": args.threads,
    }

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))

    results["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s()
    save()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"synth-{args.shape}.powerinfer.gguf"
    if not path.exists():
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, str(Path(__file__).parent / "synth.py"), "--shape", args.shape, "-o", str(path)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        results["synth_seconds"] = time.perf_counter() - start
    results["file_bytes"] = path.stat().st_size
    save()
    common = dict(device="cuda", threads=args.threads)
    runs = {
        "hybrid_sparse_budget": dict(vram_budget=args.budget, reset_gpu_index=True),
        "dense_ngl_budget": dict(vram_budget=args.budget, dense=True),
        "dense_all_gpu": dict(dense=True),
        "sparse_all_gpu": dict(reset_gpu_index=True),
    }
    for name, extra in runs.items():
        try:
            results[name] = tg(path, args.n_gen, **common, **extra)
        except Exception as exc:  # record and go on: one failure must not lose the other figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    hyb, ngl = results.get("hybrid_sparse_budget", {}), results.get("dense_ngl_budget", {})
    if "tokens_per_s" in hyb and "tokens_per_s" in ngl:
        results["hybrid_over_ngl"] = hyb["tokens_per_s"] / ngl["tokens_per_s"]
    dense_gpu = results.get("dense_all_gpu", {})
    if "effective_gb_s" in dense_gpu:
        results["dense_all_gpu_share_of_copy_bw"] = (
            dense_gpu["effective_gb_s"] / results["copy_bandwidth_gb_s"]
        )
    save()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    results["gpu_tests"] = {"returncode": tests.returncode, "tail": tests.stdout[-2000:]}
    save()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
