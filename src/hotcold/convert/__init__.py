"""Hugging Face checkpoint (+ PowerInfer predictor folder) -> dense GGUF or PowerInfer (PWRI) file."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tqdm import tqdm

from hotcold.atomic import check_output
from hotcold.convert.checkpoint import Checkpoint, ConvertError, Encoded, read_config, read_predictors
from hotcold.gguf import names
from hotcold.gguf.io import TensorSpec, write_model_file

OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
# general.file_type as llama.cpp numbers it (LlamaFileType)
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}

# config.json model_type -> converter module under hotcold.convert
# (a family module exposes architecture, activation, dims, metadata, tensors; optionally predictor_groups)
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "bamboo": "llama",
    "mixtral": "mixtral",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt_oss",
    "smallthinker": "smallthinker",
    "phi3": "phi3",
    "gemma2": "gemma3",  # Gemma 2: Gemma 3's converter, its own pattern and soft-caps
    "gemma3_text": "gemma3",
    "falcon": "falcon",
    "RefinedWeb": "falcon",  # Falcon checkpoints from before transformers had the class
    "RefinedWebModel": "falcon",
    "opt": "opt",
}


def family_module(model_type: str, hf_dir: Path):
    module = FAMILIES.get(model_type)
    if module is None:
        raise ConvertError(
            f"{hf_dir}/config.json: model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(f"hotcold.convert.{module}")


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> Q:
    """1-D tensors (norms, biases) stay F32 as in every llama.cpp converter; matrices take the out type,
    except where a block format does not divide the row (then F16, as llama.cpp's quantize falls back)."""
    if len(shape) < 2:
        return Q.F32
    qtype = OUTTYPES[outtype]
    if qtype in (Q.Q8_0, Q.Q4_0) and shape[-1] % 32:
        return Q.F16
    return qtype


def encode(values: torch.Tensor, qtype: Q) -> np.ndarray:
    """float tensor -> the bytes of one GGUF tensor of type qtype."""
    values = values.detach().contiguous()
    if qtype == Q.F32:
        return values.to(torch.float32).numpy()
    if qtype == Q.F16:
        return values.to(torch.float16).numpy()
    if qtype == Q.BF16:
        return values.to(torch.bfloat16).view(torch.uint8).numpy()
    from hotcold.gguf import quants

    return quants.quantize(values.to(torch.float32), qtype)


def convert(
    hf_dir: str | Path,
    predictor_dir: str | Path | None,
    out: str | Path,
    *,
    outtype: str = "f16",
    dense: bool = False,
    progress: bool = False,
) -> Path:
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    inputs = input_files(hf_dir, predictor_dir)
    check_output(out, inputs, what="output file")  # before any work: never replace the checkpoint's files
    config = read_config(hf_dir)
    family = family_module(config.get("model_type", ""), hf_dir)
    arch = family.architecture(config)
    act = family.activation(config)
    ckpt = Checkpoint(hf_dir)
    sparse = predictor_dir is not None and not dense
    if sparse and act != "relu" and arch != "bamboo":
        raise ConvertError(f"{hf_dir}: predictors need a ReLU model, config.json hidden_act is {act!r}")

    plan = family.tensors(config, ckpt, sparse_layout=sparse)
    threshold = None
    if sparse:
        n_layer, n_embd, n_ff = family.dims(config)
        pred_dir = Path(predictor_dir)
        # one predictor per layer, or (MoE) one per layer and expert, each expert's in its own subfolder
        groups = family.predictor_groups(config) if hasattr(family, "predictor_groups") else [("", None)]
        _, threshold = read_predictors(pred_dir, 0, n_embd, n_ff)  # the folder's config.json
        for folder, expert in groups:
            predictors, _ = read_predictors(pred_dir / folder, n_layer, n_embd, n_ff)
            for i, layer in enumerate(predictors):  # predictors last, as PowerInfer's convert.py writes them
                plan.append((names.tensor(names.PRED_FC1, i, expert=expert), lambda t=layer["fc1.weight"]: t))
                plan.append((names.tensor(names.PRED_FC2, i, expert=expert), lambda t=layer["fc2.weight"]: t))

    specs = []
    for name, load in plan:
        probe = load()
        if isinstance(probe, Encoded):  # already in its GGUF bytes (gpt-oss's MXFP4 experts)
            specs.append(TensorSpec(name, probe.shape, probe.qtype, probe.produce))
            continue
        shape = tuple(probe.shape)  # cheap: safetensors are mapped, predictors in memory
        qtype = tensor_type(name, shape, outtype)
        specs.append(TensorSpec(name, shape, qtype, lambda load=load, qtype=qtype: encode(load(), qtype)))

    meta: list[tuple] = [
        (names.NAME, hf_dir.resolve().name, V.STRING),
        *family.metadata(config, arch),
        (names.FILE_TYPE, FILE_TYPES[outtype], V.UINT32),
    ]
    if outtype in ("q8_0", "q4_0"):
        meta.append((names.QUANTIZATION_VERSION, 2, V.UINT32))
    if threshold is not None:
        meta.append((names.SPARSE_THRESHOLD, threshold, V.FLOAT32))
    # the reader (config.py) takes the same default: without the key every reader (llama.cpp too) runs e.g. a
    # dense llama file as SiLU. Bamboo is dReLU by architecture, whatever config.json's hidden_act says.
    if not sparse and arch != "bamboo" and act != names.default_activation(arch, sparse=False):
        meta.append((names.FFN_ACTIVATION, act, V.STRING))

    from hotcold.convert.vocab import write_vocab

    def bar(items):
        return tqdm(items, desc=f"converting -> {out.name}", unit="tensor") if progress else items

    return write_model_file(
        out,
        arch,
        meta,
        specs,
        sparse=sparse,
        progress=bar,
        extra=lambda w: write_vocab(w, hf_dir),
        inputs=inputs,
    )


def input_files(hf_dir: Path, predictor_dir: str | Path | None) -> list[Path]:
    """Every file a conversion may read: the files of the checkpoint folder, of the predictor folder and of
    its subfolders (one per expert for MoE models); model files (.gguf, .gpuidx) there are never read, so
    converting again over an earlier output stays allowed."""
    folders = [Path(hf_dir)]
    if predictor_dir is not None:
        pred = Path(predictor_dir)
        folders.append(pred)
        if pred.is_dir():
            folders += [p for p in pred.iterdir() if p.is_dir()]
    files = []
    for folder in folders:
        if folder.is_dir():
            files += [p for p in folder.iterdir() if p.is_file() and p.suffix not in (".gguf", ".gpuidx")]
    return files
