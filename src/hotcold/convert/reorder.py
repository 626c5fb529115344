"""Rewrite a PowerInfer file with each layer's FFN neurons hottest first: `hotcold reorder IN OUT`.

Why: the CPU's sparse kernels read the rows the predictor picks, and the rows most tokens pick are the hottest.
Stored side by side they stream as one run instead of as scattered rows: a model loaded for several sequences
gets this order at load (loader.neuron_order) by copying its FFN rows; a file written in it needs no copy, and a
single sequence gains too (lone decode 0.95x the time in an in-process A/B on the 1B synthetic).

Every per-neuron tensor of a layer moves together: the rows of ffn_up, ffn_gate, ffn_down_t (and the up bias)
and of the predictor's fc2 (row i predicts neuron i), so the model computes the same function; its sums over
neurons run in the new order, so the bits differ from the input's. The activation statistics are written,
permuted the same way, beside the output (`OUT's folder/activation`), where placement and the loader read them:
as one set (hotcold.atomic.atomic_directory), put in place right after the model, never part of them.
Every other tensor and key is copied as it is; the original PowerInfer reads the output as it reads the input.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hotcold.atomic import check_output
from hotcold.config import config_from_file
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file
from hotcold.placement.profile import (
    activation_dir_writer,
    check_activation_dir,
    default_activation_dir,
    hottest_first,
    read_activation_files,
    save_activation_files,
)


def reorder_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    activation_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write dst: src with each layer's FFN neurons hottest first, by the statistics in activation_dir
    (default: src's folder/activation), and those statistics, permuted, in dst's folder/activation."""
    src, dst = Path(src), Path(dst)
    check_output(dst, [src], what="reorder: output")
    mf = ModelFile(src)
    config = config_from_file(mf)
    if not mf.is_sparse:
        raise ValueError(
            f"{src}: not a PowerInfer file (no predictors): no rows are picked, the order gains nothing"
        )
    if config.sparsified or config.n_expert:
        what = "a `hotcold sparsify` file" if config.sparsified else "a mixture-of-experts file"
        raise ValueError(
            f"{src}: {what}: its per-neuron tensors are not all rows; reorder takes PowerInfer files"
        )
    stats_in = Path(activation_dir) if activation_dir is not None else default_activation_dir(src)
    stats_out = default_activation_dir(dst)
    if stats_out.resolve() == stats_in.resolve():
        raise ValueError(
            f"{dst}: its statistics would go to {stats_out}, over the input's: write the output to another folder"
        )
    if any(stats_out.glob("activation_*.pt")):  # another model's, or an earlier run's: not ours to replace
        raise ValueError(
            f"{dst}: {stats_out} already holds activation statistics; write the output to another folder"
        )
    check_activation_dir(stats_out, [src, dst])
    counts = read_activation_files(stats_in, config.n_layer, config.n_ff)
    if counts is None:
        raise ValueError(
            f"no activation statistics in {stats_in}: run `hotcold profile -m MODEL -f corpus.txt` first"
        )
    orders = hottest_first(counts)
    rows = {}  # tensor name -> the layer's order: every tensor whose first axis is the layer's neurons
    for i, order in enumerate(orders):
        if names.tensor(names.FFN_DOWN, i) in mf.tensors:  # [D, F]: neurons are columns, not rows
            raise ValueError(
                f"{src}: layer {i} has {names.tensor(names.FFN_DOWN, i)} ([D, F]); reorder takes ffn_down_t files"
            )
        for template, suffix in (
            (names.FFN_UP, "weight"),
            (names.FFN_UP, "bias"),
            (names.FFN_GATE, "weight"),
            (names.FFN_DOWN_T, "weight"),
            (names.PRED_FC2, "weight"),
        ):
            name = names.tensor(template, i, suffix)
            if name in mf.tensors:
                if mf.tensors[name].shape[0] != config.n_ff:
                    raise ValueError(
                        f"{src}: {name} has {mf.tensors[name].shape[0]} rows, expected {config.n_ff}"
                    )
                rows[name] = order.numpy()

    def produce(entry, order=None):
        data = np.asarray(entry.data)
        return data if order is None else data[order]

    specs = [
        TensorSpec(e.name, e.shape, e.qtype, lambda e=e: produce(e, rows.get(e.name)))
        for e in mf.tensors.values()
    ]
    # the statistics are staged first, the model written, then both put in place one rename after the other:
    # a failure before that (a full disk, ^C) leaves neither, never a model beside part of its statistics
    with activation_dir_writer(stats_out, [src, dst]) as staging:
        save_activation_files([c[o] for c, o in zip(counts, orders, strict=True)], staging)
        write_model_file(dst, mf.architecture, metadata_items(mf), specs, sparse=True, inputs=[src])
    return dst
