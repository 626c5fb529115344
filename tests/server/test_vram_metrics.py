"""/metrics: VRAM planned (the load plan, by part) vs used (CUDA's caching allocator). Without a GPU the
gauges read 0; with one (faked here: a device plan naming cuda and torch.cuda's counters patched) they
carry the plan's parts and the allocator's figures."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import torch

from hotcold.device import CPU, DevicePlan
from hotcold.loader import VramFigures, vram_figures
from hotcold.server.metrics import Metrics

CUDA = torch.device("cuda")  # named only: nothing is allocated on it


def gauges(text: str) -> dict[str, float]:
    return {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"
    }


def render(vram) -> dict[str, float]:
    return gauges(Metrics().render(queue_depth=0, busy=0, parallel=1, cancelled=0, vram=vram))


def test_gauges_read_zero_without_a_gpu():
    for vram in (None, VramFigures({}, None, None)):
        g = render(vram)
        assert g["hotcold_vram_planned_bytes"] == 0 and g["hotcold_vram_used_bytes"] == 0
        assert g["hotcold_vram_reserved_peak_bytes"] == 0
        assert not any(k.startswith("hotcold_vram_planned_part_bytes") for k in g)


def test_gauges_carry_the_plan_by_part_and_the_allocators_figures():
    planned = {"dense": 5 << 30, "kv": 1 << 30, "scratch": 600 << 20, "hot": 3 << 30}
    g = render(VramFigures(planned, used=(9 << 30) + 5, peak_reserved=10 << 30, budget=10 << 30))
    assert g["hotcold_vram_planned_bytes"] == sum(planned.values())  # above 2**31: no wrap
    assert g['hotcold_vram_planned_part_bytes{part="kv"}'] == 1 << 30
    assert g['hotcold_vram_planned_part_bytes{part="hot"}'] == 3 << 30
    assert g["hotcold_vram_used_bytes"] == (9 << 30) + 5
    assert g["hotcold_vram_reserved_peak_bytes"] == 10 << 30


def test_vram_figures_ask_the_caching_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 7 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 8 << 30)
    planned = {"dense": 1, "kv": 2, "scratch": 3, "hot": 4}
    hybrid = DevicePlan((CUDA, CPU), (CUDA, CPU), (CPU, CPU), fast=CUDA)
    plan = SimpleNamespace(budget_bytes=8 << 30)
    v = vram_figures(SimpleNamespace(devices=hybrid, vram_planned=planned, plan=plan))
    assert (v.planned, v.used, v.peak_reserved, v.budget) == (planned, 7 << 30, 8 << 30, 8 << 30)
    assert v.planned_total == 10
    # a model on the CPU only (or on a CPU stand-in for the GPU): nothing in VRAM to report
    cpu = vram_figures(SimpleNamespace(devices=DevicePlan.cpu_only(2), vram_planned=None, plan=None))
    assert cpu == VramFigures({}, None, None)
    stand_in = DevicePlan((CPU, CPU), (CPU, CPU), (CPU, CPU), fast=CPU)
    assert vram_figures(SimpleNamespace(devices=stand_in, vram_planned=planned, plan=plan)).used is None


def test_the_server_reports_the_vram_gauges(server_url):
    g = gauges(httpx.get(server_url + "/metrics", timeout=10).text)
    assert g["hotcold_vram_planned_bytes"] == 0 and g["hotcold_vram_used_bytes"] == 0  # a CPU-only model
