"""The compute scratch space a forward needs on the GPU: the budget reserves it before placing anything
(placement.budget). Pure functions of the model's shape."""

from __future__ import annotations

from hotcold.config import ModelConfig
from hotcold.runtime.generation import PREFILL_CHUNK

DEFAULT_CTX = 2048  # the context a model gets without --ctx-size (capped by the file's training context)
# cuBLAS's workspace lives in the caching allocator (PyTorch's default: 32 MiB per handle on Hopper), charged
# with the first tensor that cuBLAS multiplies on the GPU (hot rows use Triton): an allowance from
# PyTorch's defaults, not a measurement (nothing here has run on a GPU yet)
LIBRARY_WORKSPACE_BYTES = 32 << 20


def default_ctx(config: ModelConfig) -> int:
    return min(config.n_ctx_train, DEFAULT_CTX)


def scratch_parts(config: ModelConfig, ctx_size: int | None = None) -> dict[str, int]:
    """Peak temporaries of the largest prefill forward on the GPU, by phase (bytes). T tokens: the largest
    prefill chunk (generation.PREFILL_CHUNK, at most the context); S: the context size. Within a phase
    every temporary is counted as live at once; phases follow each other, so the peak is the residual
    stream plus the largest phase.

    residual: x, its copy on the layer's device, x + attention, x + FFN ([T, D] float32 each);
    attention: the norm's temporaries and an fp16 copy, q/k/v (fp16 products and float32 copies), RoPE,
      the cache up to S as float32 keys/values and expanded to every head (GQA), the scores and their
      softmax [H, T, S], the causal mask [T, S] (bool and as a float bias), the output and wo's product;
    ffn: the predictor ([T, R] with R <= D, logits [T, n_ff], the mask and its copy), up and gate
      (fp16 products and float32 copies), the activation, the product, the masked copy, its fp16 copy and
      the down product;
    head: the last row's norm and logits [1, V] (a prefill only asks for the last row);
    fixed: the RoPE tables [S, head_dim]; workspace: cuBLAS's (with the first matmul on the GPU)."""
    c = config
    S = int(ctx_size or default_ctx(c))
    T = max(1, min(PREFILL_CHUNK, S))
    D, F, V = int(c.n_embd), int(c.n_ff), int(c.n_vocab)
    H, Dh = int(c.n_head), int(c.head_dim)
    q, kv = H * Dh, int(c.n_head_kv) * Dh
    f32, f16 = 4, 2
    attention = (
        T * D * (3 * f32 + f16)  # norm
        + T * (q + 2 * kv) * (f16 + f32)  # q, k, v
        + 3 * T * (q + kv) * f32  # RoPE on q and k
        + 2 * S * (kv + q) * f32  # keys/values up to S as float32, expanded to every head
        + 2 * H * T * S * f32  # scores and softmax
        + T * S * (1 + f32)  # causal mask, as bool and as a float bias
        + 2 * T * q * f32  # attention output and its [T, H*Dh] copy
        + T * D * (f16 + f32)  # wo
    )
    ffn = (
        T * D * f32 * 2  # predictor hidden layer and its ReLU (rank <= n_embd)
        + T * F * (f32 + 2)  # predictor logits, the mask and its copy on the device
        + T * F * (2 * (f16 + f32) + 3 * f32 + f16)  # up, gate; act, product, masked copy; fp16 for down
        + T * D * (f16 + f32)  # down
    )
    head = D * (3 * f32 + f16) + V * (f16 + f32)
    return {
        "residual": 4 * T * D * f32,
        "attention": attention,
        "ffn": ffn,
        "head": head,
        "fixed": S * Dh * f32,
        "workspace": LIBRARY_WORKSPACE_BYTES,
    }


def scratch_bytes(config: ModelConfig, ctx_size: int | None = None, *, attention: bool = True) -> int:
    """The prefill scratch reserve at `ctx_size` (default: the loader's default context). attention=False:
    without attention's temporaries and cuBLAS's workspace (what a plan with no matmul on the GPU needs: hot
    rows only)."""
    p = scratch_parts(config, ctx_size)
    if not attention:
        return p["residual"] + max(p["ffn"], p["head"]) + p["fixed"]
    return p["residual"] + max(p["attention"], p["ffn"], p["head"]) + p["fixed"] + p["workspace"]
