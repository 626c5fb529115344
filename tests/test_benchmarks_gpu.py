"""benchmarks/gpu.py on the CPU: the dry run's plumbing (every required field written); the original
PowerInfer's runs (gpu_pi: -c, the equal-bytes budget) through a stand-in `main`; the kernel timing's
copies (gpu_timing) and the kernel benchmarks under the Triton interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import gpu, gpu_pi, gpu_timing


def test_cpu_dry_run_writes_every_field(tmp_path):
    out = tmp_path / "out" / "gpu.json"
    rc = gpu.main(["--cpu-dry-run", "--out", str(out), "--workdir", str(tmp_path / "work"), "--threads", "2"])
    r = json.loads(out.read_text())
    assert rc == 0, r["errors"]
    assert set(gpu.REQUIRED) <= set(r)
    assert r["errors"] == {}, r["errors"]
    assert r["dry_run"] and r["gpu"] is None and r["copy_gb_s"] is None and r["host_copy_gb_s"] > 0
    for run in ("dense_all_gpu", "sparse_all_gpu", "hybrid", "dense_ngl", "sparse_cpu_only"):
        assert r[f"{run}_tps"] > 0 and r["runs"][run]["ms_per_layer"] > 0, run
    assert (
        0 < r["runs"]["sparse_cpu_only"]["firing_rate"] < 1 and r["runs"]["dense_all_gpu"]["firing_rate"] == 1
    )
    assert r["budget_gib"] > 0 and r["ngl"] >= 0 and r["sparse_over_dense_all_gpu"] > 0
    assert {"kernels", "powerinfer", "gpu_tests"} <= set(r["skipped"])
    assert (tmp_path / "work" / "activation" / "activation_0.pt").exists()
    text = (out.parent / "gpu-summary.md").read_text()
    assert text.startswith("### GPU run")
    # the bytes ceiling beside each all-GPU sparse figure, and its share in gpu.json
    sparse_row = next(line for line in text.splitlines() if line.startswith("| sparse, all on the GPU |"))
    assert f"(ceiling {r['sparse_bytes_ceiling']:.2f}x:" in sparse_row, sparse_row
    assert r["sparse_share_of_ceiling"] == pytest.approx(
        r["sparse_over_dense_all_gpu"] / r["sparse_bytes_ceiling"]
    )
    # the original at equal hot bytes: a budget below hotcold's (no scratch), holding hotcold's planned neurons
    assert 0 < r["pi_equal_bytes_budget_gib"] < r["budget_gib"] and r["hot_neurons_planned"] > 0
    assert r["sparse_bytes_ceiling"] == r["dense_bytes_per_token"] / r["sparse_bytes_per_token"] > 1
    assert r["runs"]["hybrid"]["threads"] == 2


def test_cold_threads_leave_the_launching_thread_a_core():
    assert [gpu.cold_threads(n) for n in (16, 2, 1, None)] == [15, 1, 1, 1]


# a 7B-shaped layer's tensors as the original's budget walk sees them (F16): name -> (type, bytes)
D, FF, L = 4096, 11008, 8


def tensors_7b() -> dict:
    t = {"token_embd.weight": ("F16", 32000 * D * 2), "output.weight": ("F16", 32000 * D * 2),
         "output_norm.weight": ("F32", D * 4)}  # fmt: skip
    for i in range(L):
        t |= {f"blk.{i}.attn_{n}.weight": ("F16", D * D * 2) for n in ("q", "k", "v", "output")}
        t |= {f"blk.{i}.attn_norm.weight": ("F32", D * 4), f"blk.{i}.ffn_norm.weight": ("F32", D * 4)}
        t |= {f"blk.{i}.fc1.weight": ("F16", 1024 * D * 2), f"blk.{i}.fc2.weight": ("F16", FF * 1024 * 2)}
        t |= {f"blk.{i}.ffn_{n}.weight": ("F16", FF * D * 2) for n in ("up", "gate", "down_t")}
    return t


def test_equal_bytes_budget_follows_the_originals_rules():
    """reference §4.2 / §3.2: dense tensors (not the embedding, not the FFN) + K and V at ctx in f16, then
    floor(remaining / (n_ff * 2 * 4.5)) * 4 neurons; the budget for H neurons gives back at least H."""
    sp = gpu_pi.pi_spending(tensors_7b(), n_layer=L, n_ff=FF, n_embd_gqa=D, ctx=2048)
    dense = L * (4 * D * D * 2 + 2 * D * 4 + 1024 * D * 2 + FF * 1024 * 2) + 32000 * D * 2 + D * 4
    assert sp == {"dense_bytes": dense, "kv_bytes": 2 * D * L * 2048 * 2, "slice_bytes": int(FF * 2 * 4.5)}
    for hot in (1, 4, 29355, L * FF // 3):
        gib = gpu_pi.equal_bytes_budget(sp, hot)
        assert hot <= gpu_pi.pi_capacity(sp, float(gpu_pi._gib(gib))) < hot + 8
    assert gpu_pi.pi_capacity(sp, 0.5) == 0  # the dense tensors do not fit: no FFN split at all
    # a longer context costs the original KV bytes before neurons
    sp512 = gpu_pi.pi_spending(tensors_7b(), n_layer=L, n_ff=FF, n_embd_gqa=D, ctx=512)
    assert gpu_pi.pi_capacity(sp512, 3.0) > gpu_pi.pi_capacity(sp, 3.0)


def test_hotcold_hot_neurons_from_a_plan():
    plan = SimpleNamespace(hot_bytes=10 * 3 * D * 2 + 5, bytes_per_neuron=[3 * D * 2 + 8] * L)
    assert gpu_pi.hotcold_hot_neurons(plan) == 9


def test_pi_plan_gives_every_run_the_context():
    runs = gpu_pi.pi_plan(Path("s.gguf"), Path("d.gguf"), budget_gib=2.97612, equal_bytes_gib=1.5, ngl=5,
                          n_gen=64, threads=15, ctx=2048)  # fmt: skip
    names = [r.name for r in runs]
    assert names[:2] == ["hybrid_budget", "hybrid_equal_bytes"] and len(set(names)) == 6
    for r in runs:
        argv = list(r.argv)
        assert argv[argv.index("-c") + 1] == "2048" and argv[argv.index("-t") + 1] == "15", r
    assert list(runs[0].argv[2:4]) == ["--vram-budget", "2.9762"]  # rounded up, not to 0.01 GiB
    assert runs[1].argv[3] == "1.5000" and runs[1].field == "pi_hybrid_equal_bytes_tps"
    assert [r.name for r in gpu_pi.pi_plan(Path("s"), Path("d"), budget_gib=1, equal_bytes_gib=None, ngl=1,
                                          n_gen=1, threads=1, ctx=1)][1] == "sparse_all_gpu"  # fmt: skip


MAIN_LOG = """llama_print_timings:        load time =  1000.00 ms
llama_print_timings: prompt eval time =    50.00 ms /     5 tokens (   10.00 ms per token,   100.00 tokens per second)
llama_print_timings:        eval time =  1500.00 ms /    63 runs   (   23.81 ms per token,    42.00 tokens per second)
"""


def test_parse_tps_reads_generation_not_the_prompt():
    assert gpu_pi.parse_tps(MAIN_LOG) == 42.0 and gpu_pi.parse_tps("CUDA error") is None


FAKE_MAIN = (
    """#!/bin/bash
# stands in for PowerInfer's main: its arguments on one line of $ARGS_LOG, the timings on stdout
echo "$@" >> "$ARGS_LOG"
case "$*" in *"-ngl 999"*) sleep "${HANG:-0}";; esac
case "$*" in *"-ngl 5 "*) echo "CUDA error: out of memory"; exit 1;; esac
cat <<'LOG'
"""
    + MAIN_LOG
    + """LOG
"""
)


def _fake_pi(tmp_path, monkeypatch, hang: str, limit_s: float):
    anchors = tmp_path / "anchors"
    (anchors / "powerinfer-cuda" / "bin").mkdir(parents=True)
    main = anchors / "powerinfer-cuda" / "bin" / "main"
    main.write_text(FAKE_MAIN)
    main.chmod(0o755)
    monkeypatch.setenv("HANG", hang)
    monkeypatch.setenv("ARGS_LOG", str(tmp_path / "args.txt"))
    b = gpu.Bench(tmp_path / "gpu.json", 100)
    b.results.update(budget_gib=2.976, ngl=5, pi_equal_bytes_budget_gib=2.1)
    args = SimpleNamespace(anchors=str(anchors), device="cuda", workdir=str(tmp_path), n_gen=64, threads=15,
                           ctx=2048, pi_run_limit_s=limit_s)  # fmt: skip
    sparse = tmp_path / "s.powerinfer.gguf"
    Path(str(sparse) + ".generated.gpuidx").write_text("stale")
    gpu.powerinfer(b, args, sparse, tmp_path / "d.gguf", 30)
    return json.loads((tmp_path / "gpu.json").read_text()), (tmp_path / "args.txt").read_text().splitlines()


def test_powerinfer_runs_each_configuration_at_the_context(tmp_path, monkeypatch):
    r, calls = _fake_pi(tmp_path, monkeypatch, "0", 30)
    assert len(calls) == 6 and all("-c 2048" in c and "-t 15" in c for c in calls), calls
    assert "--vram-budget 2.9760" in calls[0] and "--vram-budget 2.1000" in calls[1]
    assert r["pi_hybrid_tps"] == r["pi_hybrid_equal_bytes_tps"] == r["pi_sparse_all_gpu_tps"] == 42.0
    assert r["pi_dense_ngl_tps"] is None and set(r["errors"]) == {"powerinfer_dense_ngl"}
    assert "out of memory" in r["powerinfer"]["logs"]["dense_ngl"]
    assert not (tmp_path / "s.powerinfer.gguf.generated.gpuidx").exists()  # no stale placement left


def test_powerinfer_run_past_its_limit_keeps_the_others(tmp_path, monkeypatch):
    start = gpu.time.monotonic()
    r, calls = _fake_pi(tmp_path, monkeypatch, "60", 2)
    assert gpu.time.monotonic() - start < 20
    assert r["pi_dense_all_gpu_tps"] is None and r["pi_table"]["dense_all_gpu"]["rc"] is None
    assert r["pi_hybrid_tps"] == 42.0 and r["pi_sparse_cpu_only_tps"] == 42.0  # the run after it still ran


def test_copies_for_exceed_the_l2():
    l2 = 50 << 20
    for nbytes in (8 << 20, 22 << 20, 90 << 20, 300 << 20):
        n = gpu_timing.copies_for(nbytes, l2)
        assert n >= 2 and (n * nbytes >= 3 * l2 or n == 64), (nbytes, n)
    assert gpu_timing.copies_for(1, l2) == 64 and gpu_timing.copies_for(1 << 40, l2) == 2


INTERPRETED = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    from benchmarks import gpu
    from benchmarks.gpu_fused import benchmark
    fused = benchmark("cpu", shape=dict(D=64, F=96, H=2, Dh=32, ctx=16, R=16), sweep=True)
    rows = gpu.kernel_bench(None, device="cpu", shape=(48, 64))
    print(json.dumps(dict(fused=fused, rows=rows)))
    """
)


def test_kernel_benchmarks_run_under_the_interpreter():
    """The rotation and graph-timing plumbing of gpu_fused.benchmark and kernel_bench on tiny shapes
    (a plain loop off a GPU: a check, not a figure)."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED.format(root=root)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"qkv_rope", "attention_ctx16", "gate_up_10pct", "down_axpy_100pct", "gate_up_10pct_list",
            "down_axpy_10pct_list"} <= set(got["fused"])  # fmt: skip
    sweeps = {
        k: got["fused"].pop(k)
        for k in ("dense_gate_up_tiles", "list_gate_up_rows_10pct", "list_stages_10pct")
    }
    assert len(sweeps["list_gate_up_rows_10pct"]) == 4 and len(sweeps["list_stages_10pct"]) == 8, sweeps
    assert all(v["us"] > 0 and v["copies"] == 2 for v in got["fused"].values())
    assert all(v["timing"] == "loop (not a figure)" for v in got["rows"].values())
