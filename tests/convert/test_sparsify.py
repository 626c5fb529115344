"""convert/sparsify.py: calibration reaches its target on the calibration text, thresholds are the
quantiles an independent transformers pass finds, the output keeps every input tensor, adds ffn_down_t,
and bad inputs are refused before anything is written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

import hotcold
from hotcold.convert.sparsify import check_target, sparsify_file
from hotcold.gguf import names
from hotcold.gguf.io import ModelFile
from hotcold.kernels import cpu
from hotcold.placement.profile import corpus_tokens, read_corpus, token_windows, window_ctx


def _calibration_windows(llm, files):
    text = read_corpus(files.corpus)
    ids = corpus_tokens(llm.tokenizer, text, max_tokens=files.tokens, spread=True)
    return token_windows(ids, window_ctx(None, llm.config.n_ctx_train), llm.tokenizer.bos_id)


def test_calibration_hits_the_target_on_the_calibration_text(tiny_swiglu):
    llm = hotcold.load(tiny_swiglu.sparse["f16"], threads=1)
    for window in _calibration_windows(llm, tiny_swiglu):
        llm.logits(window)
    kept = [c.computed / c.total for c in llm.engine.seq.counts]
    assert abs(kept[0] - 0.5) < 0.01  # layer 0 sees exactly the calibration inputs
    assert abs(sum(kept) / len(kept) - 0.5) < 0.03  # later layers see the sparse model's own inputs


def test_thresholds_are_the_quantiles_transformers_finds(tiny_swiglu):
    """|silu(gate_proj(x))| of the fp32 transformers model on the same windows, quantile by torch."""
    llm = hotcold.load(tiny_swiglu.dense["f16"], threads=1)
    windows = _calibration_windows(llm, tiny_swiglu)
    hf = tiny_swiglu.hf
    scores = [[] for _ in hf.model.layers]
    hooks = [
        layer.mlp.act_fn.register_forward_hook(lambda m, i, o, j=j: scores[j].append(o.abs().flatten()))
        for j, layer in enumerate(hf.model.layers)
    ]
    with torch.no_grad():
        for w in windows:
            hf(input_ids=torch.tensor([w]))
    for h in hooks:
        h.remove()
    thresholds = ModelFile(tiny_swiglu.sparse["f16"]).metadata[names.SPARSIFY_THRESHOLDS]
    for j, t in enumerate(thresholds):
        want = float(torch.cat(scores[j]).quantile(0.5))
        assert abs(t - want) < 0.01 * want, (j, t, want)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_output_keeps_the_input_and_adds_down_t(tiny_swiglu, outtype):
    src, out = ModelFile(tiny_swiglu.dense[outtype]), ModelFile(tiny_swiglu.sparse[outtype])
    for name, e in src.tensors.items():
        assert out.tensors[name].qtype == e.qtype and np.array_equal(out.tensors[name].data, e.data), name
    for key, value in src.metadata.items():
        assert out.metadata[key] == value, key
    c = hotcold.load(tiny_swiglu.dense[outtype]).config
    for i in range(c.n_layer):
        down = src.tensor(names.tensor(names.FFN_DOWN, i))
        down_t = out.tensor(names.tensor(names.FFN_DOWN_T, i))
        # the default (auto) for both: Q8_0, for F16 the gguf package's quantization of the transpose, for Q8_0
        # re-quantized along the neuron's row
        assert out.entry(names.tensor(names.FFN_DOWN_T, i)).qtype == Q.Q8_0
        if outtype == "f16":
            want = gguf_quantize(down.t().float().contiguous().numpy(), Q.Q8_0)
            assert np.array_equal(
                out.entry(names.tensor(names.FFN_DOWN_T, i)).data.reshape(-1), want.reshape(-1)
            )
        else:
            a, b = cpu.dequantize_rows(down_t), cpu.dequantize_rows(down).t()
            assert (a - b).abs().max() < 0.02 * b.abs().max()
    # the up rows the decode gathers: a Q8_0 copy of an F16 file's up, none where up already is Q8_0
    assert (names.tensor(names.FFN_UP_ROWS, 0) in out.tensors) == (outtype == "f16")
    assert names.tensor(names.FFN_GATE_ROWS, 0) not in out.tensors  # no probe in this fixture
    assert out.entry(names.SPARSIFY_QUANTILES).shape == (c.n_layer, 101)
    assert out.entry(names.SPARSIFY_FREQUENCY).shape == (c.n_layer, c.n_ff)
    freq = out.tensor(names.SPARSIFY_FREQUENCY)
    assert abs(float(freq.mean()) - 0.5) < 0.03 and float(freq.min()) >= 0 and float(freq.max()) <= 1
    assert not out.is_sparse  # stays a GGUF file


def test_wina_and_transpose_types(tiny_swiglu, tmp_path):
    out = tmp_path / "wina.gguf"
    r = sparsify_file(
        tiny_swiglu.dense["q8_0"],
        out,
        tiny_swiglu.corpus,
        sparsity=0.4,
        method="wina",
        max_tokens=800,
        transposes="f16",
    )
    assert r["ffn_down_t_type"] == "F16" and abs(r["calibration_sparsity"] - 0.4) < 0.03
    mf = ModelFile(out)
    assert names.tensor(names.FFN_UP_ROWS, 0) not in mf.tensors  # F16 rows would read more than Q8_0 ones
    assert mf.metadata[names.SPARSIFY_METHOD] == "wina"
    assert mf.entry(names.SPARSIFY_SCALE).shape == (2, 1280)
    llm = hotcold.load(out, threads=1)
    llm.generate("Line 3", max_tokens=8, ignore_eos=True)
    assert 0.45 < llm.last_stats.firing_rate < 0.75


def test_refusals(tiny_swiglu, tiny_dense_gguf, tiny_sparse_gguf, tmp_path):
    dense, corpus = tiny_swiglu.dense["f16"], tiny_swiglu.corpus
    out = tmp_path / "out.gguf"
    for bad in (0, 0.0, 1.0, -0.2, float("nan"), True):
        with pytest.raises(ValueError, match="sparsity"):
            sparsify_file(dense, out, corpus, sparsity=bad)
    with pytest.raises(ValueError, match="PowerInfer"):
        sparsify_file(tiny_sparse_gguf, out, corpus, sparsity=0.5)
    with pytest.raises(ValueError, match="SwiGLU"):
        sparsify_file(tiny_dense_gguf, out, corpus, sparsity=0.5)  # a dense ReLU file
    with pytest.raises(ValueError, match="already written by `hotcold sparsify`"):
        sparsify_file(tiny_swiglu.sparse["f16"], out, corpus, sparsity=0.5)
    with pytest.raises(ValueError, match="no such file"):
        sparsify_file(dense, out, tmp_path / "missing.txt", sparsity=0.5)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        sparsify_file(dense, out, tmp_path / "empty.txt", sparsity=0.5)
    with pytest.raises(ValueError, match="method"):
        sparsify_file(dense, out, corpus, sparsity=0.5, method="teal")
    with pytest.raises(ValueError, match="transpose-type"):
        sparsify_file(dense, out, corpus, sparsity=0.5, transposes="q3")
    with pytest.raises(OSError, match="overwritten"):
        sparsify_file(dense, dense, corpus, sparsity=0.5)
    link = tmp_path / "link.gguf"
    os.symlink(dense, link)
    with pytest.raises(OSError, match="overwritten"):
        sparsify_file(dense, link, corpus, sparsity=0.5)
    with pytest.raises(OSError, match="overwritten"):
        sparsify_file(dense, corpus, corpus, sparsity=0.5)
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_check_target():
    assert check_target(0.5) == 0.5
    with pytest.raises(ValueError):
        check_target("0.5")


def test_transpose_type():
    from hotcold.convert.sparsify_inputs import transpose_type

    for source in (Q.F32, Q.F16, Q.BF16):
        assert transpose_type(source, "auto", 2048) == Q.Q8_0  # measured: no perplexity cost (RESULTS)
        assert transpose_type(source, "same", 2048) == source
    assert transpose_type(Q.Q4_0, "auto", 2048) == Q.Q4_0  # a block type keeps its type
    assert transpose_type(Q.F16, "q4_k", 2048) == Q.Q4_K
    assert transpose_type(Q.F16, "auto", 100) == Q.F16  # 32 does not divide a row of 100
    assert transpose_type(Q.Q4_K, "same", 2080) == Q.F16  # 256 does not divide 2080
    with pytest.raises(ValueError, match="transpose-type"):
        transpose_type(Q.F16, "q3", 2048)


def test_gate_inputs_calibration_hits_the_target(tiny_swiglu, tmp_path):
    """--gate-probe inputs: the neuron thresholds are calibrated on the gate the file runs (from the kept input
    channels), so layer 0, which sees exactly the calibration inputs, keeps the target share of neurons."""
    out = tmp_path / "gate_inputs.gguf"
    sparsify_file(
        tiny_swiglu.dense["f16"], out, tiny_swiglu.corpus, sparsity=0.5, max_tokens=tiny_swiglu.tokens,
        probe="inputs", transposes="same",
    )  # fmt: skip
    llm = hotcold.load(out, threads=1)
    for window in _calibration_windows(llm, tiny_swiglu):
        llm.logits(window)
    kept = [c.computed / c.total for c in llm.engine.seq.counts]
    assert abs(kept[0] - 0.5) < 0.01, kept
