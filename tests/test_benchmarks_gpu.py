"""benchmarks/gpu.py on the CPU: the dry run's plumbing (every required field written), and the parser for
the table that the original PowerInfer's powerinfer-gpu.sh prints."""

from __future__ import annotations

import json

from benchmarks import gpu

# powerinfer-gpu.sh: printf '%-18s rc=%s tg=%s tok/s\n' "$name" "$rc" "${tps:-?}" | tee -a pi-table.txt
PI_TABLE = (
    "hybrid_budget      rc=0 tg=41.37 tok/s\n"
    "sparse_all_gpu     rc=0 tg=212.05 tok/s\n"
    "sparse_cpu_only    rc=0 tg=9.8 tok/s\n"
    "dense_ngl          rc=124 tg=? tok/s\n"
    "dense_all_gpu      rc=0 tg=150 tok/s\n"
)


def test_parse_pi_table():
    rows = gpu.parse_pi_table("missing libraries for main\n" + PI_TABLE)
    assert rows == {
        "hybrid_budget": {"rc": 0, "tps": 41.37},
        "sparse_all_gpu": {"rc": 0, "tps": 212.05},
        "sparse_cpu_only": {"rc": 0, "tps": 9.8},
        "dense_ngl": {"rc": 124, "tps": None},
        "dense_all_gpu": {"rc": 0, "tps": 150.0},
    }
    assert set(rows) == set(gpu.PI_FIELDS)
    assert gpu.parse_pi_line("Once upon a time") is None


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
    assert (out.parent / "gpu-summary.md").read_text().startswith("### GPU run")


FAKE_PI = """#!/bin/bash
# stands in for powerinfer-gpu.sh: SPARSE DENSE BUDGET NGL N THREADS, the table on stdout and in $OUT
echo "$@" > "$OUT/args.txt"
echo "log of main" > "$OUT/pi-hybrid_budget.log"
printf '%-18s rc=%s tg=%s tok/s\\n' hybrid_budget 0 41.37 | tee -a "$OUT/pi-table.txt"
printf '%-18s rc=%s tg=%s tok/s\\n' sparse_all_gpu 0 212.05 | tee -a "$OUT/pi-table.txt"
sleep "${HANG:-0}"
printf '%-18s rc=%s tg=%s tok/s\\n' dense_ngl 124 "" | tee -a "$OUT/pi-table.txt"
"""


def _fake_pi(tmp_path, monkeypatch, hang: str, limit_s: float):
    anchors = tmp_path / "anchors"
    anchors.mkdir()
    (anchors / "powerinfer-gpu.sh").write_text(FAKE_PI)
    monkeypatch.setenv("HANG", hang)
    b = gpu.Bench(tmp_path / "gpu.json", 100)
    b.results.update(budget_gib=2.976, ngl=5)
    args = gpu.argparse.Namespace(
        anchors=str(anchors), device="cuda", workdir=str(tmp_path), n_gen=64, threads=16
    )
    gpu.powerinfer(b, args, tmp_path / "s.powerinfer.gguf", tmp_path / "d.gguf", limit_s)
    return gpu.json.loads((tmp_path / "gpu.json").read_text())


def test_powerinfer_part_passes_the_arguments_and_reads_the_table(tmp_path, monkeypatch):
    r = _fake_pi(tmp_path, monkeypatch, "0", 30)
    args = (tmp_path / "pi" / "args.txt").read_text().split()
    assert args == [str(tmp_path / "s.powerinfer.gguf"), str(tmp_path / "d.gguf"), "2.98", "5", "64", "16"]
    assert (
        r["pi_hybrid_tps"] == 41.37 and r["pi_sparse_all_gpu_tps"] == 212.05 and r["pi_dense_ngl_tps"] is None
    )
    assert r["powerinfer"]["rc"] == 0 and "log of main" in r["powerinfer"]["logs"]["pi-hybrid_budget"]
    assert set(r["errors"]) == {"powerinfer_dense_ngl"}


def test_powerinfer_part_keeps_what_came_before_its_time_limit(tmp_path, monkeypatch):
    start = gpu.time.monotonic()
    r = _fake_pi(tmp_path, monkeypatch, "60", 1.5)
    assert gpu.time.monotonic() - start < 10
    assert r["pi_hybrid_tps"] == 41.37 and r["powerinfer"]["rc"] is None and "powerinfer" in r["errors"]
