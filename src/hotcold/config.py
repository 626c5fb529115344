"""Model hyper-parameters, from GGUF metadata only (no config.json, no guessing from file names)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hotcold.gguf import names
from hotcold.gguf.io import GGUFError, ModelFile

THRESHOLD_ENV_VARS = ("HOTCOLD_SPARSE_THRESHOLD", "LLAMA_SPARSE_PRED_THRESHOLD")
MAX_CONTEXT = 1 << 24  # 16M tokens: above every model's training context; more is a corrupt key


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_scale: float  # positions are multiplied by this (linear scaling: 1 / factor)
    norm_eps: float
    ffn_activation: str  # "relu", "silu", "gelu" or "gelu_tanh"
    ffn_kind: str  # how gate and up combine: "gated", "gated_both" or "plain" (names.ffn_kind)
    sparse: bool  # a PWRI file: PowerInfer layout (ffn_down_t, predictors)
    sparse_threshold: float
    sliding_window: int | None = None
    rope_base_swa: float | None = None  # the sliding-window layers' RoPE base where it is their own (Gemma 3)
    rope_ctx_orig: int | None = (
        None  # longrope (Phi-3.x): the context its short factors serve; longer: long ones
    )
    rope_attn_factor: float = (
        1.0  # longrope: rotated q and k scaled by it (llama.cpp's rope.scaling.attn_factor)
    )
    rope_yarn: bool = (
        False  # YaRN (gpt-oss): rope_scale = 1 / factor, ramped over the dims (ops.yarn_corr_dims)
    )
    attn_softcap: float = 0.0  # Gemma 2: attention scores s -> c * tanh(s / c) before the softmax (0: none)
    final_softcap: float = 0.0  # and the output logits likewise
    n_expert: int = 0
    n_expert_used: int = 0
    name: str = ""
    sparsified: bool = (
        False  # written by `hotcold sparsify`: thresholds on |silu(gate)| (sparse/thresholded.py)
    )

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


def sparse_threshold(metadata: dict[str, Any]) -> float:
    """Predictor threshold: env HOTCOLD_SPARSE_THRESHOLD, else LLAMA_SPARSE_PRED_THRESHOLD, else the file's
    powerinfer.sparse_threshold, else 0.0 (a neuron fires iff its predictor logit >= threshold)."""
    for var in THRESHOLD_ENV_VARS:
        raw = os.environ.get(var)
        if raw is not None and raw.strip():
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"environment variable {var}={raw!r} is not a number") from None
    return float(metadata.get(names.SPARSE_THRESHOLD, 0.0))


# keys upstream llama.cpp gives a value of its own when a file lacks them (its per-architecture hparams defaults)
ARCH_DEFAULTS = {
    "gemma2": {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "attention.sliding_window": 4096,
    },
}


def config_from_file(model_file: ModelFile, arch: str | None = None) -> ModelConfig:
    meta = model_file.metadata
    arch = arch or model_file.architecture
    path = model_file.path

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required:
            raise GGUFError(f"{path}: missing metadata key {full}")
        return ARCH_DEFAULTS.get(arch, {}).get(key, default)

    def integer(key: str, default: Any = None, *, required: bool = False, lo: int = 1, hi: int | None = None):
        value = get(key, default, required=required)
        if isinstance(value, list) and value:  # per-layer values: every family we run uses one
            if len(set(value)) != 1:
                raise GGUFError(f"{path}: per-layer {key} {value[:8]} ... is not supported")
            value = value[0]
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < lo
            or (hi is not None and value > hi)
        ):
            rule = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise GGUFError(f"{path}: metadata key {arch}.{key} is {value!r}, expected an integer {rule}")
        return value

    def softcap(key: str) -> float:
        value = get(key) or 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise GGUFError(f"{path}: metadata key {arch}.{key} is {value!r}, expected a finite number >= 0")
        return float(value)

    n_embd = integer("embedding_length", required=True)
    n_head = integer("attention.head_count", required=True)
    n_head_kv = integer("attention.head_count_kv", n_head)
    n_ff = integer("feed_forward_length", required=True)
    if get("expert_count") and get(
        "expert_feed_forward_length"
    ):  # Qwen3-MoE: the FFN a token runs is an expert's
        n_ff = integer("expert_feed_forward_length")
    n_layer = _check_layers(model_file, integer("block_count", required=True))
    if n_embd % n_head and f"{arch}.attention.key_length" not in meta:
        raise GGUFError(f"{path}: embedding_length {n_embd} is not divisible by head_count {n_head}")
    head_dim = integer("attention.key_length", n_embd // n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")

    rope_scale = 1.0
    scaling_type = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    yarn = scaling_type == "yarn"
    if scaling_type in ("linear", "yarn") and factor:
        rope_scale = 1.0 / float(factor)
    elif scaling_type not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{path}: rope scaling type {scaling_type!r} is not supported (linear or yarn)")
    if yarn and get("rope.scaling.yarn_log_multiplier"):  # DeepSeek's mscale_all_dim: not a family we run
        raise GGUFError(f"{path}: metadata key {arch}.rope.scaling.yarn_log_multiplier is not supported")
    elif get("rope.scale_linear"):
        rope_scale = 1.0 / float(get("rope.scale_linear"))

    norm_eps = get("attention.layer_norm_rms_epsilon")
    if norm_eps is None:
        norm_eps = get("attention.layer_norm_epsilon", 1e-5)

    rope_dim = integer("rope.dimension_count", head_dim, lo=2, hi=head_dim)
    if rope_dim % 2:
        raise GGUFError(f"{path}: metadata key {arch}.rope.dimension_count is {rope_dim}: RoPE rotates pairs")

    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = integer("vocab_size", len(tokens) if isinstance(tokens, list) else 0, lo=0)
    if n_vocab <= 0:
        n_vocab = model_file.entry("token_embd.weight").shape[0]

    return ModelConfig(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=integer("context_length", 2048, hi=MAX_CONTEXT),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rope_dim=rope_dim,
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_scale=rope_scale,
        norm_eps=float(norm_eps),
        ffn_activation=ffn_activation(arch, model_file),
        ffn_kind=names.ffn_kind(arch, meta.get(names.FFN_KIND)),
        sparse=model_file.is_sparse,
        sparse_threshold=sparse_threshold(meta),
        sliding_window=get("attention.sliding_window") or None,
        rope_base_swa=None if get("rope.freq_base_swa") is None else float(get("rope.freq_base_swa")),
        rope_ctx_orig=get("rope.scaling.original_context_length") or None,
        rope_attn_factor=float(get("rope.scaling.attn_factor", 1.0)),
        rope_yarn=yarn and rope_scale != 1.0,
        attn_softcap=softcap("attn_logit_softcapping"),
        final_softcap=softcap("final_logit_softcapping"),
        n_expert=integer("expert_count", 0, lo=0),
        n_expert_used=integer("expert_used_count", 0, lo=0),
        name=str(meta.get("general.name", "")),
        sparsified=names.SPARSIFY_SPARSITY in meta,
    )


def _check_layers(model_file: ModelFile, n_layer: int) -> int:
    """block_count cannot exceed the layers the file has tensors for (blk.0 .. blk.N-1)."""
    present = {
        int(p[1]) for p in (n.split(".") for n in model_file.tensors) if p[0] == "blk" and p[1].isdigit()
    }
    if n_layer > len(present):
        raise GGUFError(
            f"{model_file.path}: metadata key {model_file.architecture}.block_count is {n_layer}, "
            f"but the file has tensors for {len(present)} layer(s)"
        )
    return n_layer


def ffn_activation(arch: str, model_file: ModelFile) -> str:
    """What the file declares (`hotcold.ffn_activation`, written for a dense file converted from a ReLU
    checkpoint), else the architecture's default (names.default_activation, shared with the converters)."""
    declared = model_file.metadata.get(names.FFN_ACTIVATION)
    if declared is not None:
        if declared not in names.ACTIVATIONS:
            raise GGUFError(
                f"{model_file.path}: {names.FFN_ACTIVATION} {declared!r} is not relu, silu, gelu or gelu_tanh"
            )
        return declared
    if arch == "smallthinker":  # ReLU-gated experts (upstream's LLM_FFN_RELU)
        return "relu"
    return names.default_activation(arch, sparse=model_file.is_sparse)
