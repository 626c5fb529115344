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
