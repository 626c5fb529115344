"""What every family shares: the protocol the engine calls, the output head and a sequence's state.

A family module (llama.py, falcon.py, opt.py, mixtral.py) describes math only: `build(src, make_ffn)`
reads its tensors from a `TensorSource` (already on the devices the plan chose) and asks `make_ffn` for
each layer's FFN; `forward(tokens, ctx, last_only=...)` runs the layers over a batch (state.Batch) of one or more
sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hotcold.config import ModelConfig
from hotcold.device import DevicePlan
from hotcold.ops import (
    LinearGroup,
    Norm,
    RopeTables,
    Weight,
    attends_in_rows,
    check_context,
    linear,
    rope_attention,
    rope_attention_rows,
)
from hotcold.runtime.state import Batch, SequenceState
from hotcold.sparse.tails import layer_tail

# make_ffn(layer, weights, predictor or None, norm or None, expert=None) -> an FFN: ffn(x, ctx) / ffn.apply(h, p, ctx)
FFNMaker = Callable[..., Callable]


@dataclass(frozen=True)
class LayerSpec:
    """What one layer computes, as data: its family fills it from the config and the file's tensors, and the
    decoders read it (decoders.choose_decoder picks one at load from these and the device plan), so a family
    never needs a decoder of its own. A field's default is the llama layer; fields the next families need
    (q/k norm, sandwich norms, attention sinks, soft-caps, routing variants) belong here too."""

    norm: str = "rms"  # "rms", or "layer": LayerNorm with bias
    residual: str = "sequential"  # x += attn(x); x += ffn(x).  "parallel": x += attn(x) + ffn(x) (Falcon)
    positions: str = "rope"  # "rope", or "learned": absolute position rows added to the embedding (OPT)
    rope_neox: bool = False  # RoPE rotates the two halves of a head (NeoX), not adjacent pairs
    attn_bias: bool = False  # biases on q, k, v and o
    sliding_window: int = 0  # attend to this many positions back (0: every position)
    moe: bool = False  # the FFN is a router over experts
    input_sparse: bool = False  # q/k/v and o from each token's kept input channels (sparsify --attention)
    qk_norm: bool = False  # an RMS norm over each head of q and of k before RoPE (Qwen3)
    post_norms: bool = (
        False  # "sandwich": an RMS norm on attention's and on the FFN's output before each add (Gemma 3)
    )
    local_rope: bool = False  # RoPE with the local base (Gemma 3's sliding-window layers)
    attn_scale: float = 0.0  # softmax scale of q.k (0: 1 / sqrt(head_dim))
    sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    attn_softcap: float = 0.0  # scores s -> c * tanh(s / c) before the softmax (Gemma 2; 0: none)
    oai_experts: bool = False  # gpt-oss's experts: router and expert biases, the clamped SwiGLU
    early_router: bool = False  # the experts are routed from the residual before attention (SmallThinker)
    nope: bool = False  # no RoPE: positions only through the causal mask (SmallThinker's global layers)

    def beyond_llama(self) -> str | None:
        """The first thing this layer computes that a plain llama layer (RMS norms, sequential residual, RoPE on
        adjacent pairs, q/k/v without biases, one FFN) does not, or None: what the GPU fixed-shape step, built for
        llama layers, has to say no to (the CPU one-call step takes every field here)."""
        if self.norm != "rms":
            return "LayerNorm"
        if self.residual != "sequential":
            return "a parallel residual"
        if self.positions != "rope":
            return "learned positions"
        if self.rope_neox:
            return "NeoX RoPE"
        if self.attn_bias:
            return "attention biases"
        if self.moe:
            return "experts"
        if self.early_router:
            return "a router on the residual before attention"
        if self.nope:
            return "attention without RoPE"
        if self.qk_norm:
            return "q/k norms"
        if self.post_norms or self.local_rope or self.attn_scale:
            return "sandwich norms, a local RoPE base or a scale of its own"
        if self.attn_softcap:
            return "soft-capped attention scores"
        if self.sinks:
            return "attention sinks"
        if self.oai_experts:
            return "gpt-oss's experts (router and expert biases, the clamped SwiGLU)"
        return None


class Decoder(Protocol):
    config: ModelConfig
    layers: list

    def new_sequence(self, n_ctx: int) -> SequenceState: ...

    def forward(self, tokens: torch.Tensor, ctx: Batch, *, last_only: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class Head:
    """The output norm and projection, on their device; logits come back as float32 on the CPU."""

    norm: Norm
    weight: Weight  # [V, D]
    softcap: float = 0.0  # logits l -> c * tanh(l / c) (Gemma 2's final_logit_softcapping; 0: none)
    # head_screen.HeadScreen of a float head on the CPU (made at load): a greedy step's rows that can win
    screen: object | None = field(default=None, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def __call__(self, x: torch.Tensor, ctx: Batch, *, last_only: bool) -> torch.Tensor:
        """Logits [rows, V] float32 on the CPU; for a forward whose last logits are read in part (ctx.head_need:
        a greedy or top-k step) with a screen, the rows that can matter exact and -inf in every other column."""
        if last_only:  # each segment's last row
            x = x[-1:] if len(ctx.seqs) == 1 else x[ctx.last_rows()]
        x = self.norm(x.to(self.device))
        need = ctx.head_need if last_only else None
        screened = self.screen is not None and need is not None and self.screen.takes(need, x)
        if screened:
            logits, mask = self.screen.rows(self.weight, x, top=need.top, keep=need.keep)
            # NaN / inf in a computed row, or none computed (NaN bounds): the whole head, so the caller's check sees
            # every row as without the screen
            screened = bool(mask.any(-1).all()) and bool(torch.isfinite(logits[mask]).all())
        if not screened:
            logits = linear(x, self.weight).float()
        if self.softcap:  # monotone: the rows that can win are the same
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if screened:
            logits.masked_fill_(~mask, float("-inf"))
        for seq in ctx.seqs:
            seq.head_screened = screened
        if last_only:
            v = logits.shape[-1]
            computed = mask.sum(-1).tolist() if screened else [v] * logits.shape[0]
            for seq, n in zip(ctx.seqs, computed):
                seq.head_rows[0] += n
                seq.head_rows[1] += v
        return logits.cpu()


def rope_attention_segments(
    ctx: Batch,
    layer: int,
    q,
    k,
    v,
    rope: RopeTables,
    device: torch.device,
    *,
    neox: bool,
    sliding_window=None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """RoPE attention of every segment over its own sequence's layer cache (q [T, H, Dh], k/v [T, Hkv, Dh])
    -> [T, H*Dh]. A batch on the CPU whose segments are decode tokens, or prompt chunks that rope_attention
    runs as decode rows (`attends_in_rows`), is one call for all rows: each row as its segment alone (scores
    soft-capped where softcap is set: Gemma 2; with sinks [H]: gpt-oss)."""
    rows = None
    if len(ctx.seqs) > 1 and device.type == "cpu":
        if ctx.rows == len(ctx.seqs):  # a decode step: one token a sequence
            rows = ctx.starts, [s.kv.k[layer] for s in ctx.seqs], [s.kv.v[layer] for s in ctx.seqs]
        elif all(
            b - a == 1 or attends_in_rows(b - a, pos, seq.kv.k[layer]) for a, b, seq, pos in ctx.segments()
        ):
            segments = list(ctx.segments())
            rows = (
                [p for a, b, _, pos in segments for p in range(pos, pos + b - a)],
                [seq.kv.k[layer] for a, b, seq, _ in segments for _ in range(b - a)],
                [seq.kv.v[layer] for a, b, seq, _ in segments for _ in range(b - a)],
            )
    if rows is not None:
        positions, kcs, vcs = rows
        cos, sin = rope.rows(positions, device)
        return rope_attention_rows(
            q, k, v, kcs, vcs, positions, cos, sin, neox=neox, sliding_window=sliding_window, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip

    def attend(a, b, seq, pos):
        cos, sin = rope(pos, b - a, device)
        kv = seq.kv
        return rope_attention(
            q[a:b],
            k[a:b],
            v[a:b],
            kv.k[layer],
            kv.v[layer],
            pos,
            cos,
            sin,
            neox=neox,
            sliding_window=sliding_window,
            sinks=sinks,
            softcap=softcap,
        )

    return per_sequence(ctx, attend)


def decode_attention(ctx: Batch, layer: int, qkv: LinearGroup, norm: Norm, x: torch.Tensor, rope: RopeTables,
                     device: torch.device, *, heads: tuple[int, int, int], neox: bool,
                     sliding_window=None) -> torch.Tensor | None:  # fmt: skip
    """q, k, v of norm(x) and RoPE attention for one decode token of one sequence: on the CPU one C call
    (the bits of LinearGroup then rope_attention_segments), on a GPU two fused launches
    (fused_decode_attention); None where neither applies."""
    if device.type == "cuda":
        return fused_decode_attention(
            ctx, layer, qkv, norm, x, rope, device, heads=heads, neox=neox, sliding_window=sliding_window
        )
    group = qkv.c_group
    if (
        group is None
        or device.type != "cpu"
        or len(ctx.seqs) != 1
        or ctx.rows != 1
        or not norm.folds_into_c(x)
    ):
        return None
    seq, pos = ctx.seqs[0], ctx.starts[0]
    k_cache, v_cache = seq.kv.k[layer], seq.kv.v[layer]
    check_context(pos + 1, k_cache.shape[0])
    cos, sin = rope(pos, 1, device)
    window = sliding_window if sliding_window and sliding_window > 0 else 0
    return group.attend(
        x, norm.c_args, k_cache, v_cache, pos, cos, sin, heads=heads, neox=neox, window=window
    )


def fused_decode_attention(ctx: Batch, layer: int, qkv: LinearGroup, norm: Norm, x: torch.Tensor,
                           rope: RopeTables, device: torch.device, *, heads: tuple[int, int, int], neox: bool,
                           sliding_window=None) -> torch.Tensor | None:  # fmt: skip
    """One decode token of one sequence in two launches of the fused decode kernels (kernels/triton_decode):
    RMS norm + q/k/v + RoPE + the cache write at pos, then attention over the cache in its dtype; where the
    group holds q/k/v as one matrix, RoPE rotates adjacent pairs over whole heads and Triton can run (a GPU,
    or the interpreter in tests), else None. The eager path is 44 launches on meta (norm, three products, RoPE,
    cache writes, the attention's casts and SDPA)."""
    h, hkv, dh = heads
    if (
        qkv.fused is None
        or neox
        or len(ctx.seqs) != 1
        or ctx.rows != 1
        or not norm.rms
        or dh & (dh - 1)
        or rope.config.rope_dim != dh
    ):
        return None
    from hotcold.kernels import triton as gpu

    if not gpu.available():
        return None
    from hotcold.kernels import triton_decode as td

    if not td.FusedPaths.enabled:
        return None
    seq, pos = ctx.seqs[0], ctx.starts[0]
    k_cache, v_cache = seq.kv.k[layer], seq.kv.v[layer]
    check_context(pos + 1, k_cache.shape[0])
    cos, sin = (t.float().contiguous() for t in rope.tables(pos + 1, device))
    at = ctx.start_on(device)  # one fill a token (not a host sync), shared by the layers on that device
    q = torch.empty(h * dh, dtype=torch.float32, device=device)
    out = torch.empty(h * dh, dtype=torch.float32, device=device)
    window = sliding_window if sliding_window and sliding_window > 0 else 0
    try:
        td.qkv_rope(
            qkv.fused,
            x[0],
            norm.weight,
            norm.eps,
            at,
            cos,
            sin,
            q,
            k_cache,
            v_cache,
            n_q=h * dh,
            n_kv=hkv * dh,
        )
        td.attention(q, k_cache, v_cache, at, out, n_head=h, head_dim=dh, window=window)
    except Exception as exc:  # the eager path then rewrites the cache at pos
        td.FusedPaths.fail(exc)
        return None
    return out.view(1, -1)


def one_call_decode(model, x: torch.Tensor, ctx: Batch) -> torch.Tensor | None:
    """The last layer's residual [rows, D] of a decode step from the one-call CPU decoder (cpu_step), where load
    chose it (model.cpu_decode) and it runs this forward; None: the family's layers run it."""
    decode = model.cpu_decode
    if decode is None or x.shape[0] != len(ctx.seqs):
        return None
    return decode(x, ctx)


def per_sequence(ctx: Batch, attend) -> torch.Tensor:
    """attend(row0, row1, seq, pos) -> [rows, H*Dh] for each segment, stacked in row order: attention is
    the one step where the rows of a batch see different caches."""
    if len(ctx.seqs) == 1:
        return attend(0, ctx.rows, ctx.seqs[0], ctx.starts[0])
    return torch.cat([attend(a, b, seq, pos) for a, b, seq, pos in ctx.segments()])


def layer_tails(layers) -> list:
    """Each layer's tail (o, residuals and the FFN as one C call: sparse/tails.py), chosen once at load from its
    FFN and o projection; None where the layer runs them op by op."""
    return [layer_tail(layer.ffn, layer.wo) for layer in layers]


def new_sequence(config: ModelConfig, plan: DevicePlan, n_ctx: int) -> SequenceState:
    """A sequence's state with each layer's KV cache on that layer's attention device, in its dtype."""
    return SequenceState.new(config, plan.attention, plan.kv_dtypes(), n_ctx)
