"""LoadOptions: every front end's load knobs in one record, validated once, naming the bad field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import hotcold
from hotcold.cli import add_model_args
from hotcold.load_options import LoadOptions


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("threads", 0, "threads"),
        ("vram_budget", float("nan"), "vram_budget"),
        ("ctx_size", -4, "ctx_size"),
        ("sparsity", 1.5, "sparsity"),
        ("n_gpu_layers", -1, "n_gpu_layers"),
        ("device", "tpu", "device must be"),
        ("decoder", "cuda_graph", "decoder must be"),
        ("kv_sequences", 0, "kv_sequences"),
    ],
)
def test_bad_values_name_their_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        LoadOptions(**{field: value})
    with pytest.raises(ValueError, match=match):  # the API takes the same path
        hotcold.load(**{field: value})


def test_from_args_takes_the_model_flags_and_serve_slots():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    parser.add_argument("-np", "--parallel", type=int, default=4)
    args = parser.parse_args(["-t", "2", "--dense", "--decoder", "eager", "-c", "64", "--sparsity", "0.3"])
    opts = LoadOptions.from_args(args)
    assert (opts.threads, opts.dense, opts.decoder, opts.ctx_size, opts.sparsity) == (
        2,
        True,
        "eager",
        64,
        0.3,
    )
    assert opts.kv_sequences == 5  # a KV cache per slot, plus the Model's own
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.threads = 4  # type: ignore[misc]


def test_the_cli_loads_with_its_options(tmp_path):
    from hotcold.cli import load_from_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    llm = load_from_args(parser.parse_args(["-t", "1", "-c", "48", "--decoder", "eager"]))
    assert llm.ctx_size == 48 and llm.decoder == "eager"
