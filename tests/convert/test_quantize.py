"""hotcold quantize and files laid out as PowerInfer's tools lay them out."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import hotcold
from hotcold.cli import main
from hotcold.convert.quantize import quantize_file, tensor_types
from hotcold.gguf import names, quants
from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file

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


# block formats: the CPU kernels quantize activations to int8 per 32 values (integer dot products, as
# llama.cpp), which adds about 2% of the largest logit here on top of the weights' own error
@pytest.mark.parametrize("outtype, rel_tol", [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 4e-2), ("q4_0", 0.6)])
def test_quantized_sparse_model_runs_close_to_f32(tmp_path, tiny_sparse_gguf, outtype, rel_tol):
    out = quantize_file(tiny_sparse_gguf, tmp_path / f"m.{outtype}.gguf", outtype)
    mf = ModelFile(out)
    assert mf.is_sparse  # the PWRI magic survives, as with PowerInfer's quantize
    assert mf.entry("blk.0.ffn_down_t.weight").qtype == Q[outtype.upper()]
    quantized = outtype in ("q8_0", "q4_0")
    # float predictors become Q8_0 for a block target where 32 divides their rows (fc1: n_embd 64), else F16
    # (fc2: rank 16); float targets convert them
    assert mf.entry("blk.0.fc1.weight").qtype == (Q.Q8_0 if quantized else Q[outtype.upper()])
    assert mf.entry("blk.0.fc2.weight").qtype == (Q.F16 if quantized else Q[outtype.upper()])
    # llama.cpp's output rule: Q6_K for a block target, Q8_0 where 256 does not divide the row (64 here)
    assert mf.entry("output.weight").qtype == (Q.Q8_0 if quantized else Q[outtype.upper()])
    assert mf.entry("blk.0.attn_norm.weight").qtype == Q.F32
    ref = hotcold.load(tiny_sparse_gguf, device="cpu", dense=True).logits(IDS)
    got = hotcold.load(out, device="cpu", dense=True).logits(IDS)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= rel_tol * ref.abs().max()  # quantization error, loosely bounded
    # the file computes what its dequantized F32 twin computes: exactly for float types; for block formats
    # up to the kernels' int8 activations (dense only: with random predictors those flip near-threshold
    # firing decisions; test_k_quant_model_runs_dense_and_sparse checks the sparse path with all firing)
    twin = dequantized_copy(out, tmp_path / "twin.gguf")
    for dense in (True, False) if not quantized else (True,):
        a = hotcold.load(out, device="cpu", dense=dense).logits(IDS)
        b = hotcold.load(twin, device="cpu", dense=dense).logits(IDS)
        assert (a - b).abs().max() <= (4e-2 if quantized else 1e-4) * b.abs().max(), f"dense={dense}"


def test_quantize_cli_and_errors(tmp_path, tiny_dense_gguf, capsys):
    assert main(["quantize", str(tiny_dense_gguf), str(tmp_path / "q.gguf"), "q8_0"]) == 0
    assert ModelFile(tmp_path / "q.gguf").metadata["general.file_type"] == 7
    assert main(["quantize", str(tiny_dense_gguf), str(tmp_path / "x.gguf"), "q7_k"]) == 1
    err = capsys.readouterr().err
    assert "'q7_k' is not one of" in err and "q4_k_m" in err and "Traceback" not in err
    assert main(["quantize", str(tmp_path / "missing.gguf"), str(tmp_path / "y.gguf"), "q4_0"]) == 1
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()
    # NaN in a weight: one line naming the tensor, no output file, no temp file left
    mf = ModelFile(tiny_dense_gguf)
    specs = []
    for e in mf.tensors.values():
        values = np.array(e.data, dtype=np.float32)
        if e.name == "blk.1.ffn_up.weight":
            values[3, 5] = np.nan
        specs.append(TensorSpec(e.name, e.shape, Q.F32, lambda v=values: v))
    bad = write_model_file(tmp_path / "nan.gguf", mf.architecture, metadata_items(mf), specs)
    capsys.readouterr()
    assert main(["quantize", str(bad), str(tmp_path / "z.gguf"), "Q4_K_M"]) == 1
    err = capsys.readouterr().err
    assert "tensor blk.1.ffn_up.weight" in err and "NaN or inf" in err and "Traceback" not in err
    assert not (tmp_path / "z.gguf").exists() and not list(tmp_path.glob(".*.tmp"))


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


@pytest.mark.parametrize("predictor_type", ["q8_0", "q4_0"])
def test_predictor_type(tmp_path, rank32_sparse_gguf, predictor_type, capsys):
    """--predictor-type quantizes fc1 / fc2 (as the original's quantize does); the predictor then selects
    the neurons its dequantized F32 twin selects, up to the int8 activations of the integer kernels."""
    out = tmp_path / f"m.{predictor_type}.gguf"
    argv = ["quantize", str(rank32_sparse_gguf), str(out), "q8_0", "--predictor-type", predictor_type]
    assert main(argv) == 0
    mf = ModelFile(out)
    assert mf.is_sparse
    for name in ("blk.0.fc1.weight", "blk.1.fc2.weight"):
        assert mf.entry(name).qtype == Q[predictor_type.upper()]
    assert mf.entry("blk.0.ffn_down_t.weight").qtype == Q.Q8_0
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    twin = hotcold.load(dequantized_copy(out, tmp_path / "twin.gguf"), device="cpu")
    llm = hotcold.load(out, device="cpu")
    for layer in range(2):
        got = llm.loaded.model.layers[layer].ffn.predictor(x)
        want = twin.loaded.model.layers[layer].ffn.predictor(x)
        assert got.shape == want.shape == (5, 1280)
        assert 0.05 < want.float().mean() < 0.95  # a real selection, not all or nothing
        assert (got != want).float().mean() < 0.02  # only logits within rounding of the threshold flip
    assert isinstance(llm.generate("Line 1", max_tokens=4, ignore_eos=True), str)
    # refused, one line each: a mixture name, and a dense file (nothing to quantize)
    assert (
        main(
            [
                "quantize",
                str(rank32_sparse_gguf),
                str(tmp_path / "a.gguf"),
                "q8_0",
                "--predictor-type",
                "q4_k_m",
            ]
        )
        == 1
    )
    assert "predictor type 'q4_k_m'" in capsys.readouterr().err


def test_default_predictor_types(tmp_path, tiny_sparse_gguf, rank32_sparse_gguf):
    """Block targets: float predictors -> Q8_0 where 32 divides the row (else F16), block ones stay; "keep"
    is the old rule (own type, F32 as F16); float targets convert them."""
    mf = ModelFile(tiny_sparse_gguf)  # F32 predictors, fc1 rows of 64, fc2 rows of 16 (rank)
    default, keep = tensor_types(mf, "q4_0"), tensor_types(mf, "q4_0", "keep")
    assert (default["blk.0.fc1.weight"], default["blk.0.fc2.weight"]) == (Q.Q8_0, Q.F16)
    assert keep["blk.0.fc1.weight"] == keep["blk.0.fc2.weight"] == Q.F16
    assert tensor_types(mf, "bf16")["blk.1.fc1.weight"] == Q.BF16
    q4_preds = powerinfer_layout(
        ModelFile(rank32_sparse_gguf), tmp_path / "pi.gguf", matrix_type=Q.F16, predictor_type=Q.Q4_0
    )
    assert tensor_types(ModelFile(q4_preds), "q4_k_m")["blk.1.fc2.weight"] == Q.Q4_0


def test_predictor_type_needs_a_powerinfer_file(tmp_path, tiny_dense_gguf, capsys):
    argv = ["quantize", str(tiny_dense_gguf), str(tmp_path / "b.gguf"), "q8_0", "--predictor-type", "q8_0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "has no predictors" in err and "Traceback" not in err and not (tmp_path / "b.gguf").exists()


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
    tol = {Q.F16: 2e-3, Q.Q8_0: 4e-2, Q.Q4_0: 0.6}[matrix_type]  # block formats: int8 activations too
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


# --- K-quants and llama.cpp's mixtures -----------------------------------------------------------
LAYERS = 8
MORE_BITS = {0, 3, 6, 7}  # llama.cpp's use_more_bits(i, 8): the first and last eighth, then every third
LLAMA_BIN = Path(
    os.environ.get("HOTCOLD_LLAMA_BIN", Path.home() / ".cache/hotcold-anchors/llama.cpp/build/bin")
)


def llama_quantize() -> Path | None:
    exe = LLAMA_BIN / "llama-quantize"
    if exe.exists():
        return exe
    found = shutil.which("llama-quantize")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def wide(tmp_path_factory, spm_model_file):
    """A tiny llama whose rows are multiples of 256, so that the K-quants apply (8 layers, GQA 2): dense F32,
    dense F16 (what llama-quantize is given) and the PowerInfer layout (rank-32 predictors that let
    every neuron fire)."""
    from hotcold.convert import convert
    from tests.fixtures import make_llama, write_predictors

    folder = tmp_path_factory.mktemp("wide")
    dims = dict(hidden_size=256, intermediate_size=1280, num_hidden_layers=LAYERS)
    make_llama(folder / "hf", spm_model_file, num_attention_heads=4, num_key_value_heads=2, **dims)
    write_predictors(folder / "pred", LAYERS, 256, 1280, rank=32, all_fire=True)
    return SimpleNamespace(
        dense=convert(folder / "hf", None, folder / "dense.gguf", outtype="f32"),
        f16=convert(folder / "hf", None, folder / "dense.f16.gguf", outtype="f16"),
        sparse=convert(folder / "hf", folder / "pred", folder / "sparse.gguf", outtype="f32"),
    )


def expected_q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M for this model, written out: output Q6_K, attn_v and ffn_down (ffn_down_t
    too) Q6_K in the use_more_bits layers, predictors Q8_0 (hotcold's rule), norms F32, the rest Q4_K."""
    if name.endswith("norm.weight"):
        return Q.F32
    if name == "output.weight":
        return Q.Q6_K
    if (".attn_v." in name or ".ffn_down" in name) and names.block_of(name) in MORE_BITS:
        return Q.Q6_K
    if ".fc1." in name or ".fc2." in name:
        return Q.Q8_0
    return Q.Q4_K


def test_q4_k_m_type_map(tmp_path, wide):
    for path in (wide.dense, wide.sparse):
        mf = ModelFile(path)
        assert tensor_types(mf, "Q4_K_M") == {n: expected_q4_k_m(n) for n in mf.tensors}
    out = ModelFile(quantize_file(wide.sparse, tmp_path / "s.gguf", "Q4_K_M"))
    assert out.is_sparse and out.metadata["general.file_type"] == 15
    assert {e.name: e.qtype for e in out.tensors.values()} == {n: expected_q4_k_m(n) for n in out.tensors}
    # Q2_K with GQA < 4: attn_v, ffn_down and attn_output one step up, in every layer
    q2 = tensor_types(ModelFile(wide.dense), "q2_k")
    assert (
        q2["blk.5.attn_v.weight"] == q2["blk.5.ffn_down.weight"] == q2["blk.5.attn_output.weight"] == Q.Q3_K
    )
    assert q2["blk.5.attn_q.weight"] == q2["token_embd.weight"] == Q.Q2_K and q2["output.weight"] == Q.Q6_K


def test_rows_no_block_divides_fall_back_as_llama_cpp(tiny_sparse_gguf):
    """n_embd 64: Q4_K -> Q5_0 and Q6_K -> Q8_0 (tensor_type_fallback); the output's rule gives Q8_0."""
    types = tensor_types(ModelFile(tiny_sparse_gguf), "q4_k_m")
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == Q.Q5_0
    assert types["blk.1.ffn_down_t.weight"] == Q.Q8_0  # layer 1 of 2 takes more bits: Q6_K, then Q8_0
    assert types["blk.0.ffn_down_t.weight"] == Q.Q5_0 and types["output.weight"] == Q.Q8_0
    assert types["blk.0.fc2.weight"] == Q.F16 and types["blk.0.attn_norm.weight"] == Q.F32


# the weights' quantization error in the logits of this random 8-layer model (which amplifies it), measured
# as a fraction of the largest logit: Q6_K 0.09, Q4_K_M 0.43 (Q8_0 0.03)
@pytest.mark.parametrize("outtype, rel_tol", [("q6_k", 0.15), ("q4_k_m", 0.6)])
def test_k_quant_model_runs_dense_and_sparse(tmp_path, wide, outtype, rel_tol):
    out = quantize_file(wide.sparse, tmp_path / f"m.{outtype}.gguf", outtype)
    twin = dequantized_copy(out, tmp_path / "twin.gguf")  # the quantized weights, expanded to F32
    ref = hotcold.load(wide.sparse, device="cpu", dense=True).logits(IDS)
    exact = hotcold.load(twin, device="cpu", dense=True).logits(IDS)
    assert (exact - ref).abs().max() <= rel_tol * ref.abs().max()
    for dense in (True, False):  # every neuron fires (fc2 = 0), so sparse and dense compute the same sums
        llm = hotcold.load(out, device="cpu", dense=dense)
        got = llm.logits(IDS)
        assert torch.isfinite(got).all()
        # the file's K-quant bytes mean those weights (read by the kernels), up to their int8 activations
        assert (got - exact).abs().max() <= 4e-2 * exact.abs().max(), f"dense={dense}"
        assert isinstance(llm.generate("Line 1", max_tokens=4, ignore_eos=True), str)


def assert_same_file_as_llama_quantize(src: Path, ftype: str, tmp_path: Path) -> None:
    """The whole file, tensor by tensor: the same types and the same bytes as llama-quantize's."""
    exe = llama_quantize()
    theirs = tmp_path / f"llama.{ftype}.gguf"
    env = dict(os.environ, LD_LIBRARY_PATH=str(exe.parent))
    run = subprocess.run(
        [str(exe), str(src), str(theirs), ftype.upper(), "2"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    ours = ModelFile(quantize_file(src, tmp_path / f"ours.{ftype}.gguf", ftype))
    ref = ModelFile(theirs)
    assert set(ours.tensors) == set(ref.tensors)
    assert ours.metadata["general.file_type"] == ref.metadata["general.file_type"]
    for name, e in ours.tensors.items():
        r = ref.tensors[name]
        assert e.qtype == r.qtype, f"{ftype} {name}: {e.qtype.name}, llama-quantize {r.qtype.name}"
        a, b = (np.ascontiguousarray(t.data).view(np.uint8).reshape(-1) for t in (e, r))
        assert np.array_equal(a, b), f"{ftype} {name} ({e.qtype.name}): bytes differ from llama-quantize's"


needs_llama = pytest.mark.skipif(llama_quantize() is None, reason="llama.cpp's llama-quantize is not built")


@needs_llama
@pytest.mark.parametrize(
    "ftype",
    ["q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m", "q3_k_s", "q2_k"]
    + ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"],
)
def test_same_file_as_llama_quantize(tmp_path, wide, ftype):
    assert_same_file_as_llama_quantize(wide.f16, ftype, tmp_path)


@needs_llama
def test_falcon_and_mixtral_files_as_llama_quantize(tmp_path, spm_model_file):
    """Falcon's rules (output Q8_0, fused attn_qkv as attn_v, its own ffn_down mixes) and the 8-expert
    rules (attn_v/attn_k Q8_0, attn_output Q5_K, stacked [E, F, D] experts, router kept F32)."""
    from hotcold.convert import convert
    from tests.models.test_falcon import make_falcon
    from tests.models.test_mixtral import make_mixtral

    make_falcon(
        tmp_path / "falcon", spm_model_file, hidden_size=256, ffn_hidden_size=256, num_hidden_layers=16
    )
    make_mixtral(
        tmp_path / "mixtral",
        spm_model_file,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=8,
        num_local_experts=8,
    )
    for family in ("falcon", "mixtral"):
        src = convert(tmp_path / family, None, tmp_path / f"{family}.gguf", outtype="f16")
        for ftype in ("q4_k_m", "q3_k_m", "q3_k_l"):  # the ftypes with Falcon- and 8-expert-specific rules
            assert_same_file_as_llama_quantize(src, ftype, tmp_path)
