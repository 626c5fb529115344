"""Requantize a GGUF / PowerInfer file: `hotcold quantize IN OUT TYPE`, with llama.cpp's type names.

Which tensor gets which type follows llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) without
an importance matrix: the *_M / *_S mixtures (Q4_K_M: output and some attn_v / ffn_down in Q6_K, ...),
the output rule (Q6_K, or Q8_0 for Falcon), rows a block does not divide falling back as llama.cpp does
(Q4_K -> Q5_0, ..., then F16), and only matrices named `*.weight` quantized (norms, 1-D tensors, the
MoE router and position embeddings are copied as they are). On a `llama-quantize` input the type map
is the same as llama-quantize's (tests/convert/test_quantize.py checks it against the binary).

PowerInfer files (PWRI) keep their magic and layout: `ffn_down_t` ([F, D], one row per neuron) takes
the type ffn_down would get in that layer; float predictors (fc1, fc2) become Q8_0 for a block-format
target (F16 where 32 does not divide a row; block-format ones keep their type), the target type for a
float one. The sparse step's accuracy rests on them: on the demo model Q8_0 predictors select as F16
ones do (recall 0.9851 against 0.9852, same perplexity) and decode 1.07-1.12x faster, where the
original's Q4_0 loses ~3 points of recall. `predictor_type` (`--predictor-type`) names another type,
or "keep" (a block-format target then leaves them in their own type, F32 ones as F16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm import tqdm

from hotcold.atomic import check_output
from hotcold.convert import encode
from hotcold.convert.statistics import CARRY, StatisticsPlan, plan_statistics
from hotcold.gguf import names, quants
from hotcold.gguf.io import ModelFile, TensorEntry, TensorSpec, as_torch, metadata_items, write_model_file
from hotcold.kernels import cpu
from hotcold.placement.profile import activation_dir_writer

F = LlamaFileType
# llama.cpp's type names (llama-quantize's QUANT_OPTIONS) -> (general.file_type, default tensor type)
FTYPES: dict[str, tuple[LlamaFileType, Q]] = {
    "f32": (F.ALL_F32, Q.F32),
    "f16": (F.MOSTLY_F16, Q.F16),
    "bf16": (F.MOSTLY_BF16, Q.BF16),
    "q8_0": (F.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (F.MOSTLY_Q4_0, Q.Q4_0),
    "q4_1": (F.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (F.MOSTLY_Q5_0, Q.Q5_0),
    "q5_1": (F.MOSTLY_Q5_1, Q.Q5_1),
    "q2_k": (F.MOSTLY_Q2_K, Q.Q2_K),
    "q3_k_s": (F.MOSTLY_Q3_K_S, Q.Q3_K),
    "q3_k_m": (F.MOSTLY_Q3_K_M, Q.Q3_K),
    "q3_k_l": (F.MOSTLY_Q3_K_L, Q.Q3_K),
    "q4_k_s": (F.MOSTLY_Q4_K_S, Q.Q4_K),
    "q4_k_m": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_s": (F.MOSTLY_Q5_K_S, Q.Q5_K),
    "q5_k_m": (F.MOSTLY_Q5_K_M, Q.Q5_K),
    "q6_k": (F.MOSTLY_Q6_K, Q.Q6_K),
    "mxfp4_moe": (F.MOSTLY_MXFP4_MOE, Q.MXFP4),  # stacked experts MXFP4, every other matrix Q8_0 (gpt-oss)
}
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}  # as llama-quantize reads them
# types a PowerInfer file's predictors may be given (one type each, no mixture), and "keep"
PREDICTOR_TYPES = ("keep", "f32", "f16", "bf16", "q8_0", "q6_k", "q5_1", "q5_0", "q4_1", "q4_0")
DEFAULT_BLOCK_PREDICTOR_TYPE = Q.Q8_0  # a block-format target's predictors, unless predictor_type says
# a row length the target's block does not divide (llama.cpp's tensor_type_fallback); then F16
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def ftype_of(outtype: str) -> str:
    """A user's type name -> the key of FTYPES (case-insensitive, llama.cpp's aliases); ValueError otherwise."""
    key = outtype.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FTYPES:
        raise ValueError(f"quantize: type {outtype!r} is not one of {', '.join(FTYPES)}")
    return key


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's rules look at, from the file's metadata."""

    arch: str
    n_layer: int
    n_expert: int
    n_gqa: int
    is_70b: bool

    @classmethod
    def of(cls, mf: ModelFile) -> ModelFacts:
        arch, meta = mf.architecture, mf.metadata

        def num(key: str, default: int) -> int:
            value = meta.get(names.key(key, arch), default)
            return int(value[0] if isinstance(value, list) and value else value)

        n_layer = num(names.BLOCK_COUNT, 0)
        n_head = num(names.HEAD_COUNT, 1)
        n_head_kv = num(names.HEAD_COUNT_KV, n_head) or n_head
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_expert=num(names.EXPERT_COUNT, 0),
            n_gqa=n_head // n_head_kv if n_head_kv else 1,
            is_70b=arch == "llama" and n_layer == 80 and n_head != n_head_kv,
        )


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category (substring matches, in its order)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_v"),  # category_is_attn_v: QKV and KV_B count as attn_v
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def _allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's tensor_allows_quantization, for the tensors our families have."""
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name  # MoE router
        and name not in ("position_embd.weight", "token_types.weight")
    )


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _mixture_type(qtype: Q, ftype: str, cat: str, ncols: int, facts: ModelFacts, i: int, n: int) -> Q:
    """llama_tensor_get_type_impl for the K-quant and legacy ftypes. i, n: the tensor's index among its
    kind (attn_v: among attn_v-like tensors; ffn_down: its layer) and their count."""
    falcon = facts.arch == "falcon"
    if cat == "output":
        if falcon or ncols % GGML_QUANT_SIZES[qtype][0]:
            return Q.Q8_0
        return Q.Q6_K if qtype != Q.Q8_0 else qtype
    if cat == "attn_v":
        if ftype == "q2_k":
            qtype = Q.Q4_K if facts.n_gqa >= 4 else Q.Q3_K
        elif ftype == "q3_k_m":
            qtype = Q.Q5_K if i < 2 else Q.Q4_K
        elif ftype == "q3_k_l":
            qtype = Q.Q5_K
        elif ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n):
            qtype = Q.Q6_K
        elif ftype == "q4_k_s" and i < 4:
            qtype = Q.Q5_K
        if facts.is_70b and qtype in (Q.Q3_K, Q.Q4_K):
            qtype = Q.Q5_K
        if facts.n_expert == 8:
            qtype = Q.Q8_0
    elif cat == "attn_k":
        if facts.n_expert == 8:
            qtype = Q.Q8_0
    elif cat == "ffn_down":
        if ftype == "q2_k":
            qtype = Q.Q3_K
        elif ftype == "q3_k_m":
            qtype = Q.Q5_K if i < n // 16 else Q.Q4_K if not falcon or _use_more_bits(i, n) else Q.Q3_K
        elif ftype == "q3_k_l":
            qtype = Q.Q4_K if falcon else Q.Q5_K
        elif ftype == "q4_k_m":
            if falcon:
                qtype = Q.Q6_K if i < n // 16 else Q.Q5_K if _use_more_bits(i, n) else Q.Q4_K
            elif _use_more_bits(i, n):
                qtype = Q.Q6_K
        elif ftype == "q5_k_m" and _use_more_bits(i, n):
            qtype = Q.Q6_K
        elif ftype == "q4_k_s" and not falcon and i < n // 8:
            qtype = Q.Q5_K
    elif cat == "attn_output":
        if not falcon:
            if facts.n_expert == 8:
                if ftype in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m"):
                    qtype = Q.Q5_K
            else:
                qtype = {"q2_k": Q.Q3_K, "q3_k_m": Q.Q4_K, "q3_k_l": Q.Q5_K}.get(ftype, qtype)
        elif ftype == "q3_k_l":
            qtype = Q.Q4_K
    return qtype


def _fallback(qtype: Q, ncols: int) -> Q:
    if ncols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ncols % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _llama_order(name: str) -> tuple[int, str]:
    """llama.cpp walks tensors sorted by layer, then name (weight_name_comparer)."""
    block = names.block_of(name)
    return (-1 if block is None else block, name)


def tensor_types(mf: ModelFile, outtype: str, predictor_type: str | None = None) -> dict[str, Q]:
    """The type every tensor of `mf` gets for `outtype` (a FTYPES key or alias), in file order.
    predictor_type (a single-type FTYPES key: f16, q8_0, q4_0, ...) overrides the predictors' rule."""
    ftype = ftype_of(outtype)
    default = FTYPES[ftype][1]
    pred_key = None if predictor_type is None else _single_type(predictor_type)
    pred_type = None if pred_key in (None, "keep") else FTYPES[pred_key][1]
    facts = ModelFacts.of(mf)
    entries = sorted(mf.tensors.values(), key=lambda e: _llama_order(e.name))
    tied = "output.weight" not in mf.tensors
    n_attn_v = sum(_category(e.name) == "attn_v" for e in entries)
    i_attn_v = i_ffn_down = 0
    out: dict[str, Q] = {}
    for e in entries:
        predictor = names.template_of(e.name, names.PREDICTOR_MATRICES) is not None
        if e.qtype in (Q.I8, Q.I16, Q.I32) or not _allows_quantization(e.name, e.shape):
            out[e.name] = e.qtype
            continue
        if predictor and pred_type is not None:
            out[e.name] = _fallback(pred_type, e.shape[-1])
            continue
        if (
            predictor
            and pred_key is None
            and quants.is_quantized(default)
            and not quants.is_quantized(e.qtype)
        ):
            out[e.name] = _fallback(DEFAULT_BLOCK_PREDICTOR_TYPE, e.shape[-1])  # float ones; block ones stay
            continue
        if predictor and quants.is_quantized(default):
            out[e.name] = Q.F16 if e.qtype == Q.F32 else e.qtype
            continue
        if not quants.is_quantized(default):
            out[e.name] = default
            continue
        if (
            ftype == "mxfp4_moe"
        ):  # llama.cpp: tensors of more than one expert MXFP4, the rest (output too) Q8_0
            qtype = Q.MXFP4 if len(e.shape) == 3 and e.shape[0] > 1 else Q.Q8_0
            out[e.name] = _fallback(qtype, e.shape[-1])
            continue
        cat = _category(e.name)
        if tied and cat == "token_embd":
            cat = "output"  # a tied embedding is the output projection too
        ncols = e.shape[-1]
        i, n = 0, 0
        if cat == "attn_v":
            i, n = i_attn_v, n_attn_v
            i_attn_v += 1
        elif cat == "ffn_down":
            transposed = names.template_of(e.name, (names.FFN_DOWN_T,)) is not None
            block = names.block_of(e.name)
            if facts.n_expert > 1 or transposed:  # by the name's layer (MoE experts, PowerInfer's ffn_down_t)
                i = block if block is not None else 0
            else:
                i = i_ffn_down
            n = facts.n_layer
            if not transposed:
                i_ffn_down += 1
        qtype = _mixture_type(default, ftype, cat, ncols, facts, i, n)
        out[e.name] = _fallback(qtype, ncols)
    return {name: out[name] for name in mf.tensors}


def _source_floats(entry: TensorEntry) -> torch.Tensor:
    value = as_torch(entry)
    if isinstance(value, quants.QuantTensor):  # the C kernels when built (same bits as value.dequantize())
        return cpu.dequantize_rows(value).reshape(entry.shape)
    return value.float()


def _encode(src: Path, entry: TensorEntry, qtype: Q) -> np.ndarray:
    try:
        return encode(_source_floats(entry), qtype)
    except ValueError as exc:  # e.g. NaN in the weights: name the file and the tensor
        raise ValueError(f"{src}: tensor {entry.name}: {exc}") from exc


def _single_type(name: str) -> str:
    """A predictor type: "keep" or one of FTYPES' single-type names (no *_M / *_S mixture), ValueError
    otherwise."""
    if name.strip().lower() == "keep":
        return "keep"
    key = ftype_of(name)
    if key not in PREDICTOR_TYPES:
        raise ValueError(f"predictor type {name!r}: expected one of {', '.join(PREDICTOR_TYPES)}")
    return key


def quantize_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    outtype: str,
    *,
    predictor_type: str | None = None,
    progress: bool = False,
    statistics: StatisticsPlan | None = None,
) -> Path:
    """Requantize src to dst (see the module doc). predictor_type: the type of a PowerInfer file's
    predictors (default: Q8_0 for a block-format target; "keep": their own type, F32 ones as F16); the
    original's `quantize` makes them Q4_0 for a Q4_0 file and Q5_0 otherwise. src's activation statistics
    are carried beside dst by `statistics` (default: quantize_statistics(src, dst), see convert/statistics.py)."""
    ftype = ftype_of(outtype)
    src, dst = Path(src), Path(dst)
    if predictor_type is not None:
        _single_type(predictor_type)
    check_output(dst, [src], what="quantize: output")
    mf = ModelFile(src)
    if predictor_type is not None and not mf.is_sparse:
        raise ValueError(f"{src}: --predictor-type: the file has no predictors (not a PowerInfer file)")
    types = tensor_types(mf, ftype, predictor_type)
    specs = []
    for entry in mf.tensors.values():
        qtype = types[entry.name]
        if qtype == entry.qtype:  # already in the target type (or kept): copy the bytes
            specs.append(TensorSpec(entry.name, entry.shape, qtype, lambda e=entry: np.asarray(e.data)))
        else:
            specs.append(
                TensorSpec(entry.name, entry.shape, qtype, lambda e=entry, q=qtype: _encode(src, e, q))
            )
    meta = [m for m in metadata_items(mf) if m[0] not in (names.FILE_TYPE, names.QUANTIZATION_VERSION)]
    meta.append((names.FILE_TYPE, int(FTYPES[ftype][0]), V.UINT32))
    if quants.is_quantized(FTYPES[ftype][1]):
        meta.append((names.QUANTIZATION_VERSION, 2, V.UINT32))

    def bar(items):
        return tqdm(items, desc=f"quantizing -> {dst.name}", unit="tensor") if progress else items

    def write() -> Path:
        return write_model_file(
            dst, mf.architecture, meta, specs, sparse=mf.is_sparse, progress=bar, inputs=[src]
        )

    plan = statistics if statistics is not None else quantize_statistics(src, dst, mf)
    if plan is None or plan.action != CARRY:
        return write()
    # the statistics staged, the model written, then both put in place (as reorder does)
    with activation_dir_writer(plan.target, [src, dst]) as staging:
        plan.copy_into(staging)
        return write()


def quantize_statistics(src: Path, dst: Path, mf: ModelFile | None = None) -> StatisticsPlan | None:
    """What quantize_file does with src's activation statistics (convert/statistics.py); None when src's
    shape cannot be read (then nothing is carried)."""
    from hotcold.config import config_from_file

    try:
        config = config_from_file(mf if mf is not None else ModelFile(src))
    except (ValueError, KeyError, OSError):
        return None
    return plan_statistics(Path(src), Path(dst), n_layer=config.n_layer, n_ff=config.n_ff)
