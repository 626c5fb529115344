"""The shared math under every family: linear layers over any weight type, norms, RoPE, attention over a
preallocated KV cache, the token embedding. Functions of tensors, plus two small immutable objects
(`Norm`, `LinearGroup`). models/, sparse/ and the engine import from here; this module imports only the
kernels and the quantization formats below it.

A weight lives where the loader put it (hotcold.device decides); these functions compute where their
inputs are: the C kernels for CPU weights of the kernels' types, torch otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import cpu
from hotcold.kernels.cpu import apply_rope  # the one torch RoPE (the C attention's fallback uses it too)
from hotcold.kernels.decode_glue import (
    attention_explicit,  # the one torch attention with sinks / caps (as apply_rope)
)

Weight = torch.Tensor | QuantTensor

# Below this many tokens (decode steps and decode batches) RMS norms run in C, alone or folded into the
# call that follows: one call instead of five ops, and each row's bits do not depend on the other rows
# (a batch of requests equals each request alone). Prefill chunks use torch.
C_NORM_MAX_TOKENS = cpu.GEMM_MIN_TOKENS - 1


def uses_c_kernels(weight: Weight) -> bool:
    """Whether `linear` multiplies by this weight with the C kernels (CPU, not float32): the one rule."""
    if isinstance(weight, torch.Tensor):
        return weight.device.type == "cpu" and weight.dtype != torch.float32
    return weight.data.device.type == "cpu"


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] float32 @ weight[F, D].T (+ bias) -> [T, F] float32, for float and block-quantized weights."""
    if isinstance(weight, torch.Tensor) and not uses_c_kernels(weight):  # float32 anywhere, or on a GPU
        if weight.dtype == torch.float32:
            out = F.linear(x, weight)
        elif x.dim() == 2 and weight.device.type != "cpu":
            out = _mm_float32_out(x.to(weight.dtype), weight)
        else:
            out = F.linear(x.to(weight.dtype), weight).float()
    else:
        out = cpu.matmul(weight, x)
    if bias is not None:
        out = out + bias
    return out


_MM_OUT_DTYPE = [True]  # whether this torch's GPU mm takes out_dtype (found on first use)


def _mm_float32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for fp16 / bf16 on a GPU with float32 outputs (the products accumulate in fp32 either
    way; this keeps the result from being rounded to fp16, so a predictor's logits meet the threshold in
    fp32 as on the CPU). Falls back to an fp16 result where torch lacks mm(out_dtype=)."""
    if _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return F.linear(x, weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= C_NORM_MAX_TOKENS:
        return cpu.rms_norm(x, weight, eps)  # float64 sum of squares in C; torch for other inputs
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= C_NORM_MAX_TOKENS:
        return cpu.layer_norm(x, weight, bias, eps)  # float64 mean and variance in C, as the one-call decode
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@dataclass(frozen=True)
class Norm:
    """An RMS norm (llama family) or a LayerNorm with bias (falcon, opt): weight [D], bias [D] or None."""

    weight: torch.Tensor
    eps: float
    bias: torch.Tensor | None = None
    rms: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return rms_norm(x, self.weight, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)

    def folds_into_c(self, x: torch.Tensor) -> bool:
        """Whether a C call that multiplies norm(x) may compute the norm itself (same bits as rms_norm)."""
        return self.rms and x.device.type == "cpu" and x.shape[0] <= C_NORM_MAX_TOKENS

    @property
    def c_args(self) -> tuple[torch.Tensor, float]:
        return self.weight, self.eps

    def to(self, device: torch.device) -> Norm:
        bias = None if self.bias is None else self.bias.to(device)
        return Norm(self.weight.to(device), self.eps, bias, self.rms)


class LinearGroup:
    """[linear(norm(x), w) for w in weights] with the same bits, for weights that share their input (a
    layer's q, k, v; an FFN's up and gate): CPU weights that the C kernels multiply go in one call, so
    their rows stream in one pass of the threads, and for a few tokens the RMS norm runs inside it. The
    C plan is built here, at load, never on first use from a request thread."""

    def __init__(self, weights: list[Weight], *, stack_on_gpu: bool = False):
        """stack_on_gpu: float matrices on a GPU are held as one stacked matrix (`fused`), for the fused
        decode kernels; only where nothing else holds the originals (a layer's q, k, v), or they would be
        held twice."""
        self.weights = list(weights)
        self._group = None
        self.fused: torch.Tensor | None = None  # on a GPU: the matrices stacked, self.weights views of it
        if all(uses_c_kernels(w) for w in weights) and cpu.backend() == "c":
            try:
                self._group = cpu.MatvecGroup(self.weights)
            except ValueError:  # different widths or types without a kernel: one call each
                pass
        elif (
            stack_on_gpu
            and all(isinstance(w, torch.Tensor) and w.device.type == "cuda" and w.dim() == 2 for w in weights)
            and len({(w.dtype, w.shape[1], w.device) for w in weights}) == 1
        ):
            # one matrix for the fused decode kernels (q/k/v + RoPE in one launch), held once: the group's
            # own products use views of it
            self.fused = torch.cat(self.weights)
            self.weights = list(torch.split(self.fused, [w.shape[0] for w in weights]))

    @property
    def c_group(self) -> cpu.MatvecGroup | None:
        """The one-call C group (CPU weights of the kernels' types), or None."""
        return self._group

    def __call__(self, x: torch.Tensor, norm: Norm | None = None) -> list[torch.Tensor]:
        if (
            self._group is not None
            and x.device.type == "cpu"
            and (x.shape[0] < cpu.GEMM_MIN_TOKENS or self._group.packed)
        ):
            # packed: a prompt chunk's products in one call too (x quantized once; the GEMM, the bits of separate calls)
            if norm is not None and norm.folds_into_c(x):
                return self._group(x, norm=norm.c_args)
            return self._group(norm(x) if norm is not None else x)
        h = norm(x) if norm is not None else x
        return [linear(h, w) for w in self.weights]


def embed(token_embd: Weight, tokens: torch.Tensor) -> torch.Tensor:
    """Rows `tokens` [T] of the embedding -> [T, D] float32 (block formats dequantize just those rows)."""
    if isinstance(token_embd, QuantTensor):
        if token_embd.data.device.type == "cpu":
            return cpu.dequantize_rows(token_embd, index=tokens)
        return token_embd.dequantize(tokens)
    return token_embd[tokens].float()


# ------------------------------------------------------------------------------------------------
# RoPE and attention
# ------------------------------------------------------------------------------------------------


def rope_tables(
    n_ctx: int,
    rope_dim: int,
    base: float,
    scale: float,
    freq_factors: torch.Tensor | None = None,
    mscale: float = 1.0,
    yarn: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, rope_dim/2] for positions 0..n_ctx-1 (linear scaling multiplies positions by `scale`;
    freq_factors [rope_dim/2] divide each pair's frequency: Llama 3.1's scaling, the file's rope_freqs, or
    Phi-3's longrope factors; mscale multiplies both, so every kernel that rotates by the tables scales the
    rotated q and k by it, as ggml's rope does with attn_factor). yarn: YaRN's correction dims (low, high)
    (yarn_corr_dims): pair i turns at scale * its frequency below the ramp (pairs past `high`), at its own
    frequency above it (pairs before `low`), mixed linearly between, as ggml's rope_yarn."""
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    if yarn is not None:
        low, high = yarn
        pair = torch.arange(rope_dim // 2, dtype=torch.float64)
        extrapolate = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)  # ggml's rope_yarn_ramp
        inv_freq = scale * inv_freq * (1 - extrapolate) + inv_freq * extrapolate
        scale = 1.0
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * scale * inv_freq[None, :]
    return (angles.cos() * mscale).float(), (angles.sin() * mscale).float()


def yarn_corr_dims(
    rope_dim: int, n_ctx_orig: int, base: float, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[float, float]:
    """YaRN's ramp over RoPE's pairs, as ggml_rope_yarn_corr_dims: the dims where a pair turns beta_fast and
    beta_slow times over the original context, floored and ceiled (transformers' `truncate`, its default).
    llama.cpp runs gpt-oss with its default betas, 32 and 1."""

    def dim(rotations: float) -> float:
        return rope_dim * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(rope_dim - 1.0, math.ceil(dim(beta_slow)))


def yarn_mscale(scale: float, attn_factor: float = 1.0) -> float:
    """cos / sin scale of YaRN as llama.cpp sets it: its context's yarn_attn_factor (get_mscale(factor), cancelled
    by 1 / (1 + 0.1 ln factor), times the file's rope.scaling.attn_factor), then rope_yarn's 1 + 0.1 ln factor."""
    factor = 1.0 / scale
    # get_mscale(factor) and its cancelling 1 / (1 + 0.1 ln factor) leave 1 past factor 1; at or below it the
    # cancelling term and rope_yarn's own factor leave 1: what remains is attn_factor, times 1 + 0.1 ln factor past 1
    return attn_factor * (1.0 + 0.1 * math.log(factor)) if factor > 1.0 else attn_factor


class RopeTables:
    """cos/sin tables per device. Built at load for the devices the model uses; a longer context than the
    tables cover gets a new, longer pair (computed whole, then swapped in: threads only ever read a
    complete pair)."""

    def __init__(
        self,
        config,
        devices=(torch.device("cpu"),),
        *,
        rope_dim: int | None = None,
        freq_factors: torch.Tensor | None = None,
        base: float | None = None,
        scale: float | None = None,
    ):
        """rope_dim: the rotated dims of a head (None: the config's; 0: none, for learned positions (OPT),
        so attention takes the same kernels as a RoPE family's with nothing rotated). freq_factors: the file's
        rope_freqs [rope_dim / 2] (Llama 3.1's scaling), or None."""
        self.config = config
        self.rope_dim = config.rope_dim if rope_dim is None else rope_dim
        self.freq_factors = None if freq_factors is None else freq_factors.detach().to("cpu", torch.float64)
        # base / scale: the config's unless given (Gemma 3's local layers: their own base, no scaling)
        self.base = config.rope_base if base is None else base
        self.scale = config.rope_scale if scale is None else scale
        self.mscale = getattr(config, "rope_attn_factor", 1.0)
        self.yarn = None
        if getattr(config, "rope_yarn", False):  # gpt-oss: YaRN over the original context
            n_orig = config.rope_ctx_orig or config.n_ctx_train
            self.yarn = yarn_corr_dims(self.rope_dim, n_orig, self.base)
            self.mscale = yarn_mscale(self.scale, self.mscale)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for device in set(devices):
            self._tables[device] = self._build(config.n_ctx_train, device)

    def _build(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = rope_tables(
            n, self.rope_dim, self.base, self.scale, self.freq_factors, self.mscale, self.yarn
        )
        return tuple(t.to(device) for t in tables)

    def _covering(self, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's tables, rebuilt longer first when positions up to `end` are past them."""
        tables = self._tables.get(device)
        if tables is None or end > tables[0].shape[0]:
            tables = self._build(max(end, self.config.n_ctx_train), device)
            self._tables[device] = tables
        return tables

    def tables(self, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's whole cos/sin tables [n, R/2], n >= end (kernels that index them by position)."""
        return self._covering(end, device)

    def __call__(self, pos: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._covering(pos + T, device)
        return cos[pos : pos + T], sin[pos : pos + T]

    def rows(self, positions: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, R/2] at the given positions (one decode token of each sequence of a batch)."""
        cos, sin = self._covering(max(positions) + 1, device)
        idx = torch.tensor(positions, dtype=torch.long, device=cos.device)
        return cos.index_select(0, idx), sin.index_select(0, idx)


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """apply_rope on q and k, then attention(): one C call for a decode step on the CPU, and for a prompt chunk
    whose rows x context `attends_in_rows` allows (each a decode token at its position; soft-caps, sinks too)."""
    t = q.shape[0]
    if q.device.type == "cpu" and (t == 1 or attends_in_rows(t, pos, k_cache)):
        check_context(pos + t, k_cache.shape[0])
        return cpu.attention_decode_rows(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            [k_cache] * t,
            [v_cache] * t,
            list(range(pos, pos + t)),
            cos.contiguous(),
            sin.contiguous(),
            neox=neox,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    q, k = apply_rope(q, cos, sin, neox=neox), apply_rope(k, cos, sin, neox=neox)
    return attention(
        q, k, v, k_cache, v_cache, pos, sliding_window=sliding_window, sinks=sinks, softcap=softcap
    )


# Rows x context up to which a prompt chunk's attention runs as decode rows in C (each row reads its head's keys
# and values itself; the heads go one after the other, so a chunk's rows find them in cache): on the 2-core Zen 5
# dev host against SDPA with its causal mask, 1B-shaped GQA (4 kv heads of 64) 0.16x the time at 52 x 52 and
# 0.65x at 512 x 2048; LLaMA-7B-shaped (32 kv heads of 128) 0.4x at 52 x 52, 0.94x at 512 x 512, 1.9x at
# 95 x 3095. Not part of a row's arithmetic contract: the rule depends on the chunk alone, so a prompt's bits do
# not depend on the batch it runs in.
ROWS_ATTENTION_MAX_WORK = 1 << 17


def attends_in_rows(t: int, pos: int, k_cache: torch.Tensor) -> bool:
    """Whether rope_attention runs a CPU chunk of t rows at pos as decode rows in C: a float32 cache, the C
    kernels, and t x (pos + t) <= ROWS_ATTENTION_MAX_WORK."""
    return (
        k_cache.dtype == torch.float32 and t * (pos + t) <= ROWS_ATTENTION_MAX_WORK and cpu.backend() == "c"
    )


def rope_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    positions: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    neox: bool,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_attention for N decode tokens of N sequences on the CPU (row n at positions[n] over its own
    caches), one C call: each row as rope_attention computes it alone (the same context overflow error).
    q [N, H, Dh] -> [N, H*Dh]."""
    return cpu.attention_decode_rows(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        k_caches,
        v_caches,
        positions,
        cos.contiguous(),
        sin.contiguous(),
        neox=neox,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )


def check_context(end: int, n_ctx: int) -> None:
    if end > n_ctx:
        raise ValueError(f"context overflow: position {end} exceeds the context size {n_ctx}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [T, H, Dh], k/v [T, Hkv, Dh] for positions pos..pos+T-1; writes k/v into the caches [S, Hkv, Dh]
    and attends over positions 0..pos+T-1 causally. Returns [T, H*Dh]. sinks [H]: a learned logit per head
    that joins each softmax's denominator and attends to nothing (gpt-oss; ggml_soft_max_add_sinks).
    softcap: each score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2; 0: none)."""
    T, H, Dh = q.shape
    end = pos + T
    check_context(end, k_cache.shape[0])
    k_cache[pos:end] = k.to(k_cache.dtype)
    v_cache[pos:end] = v.to(v_cache.dtype)
    # On a GPU the attention runs in the cache's dtype (fp16: SDPA accumulates in fp32 inside) rather than
    # upcasting the cache to fp32 at every step (at context 2048 a 7B model's would move ~3 GB a token).
    dtype = k_cache.dtype if q.device.type != "cpu" else q.dtype
    keys = k_cache[:end].to(dtype).transpose(0, 1)[None]  # [1, Hkv, S, Dh]
    values = v_cache[:end].to(dtype).transpose(0, 1)[None]
    mask = None
    if T > 1 or sliding_window:
        q_pos = torch.arange(pos, end, device=q.device)[:, None]
        k_pos = torch.arange(end, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window:
            mask = mask & (k_pos > q_pos - sliding_window)
    if sinks is not None or softcap:
        # a window reads only its keys: those from the first query's window start on
        start = max(0, pos - sliding_window + 1) if sliding_window else 0
        if mask is not None:
            mask = mask[:, start:]
        out = attention_explicit(
            q.to(dtype).transpose(0, 1), keys[0, :, start:], values[0, :, start:], mask, sinks, softcap
        )
        return out.transpose(0, 1).reshape(T, H * Dh).to(q.dtype)
    if q.device.type == "cpu" and T > 1 and not sliding_window and cpu.backend() == "c":
        out = cpu.attention_prefill(q.contiguous(), k_cache, v_cache, pos)  # GEMM-like tiles in C
        if out is not None:
            return out
    out = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != H
    )  # [1, H, T, Dh]
    return out[0].transpose(0, 1).reshape(T, H * Dh).to(q.dtype)
