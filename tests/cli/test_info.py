"""hotcold info: the VRAM plan at a budget, by part, without loading; with --load, planned vs allocated."""

from __future__ import annotations

import json

from hotcold.cli import main
from hotcold.config import config_from_file
from hotcold.gguf.io import ModelFile
from hotcold.placement.budget import GIB, plan_budget, plan_offload


def info_json(capsys, *args) -> dict:
    assert main(["info", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_vram_plan_by_part_for_a_sparse_file(capsys, tiny_sparse_gguf):
    info = info_json(capsys, "-m", str(tiny_sparse_gguf), "--vram-budget", "0.25", "-c", "128")
    v = info["vram_plan"]
    mf = ModelFile(tiny_sparse_gguf)
    plan = plan_budget(mf, config_from_file(mf), GIB // 4, ctx_size=128)
    assert v["budget_bytes"] == GIB // 4 and v["ctx_size"] == 128
    assert v["parts_bytes"] == plan.parts() and set(v["parts_bytes"]) == {"dense", "kv", "scratch", "hot"}
    assert v["total_bytes"] == GIB // 4  # what is left after the rest goes to hot rows
    assert "attention of 2/2 layers" in v["placed"] and v["did_not_fit"] == []


def test_vram_plan_for_a_dense_file_and_what_did_not_fit(capsys, tiny_dense_gguf):
    mf = ModelFile(tiny_dense_gguf)
    c = config_from_file(mf)
    info = info_json(capsys, "-m", str(tiny_dense_gguf), "--vram-budget", "0.01")
    v = info["vram_plan"]
    offload = plan_offload(mf, c, int(0.01 * GIB), ctx_size=v["ctx_size"])
    assert v["parts_bytes"] == offload.parts()
    assert v["did_not_fit"] and "the prefill scratch space needs" in v["did_not_fit"][0]
    assert main(["info", "-m", str(tiny_dense_gguf), "--vram-budget", "0.01"]) == 0
    assert "did not fit: the prefill scratch space needs" in capsys.readouterr().out


def test_no_plan_unless_asked_and_load_without_a_gpu_says_so(capsys, tiny_sparse_gguf):
    assert info_json(capsys, "-m", str(tiny_sparse_gguf))["vram_plan"] is None
    info = info_json(capsys, "-m", str(tiny_sparse_gguf), "--load")
    assert info["vram"]["gpu"] is None and "no GPU in use" in info["vram"]["note"]
