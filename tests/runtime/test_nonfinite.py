"""NaN weights never pass silently (#47 D9): a NaN/inf norm or bias is refused at load naming the tensor (1-D
float tensors are scanned at every load); NaN in a matrix makes the logits non-finite, and generation stops
with an error naming the problem and the first layer whose values go bad, instead of printing "⁇" with
exit 0. The matrices are not scanned at load (GBs at every load would be too slow)."""

from __future__ import annotations

import numpy as np
import pytest

import hotcold
from hotcold.cli import main
from hotcold.gguf.io import GGUFError, ModelFile, TensorSpec, metadata_items, write_model_file
from hotcold.runtime.generation import NonFiniteLogits


def with_nan(src, dst, name: str, value=np.nan):
    """A copy of the model file src with one value of tensor `name` set to NaN (or `value`)."""
    mf = ModelFile(src)

    def produce(entry):
        data = np.array(entry.data)
        if entry.name == name:
            data.reshape(-1)[0] = value
        return data

    specs = [TensorSpec(e.name, e.shape, e.qtype, lambda e=e: produce(e)) for e in mf.tensors.values()]
    return write_model_file(dst, mf.architecture, metadata_items(mf), specs, sparse=mf.is_sparse)


@pytest.mark.parametrize("name", ["blk.1.attn_norm.weight", "output_norm.weight"])
def test_a_nan_norm_is_refused_at_load(tiny_dense_gguf, tmp_path, capsys, name):
    bad = with_nan(tiny_dense_gguf, tmp_path / "nan.gguf", name)
    with pytest.raises(GGUFError, match=f"tensor {name} holds 1 NaN/inf of its 64 values"):
        hotcold.load(bad)
    assert main(["generate", "-m", str(bad), "-p", "Once", "-n", "4"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"nan.gguf: tensor {name} holds 1 NaN/inf" in err


@pytest.mark.parametrize(
    "name, where",
    [
        ("blk.1.attn_q.weight", "layer 1's FFN input (from blk.1's attention or blk.0's FFN)"),
        ("blk.0.ffn_up.weight", "layer 0's FFN activations"),
        ("output.weight", "the output head"),
    ],
)
def test_nan_in_a_matrix_stops_generation_naming_the_layer(tiny_dense_gguf, tmp_path, capsys, name, where):
    bad = with_nan(tiny_dense_gguf, tmp_path / "nan.gguf", name)
    llm = hotcold.load(bad)  # matrices are not scanned at load
    with pytest.raises(NonFiniteLogits, match="logits are NaN at generated token 1") as caught:
        llm.generate("Once upon a time", max_tokens=8, temperature=0.0)
    assert where in str(caught.value)
    assert main(["generate", "-m", str(bad), "-p", "Once upon a time", "-n", "8", "--temp", "0"]) == 1
    out, err = capsys.readouterr()
    assert "⁇" not in out and "Traceback" not in err
    assert "hotcold: error: the model's logits are NaN at generated token 1" in err and where in err


def test_infinite_logits_are_named_too(tiny_dense_gguf, tmp_path):
    bad = with_nan(tiny_dense_gguf, tmp_path / "inf.gguf", "output.weight", value=np.inf)
    with pytest.raises(NonFiniteLogits, match="logits are (infinite|NaN)"):
        hotcold.load(bad).generate("Once upon a time", max_tokens=4)


def test_the_sparse_path_checks_too(tiny_sparse_gguf, tmp_path):
    bad = with_nan(tiny_sparse_gguf, tmp_path / "nan.powerinfer.gguf", "blk.1.attn_k.weight")
    with pytest.raises(NonFiniteLogits, match="layer 1's FFN input"):
        hotcold.load(bad).generate("Once upon a time", max_tokens=4)
    llm = hotcold.load(tiny_sparse_gguf)
    assert llm.generate("Once upon a time", max_tokens=4, temperature=0.0)  # finite models are untouched
