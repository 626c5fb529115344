"""hotcold quantize and files laid out as PowerInfer's tools lay them out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import hotcold
from hotcold import quants
from hotcold.cli import main
from hotcold.convert.quantize import quantize_file
from hotcold.gguf_io import ModelFile, TensorSpec, metadata_items, write_model_file

IDS = list(range(3, 35))


def dequantized_copy(src, dst):
    """The same model with every tensor expanded to F32: what a quantized file means, exactly."""
    mf = ModelFile(src)
    specs = []
    for e in mf.tensors.values():
        value = (
            quants.dequantize(torch.from_numpy(np.asarray(e.data)), e.qtype, e.shape)
            if quants.is_quantized(e.qtype)
            else None
        )
        if value is None:
            value = (
                torch.from_numpy(np.asarray(e.data)).view(torch.bfloat16)
                if e.qtype == Q.BF16
                else torch.from_numpy(np.asarray(e.data))
            )
        values = value.float().reshape(e.shape).numpy()
        specs.append(TensorSpec(e.name, e.shape, Q.F32, lambda v=values: v))
    write_model_file(dst, mf.architecture, metadata_items(mf), specs, sparse=mf.is_sparse)
    return dst


@pytest.mark.parametrize("outtype, rel_tol", [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 2e-2), ("q4_0", 0.6)])
def test_quantized_sparse_model_runs_close_to_f32(tmp_path, tiny_sparse_gguf, outtype, rel_tol):
    out = quantize_file(tiny_sparse_gguf, tmp_path / f"m.{outtype}.gguf", outtype)
    mf = ModelFile(out)
    assert mf.is_sparse  # the PWRI magic survives, as with PowerInfer's quantize
    assert mf.entry("blk.0.ffn_down_t.weight").qtype == Q[outtype.upper()]
    assert mf.entry("blk.0.fc1.weight").qtype == Q[outtype.upper()]
    assert mf.entry("blk.0.fc2.weight").qtype == (
        Q.F16 if outtype in ("q8_0", "q4_0") else Q[outtype.upper()]
    )  # rank 16: no whole block
    assert mf.entry("blk.0.attn_norm.weight").qtype == Q.F32
    ref = hotcold.load(tiny_sparse_gguf, device="cpu", dense=True).logits(IDS)
    got = hotcold.load(out, device="cpu", dense=True).logits(IDS)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= rel_tol * ref.abs().max()  # quantization error, loosely bounded
    # exact execution: the quantized file computes what its dequantized F32 twin computes, dense and sparse
    twin = dequantized_copy(out, tmp_path / "twin.gguf")
    for dense in (True, False):
        a = hotcold.load(out, device="cpu", dense=dense).logits(IDS)
        b = hotcold.load(twin, device="cpu", dense=dense).logits(IDS)
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), f"dense={dense}"


def test_quantize_cli_and_errors(tmp_path, tiny_dense_gguf, capsys):
    assert main(["quantize", str(tiny_dense_gguf), str(tmp_path / "q.gguf"), "q8_0"]) == 0
    assert ModelFile(tmp_path / "q.gguf").metadata["general.file_type"] == 7
    assert main(["quantize", str(tiny_dense_gguf), str(tmp_path / "x.gguf"), "q3_k"]) == 1
    assert "q3_k" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "missing.gguf"), str(tmp_path / "y.gguf"), "q4_0"]) == 1
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


def powerinfer_layout(src: ModelFile, dst, *, matrix_type: Q, predictor_type: Q):
    """Rewrite a hotcold file the way PowerInfer's convert.py + quantize lay theirs out: model tensors first,
    predictors last, no rope.freq_base key (transformers 5 moved rope_theta), general.name from the folder,
    predictors in their own type (quantize makes them Q5_0 for any target but Q4_0)."""
    meta = [
        m for m in metadata_items(src) if not m[0].endswith("rope.freq_base") and m[0] != "general.file_type"
    ]
    meta.append(("general.file_type", {Q.F16: 1, Q.Q4_0: 2, Q.Q8_0: 7}[matrix_type], V.UINT32))
    model, predictors = [], []
    for e in src.tensors.values():
        target = predictors if ".fc1." in e.name or ".fc2." in e.name else model
        if len(e.shape) < 2:
            target.append(TensorSpec(e.name, e.shape, Q.F32, lambda e=e: e.data))
            continue
        qtype = predictor_type if target is predictors else matrix_type
        values = torch.from_numpy(np.asarray(e.data, dtype=np.float32))
        target.append(
            TensorSpec(
                e.name,
                e.shape,
                qtype,
                lambda v=values, q=qtype: (
                    quants.quantize(v, q) if quants.is_quantized(q) else v.half().numpy()
                ),
            )
        )
    write_model_file(dst, src.architecture, meta, model + predictors, sparse=True)
    return dst


@pytest.fixture(scope="module")
def rank32_sparse_gguf(tmp_path_factory, spm_model_file):
    """Predictor rank 32, so PowerInfer's quantize can put predictors in a block format too."""
    from hotcold.convert import convert
    from tests.fixtures import make_llama, write_predictors

    folder = tmp_path_factory.mktemp("rank32")
    make_llama(folder / "hf", spm_model_file)
    write_predictors(folder / "pred", 2, 64, 1280, rank=32)
    return convert(folder / "hf", folder / "pred", folder / "m.powerinfer.gguf", outtype="f32")


@pytest.mark.parametrize("matrix_type, predictor_type", [(Q.F16, Q.F16), (Q.Q4_0, Q.Q4_0), (Q.Q8_0, Q.Q5_0)])
def test_runs_files_laid_out_like_powerinfer(tmp_path, rank32_sparse_gguf, matrix_type, predictor_type):
    tiny_sparse_gguf = rank32_sparse_gguf
    path = powerinfer_layout(
        ModelFile(tiny_sparse_gguf),
        tmp_path / "pi.gguf",
        matrix_type=matrix_type,
        predictor_type=predictor_type,
    )
    mf = ModelFile(path)
    assert "llama.rope.freq_base" not in mf.metadata  # runtime default 10000 applies
    assert mf.entry("blk.1.fc1.weight").qtype == predictor_type
    names = list(mf.tensors)
    assert names.index("blk.0.fc1.weight") > names.index("output.weight")
    llm = hotcold.load(path, device="cpu")
    assert llm.config.rope_base == 10000.0
    ref = hotcold.load(tiny_sparse_gguf, device="cpu", dense=True).logits(IDS)
    got = hotcold.load(path, device="cpu", dense=True).logits(IDS)
    tol = {Q.F16: 2e-3, Q.Q8_0: 2e-2, Q.Q4_0: 0.6}[matrix_type]
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    text = llm.generate("Line 1", max_tokens=8, ignore_eos=True)
    assert isinstance(text, str)


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_quantize_over_its_input_is_refused(tmp_path, tiny_dense_gguf, capsys, how):
    import os
    import shutil

    src = tmp_path / "m.gguf"
    shutil.copy(tiny_dense_gguf, src)
    before = src.read_bytes()
    out = src if how == "same" else tmp_path / "q.gguf"
    if how == "symlink":
        out.symlink_to(src)
    elif how == "hardlink":
        os.link(src, out)
    code = main(["quantize", str(src), str(out), "q8_0"])
    err = capsys.readouterr().err
    assert code == 1 and "would be overwritten" in err and "Traceback" not in err
    assert src.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))
