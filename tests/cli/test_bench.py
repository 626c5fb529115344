"""hotcold bench: single and batched generation rows on the bundled model."""

from __future__ import annotations

from hotcold.cli.bench import run_bench


def test_batched_rows_report_aggregate_and_union_firing():
    rows = run_bench(None, n_prompt=0, n_gen=6, repetitions=1, threads=2, device="cpu", batches=(1, 4))
    by = {(r["mode"], r["test"]): r for r in rows}
    assert set(by) == {("sparse", "tg6"), ("dense", "tg6"), ("sparse", "tg6x4"), ("dense", "tg6x4")}
    batched = by["sparse", "tg6x4"]
    assert batched["batch"] == 4
    assert batched["tokens_per_s_per_sequence"] == batched["tokens_per_s"] / 4
    # the rows any of 4 tokens fire are at least those one token fires, and fewer than all
    assert by["sparse", "tg6"]["firing_rate"] <= batched["union_firing_rate"] < 1.0
    assert by["dense", "tg6x4"]["union_firing_rate"] == 1.0
