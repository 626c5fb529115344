"""CPU ops over any weight type: row-gather GEMV, sparse axpy, dense matmul, the one-call sparse FFN step,
grouped matvecs, RMS norm, a decode step's attention and dequantization.

Fallback contract: every public op computes its result (never None): in C (`_cpu_kernels.c`, built and
loaded by `build.py`) when the library is loaded and the inputs are ones the C code takes, else in torch
here, with the same results up to fp32 rounding (the C path pins bits: thread count and batching never
change them). Invalid inputs (shapes, non-CPU weights, a position outside the cache) raise ValueError on
both paths; `SparseFFNPlan` and `MatvecGroup` check their weights in the constructor (ValueError when
they cannot apply), and a built one always computes. `backend()` says which path runs ("c" or "torch").

Weights are [F, D]: row i is neuron i (ffn_up / ffn_gate, and ffn_down_t for the axpy). They are
float32/float16/bfloat16 torch tensors or `QuantTensor`s (Q8_0, Q4_0, Q5_0, Q6_K, ...), read in
their stored format: each needed row is read once per call, for all tokens that need it, and block
formats are dequantized on the fly. `dequantize_rows` is the fast float32 copy of a weight.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import build
from hotcold.kernels.build import WT as _WT
from hotcold.kernels.build import _reset_for_tests as _reset_for_tests  # re-exported for tests
from hotcold.kernels.build import (
    as_mask,
    as_tokens,
    backend,
    f32_contiguous,
    nthreads,
    ptr,
    simd,
    weight_view,
)
from hotcold.kernels.decode_glue import (  # re-exported: the ops' home
    apply_rope,
    attention_decode,
    attention_decode_rows,
    layer_norm,
    moe_route,
    rms_norm,
)
from hotcold.kernels.dequant import dequantize_rows  # re-exported
from hotcold.kernels.dequant import torch_axpy as _torch_axpy
from hotcold.kernels.dequant import torch_gather as _torch_gather
from hotcold.kernels.pages import anonymous as _anonymous
from hotcold.kernels.pages import page_out as _page_out
from hotcold.kernels.pages import prefetch_pages, rows_in_order

__all__ = [
    "Weight",
    "gather_matvec",
    "sparse_axpy",
    "matmul",
    "backend",
    "simd",
    "dequantize_rows",
    "pack",
    "prefetch_pages",
    "rows_in_order",
    "MatvecGroup",
    "rms_norm",
    "layer_norm",
    "moe_route",
    "attention_decode",
    "attention_decode_rows",
    "attention_prefill",
    "apply_rope",
]

Weight = torch.Tensor | QuantTensor

# Below GEMM_MIN_TOKENS rows every matmul runs the C kernels, so every row's bits are its own
# (batching.MAX_ROWS). Above it matmul takes whichever path is faster (2 threads, 5632 x 2048, G MAC/s):
# packed weights stay in C at any T (Q4_0 / Q4_K ~100, Q8_0 ~84, against the GEMM path's 47-68 at T=96-256),
# the F16 / BF16 tile below FLOAT_TILE_MAX_TOKENS (62 against 42-52 at T=96-128, even at 160, 4-11% behind
# at 192-256); the other block types go to torch's GEMM (their row kernel at T=96-256: Q5_0 31-35 against
# 47-69, Q4_1 41-52 against 35-58).
GEMM_MIN_TOKENS = 96
FLOAT_TILE_MAX_TOKENS = 160


def runs_c_kernel(weight: Weight, t: int) -> bool:
    """Whether matmul multiplies t tokens by this weight in the C kernels (with the C backend)."""
    qtype = weight_view(weight)[0]
    if isinstance(weight, QuantTensor) and weight.packed is not None:
        return True
    return t < (FLOAT_TILE_MAX_TOKENS if qtype in (build.Q.F16, build.Q.BF16) else GEMM_MIN_TOKENS)


def _run_row_kernel(fn, qtype, data, stride: int, f: int, d: int, inp, mask, out, threads) -> None:
    """hc_gather_matvec / hc_sparse_axpy on checked arguments (inp: x [T, D] or a [T, F] float32)."""
    args = (_WT[qtype], data.data_ptr(), stride, f, d, inp.data_ptr(), inp.shape[0], ptr(mask))
    rc = fn(*args, out.data_ptr(), nthreads(threads))
    if rc != 0:
        raise MemoryError(f"{fn.__name__}: out of memory")


def gather_matvec(
    weight: Weight, x: torch.Tensor, rows: torch.Tensor | None, *, threads: int | None = None
) -> torch.Tensor:
    """out[t, i] = dot(W[i], x[t]) where rows is None or rows[t, i], exactly 0 elsewhere: weight [F, D];
    x [T, D] (or [D]) float32; rows None, bool [T, F] or bool [F] -> float32 [T, F] (or [F])."""
    return _row_op(False, weight, x, rows, threads)


def sparse_axpy(
    weight_t: Weight, a: torch.Tensor, rows: torch.Tensor | None, *, threads: int | None = None
) -> torch.Tensor:
    """out[t] = sum over i with (rows is None or rows[t, i]) and a[t, i] != 0 of a[t, i] * W_t[i].

    weight_t [F, D] (row i = neuron i's output direction, ffn_down_t); a [T, F] (or [F]) float32;
    rows None, bool [T, F] or bool [F] -> float32 [T, D] (or [D]). A token's rows are summed in ascending
    order in blocks of 64, then the block sums in order (see _cpu_kernels.c): the same bits for any thread
    count and batch.
    """
    return _row_op(True, weight_t, a, rows, threads)


def _row_op(axpy: bool, weight: Weight, inp: torch.Tensor, rows, threads) -> torch.Tensor:
    """gather_matvec (inp = x [T, D]) or sparse_axpy (inp = a [T, F]): checks, then C or torch."""
    qtype, data, stride, f, d = weight_view(weight)
    inp2, one = as_tokens(inp, f, "a") if axpy else as_tokens(inp, d, "x")
    t = inp2.shape[0]
    mask = as_mask(rows, t, f)
    lib = build.get_lib()
    if lib is None:
        out = (_torch_axpy if axpy else _torch_gather)(weight, inp2, mask)
    else:
        out = torch.empty(t, d if axpy else f, dtype=torch.float32)
        fn = lib.hc_sparse_axpy if axpy else lib.hc_gather_matvec
        _run_row_kernel(fn, qtype, data, stride, f, d, inp2, mask, out, threads)
    return out[0] if one else out


def matmul(weight: Weight, x: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    """Dense x @ W.T for any weight type: x [T, D] (or [D]) -> float32 [T, F] (or [F]).

    The C kernels where `runs_c_kernel` says so (always below GEMM_MIN_TOKENS); else blocks of rows
    dequantized into a small float32 buffer and torch's GEMM, which is compute- not bandwidth-bound there.
    """
    qtype, data, stride, f, d = weight_view(weight)
    x2, one = as_tokens(x, d, "x")
    t = x2.shape[0]
    lib = build.get_lib()
    packed = weight.packed if isinstance(weight, QuantTensor) else None
    c_kernel = lib is not None and runs_c_kernel(weight, t)
    if c_kernel and packed is not None:
        out = torch.empty(t, f, dtype=torch.float32)
        if lib.hc_packed_matvec(
            _WT[qtype], packed.data_ptr(), f, d, x2.data_ptr(), t, out.data_ptr(), nthreads(threads)
        ):
            raise MemoryError("hc_packed_matvec failed")
    elif c_kernel:  # gather_matvec over every row, without its checks again
        out = torch.empty(t, f, dtype=torch.float32)
        _run_row_kernel(lib.hc_gather_matvec, qtype, data, stride, f, d, x2, None, out, threads)
    elif lib is None:
        out = _torch_gather(weight, x2, None)
    elif isinstance(weight, torch.Tensor) and qtype == build.Q.F32:
        out = x2 @ weight.T
    else:
        out = torch.empty(t, f, dtype=torch.float32)
        block = max(1, (1 << 22) // max(1, d))  # 16 MiB float32 buffer
        buf = torch.empty(min(block, f), d, dtype=torch.float32)
        for r0 in range(0, f, block):
            r1 = min(f, r0 + block)
            w = dequantize_rows(weight, r0, r1, out=buf[: r1 - r0], threads=threads)
            torch.matmul(x2, w.T, out=out[:, r0:r1])
    return out[0] if one else out


def attention_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, *, threads: int | None = None
) -> torch.Tensor | None:
    """Causal attention of a prompt chunk, one C call (c/prefill_attention.c): q [T, H, Dh] float32 (RoPE applied)
    at positions pos..pos+T-1 over the float32 caches [S, Hkv, Dh] (rows up to pos+T-1 already written) ->
    [T, H*Dh]; None where the C path does not run (no C kernels, other dtypes or layouts, a head size it has no
    registers for): the caller's own attention then."""
    lib = build.get_lib()
    t, h, dh = q.shape
    ok = q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.shape == v_cache.shape
    if (
        lib is None
        or not ok
        or not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    hkv = k_cache.shape[1]
    if k_cache.shape[2] != dh or pos + t > k_cache.shape[0]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold {t} queries of {h} x {dh} at {pos}")
    out = torch.empty(t, h * dh, dtype=torch.float32)
    args = (t, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos, h, hkv, dh, out.data_ptr())
    rc = lib.hc_attn_prefill(*args, nthreads(threads))
    if rc < 0:
        raise MemoryError("hc_attn_prefill: out of memory")
    return out if rc == 0 else None


def norm_weight(norm: tuple[torch.Tensor, float] | None, d: int) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of an RMS norm applied inside a C call -> (float32 contiguous weight or None, eps)."""
    if norm is None:
        return None, 0.0
    weight, eps = norm
    weight = weight.to(torch.float32).contiguous()
    if weight.shape != (d,) or not weight.is_cpu:
        raise ValueError(f"norm weight {tuple(weight.shape)} on {weight.device}: expected [{d}] on the CPU")
    return weight, float(eps)


def pack(weight: Weight, out: torch.Tensor | None = None) -> Weight:
    """`weight` with a repacked copy for whole-matrix products (`matmul` then uses it for few tokens:
    about twice the speed of the row kernel for Q4_0; a float16 matrix becomes a QuantTensor over its own
    memory, packed in row blocks with one fma chain per output, 1.6-1.9x the row layout at 8 tokens and
    about the same at one; bfloat16 alike), or `weight` itself where there is no packed form (other types,
    float32, no C kernels, not on the CPU). For matrices that are never gathered row by row: the copy is as
    large as the matrix, and the file's rows stay as they are. out: uint8 memory to pack into (reused by the
    expert cache, storage/experts.py), else new memory."""
    weight, nbytes = _packable(weight)
    if not nbytes or weight.packed is not None:
        return weight
    lib = build.get_lib()
    qtype, data, stride, f, d = weight_view(weight)
    # Huge pages asked for: the products stream every packed matrix each step, and with 4 KiB pages the
    # 89 of the 1B synthetic (546 MB) ran at 43.5 GB/s for one token and 38.6 for eight, against 45.9 and
    # 40.9 from huge pages (2 threads, 15 alternating rounds).
    if out is not None and out.numel() < nbytes:
        raise ValueError(f"pack: out holds {out.numel()} bytes, the packed copy needs {nbytes}")
    packed = _anonymous((nbytes,), torch.uint8, huge=True) if out is None else out[:nbytes]
    if lib.hc_pack(_WT[qtype], data.data_ptr(), stride, f, d, packed.data_ptr()) != 0:
        return weight
    if out is None:  # (memory given to pack into is the expert cache's, its rows anonymous: nothing to drop)
        _page_out(data.data_ptr(), f * stride)  # the copy serves from now on: one copy in RSS, not two
    return QuantTensor(weight.data, weight.qtype, weight.shape, packed=packed)


def packed_nbytes(weight: Weight) -> int:
    """Bytes of `weight`'s packed copy (`pack`), or 0 where it has none."""
    return _packable(weight)[1]


def _packable(weight: Weight) -> tuple[Weight, int]:
    """(`weight`, a 16-bit float matrix as a QuantTensor over its memory; the bytes of its packed copy, 0 where it
    has none: other types, float32, no C kernels, not on the CPU)."""
    lib = build.get_lib()
    if lib is not None and isinstance(weight, torch.Tensor) and weight.dtype in _QTYPE_16:
        weight = _as_quant(weight)  # 16-bit float rows have a packed form too
    if lib is None or not isinstance(weight, QuantTensor) or not weight.data.is_cpu:
        return weight, 0
    qtype, _, _, f, d = weight_view(weight)
    return weight, max(0, int(lib.hc_packed_nbytes(_WT[qtype], f, d)))


_QTYPE_16 = {torch.float16: GGMLQuantizationType.F16, torch.bfloat16: GGMLQuantizationType.BF16}


def _as_quant(weight: torch.Tensor) -> Weight:
    """A CPU float16 / bfloat16 matrix as a QuantTensor over the same memory (no copy), which can carry a
    packed copy; the tensor itself where it is not a contiguous 2-D CPU matrix."""
    if weight.dim() != 2 or not weight.is_cpu or not weight.is_contiguous():
        return weight
    f, d = weight.shape
    return QuantTensor(weight.view(torch.uint8).reshape(f, 2 * d), _QTYPE_16[weight.dtype], (f, d))


class MatvecGroup:
    """[matmul(w, x) for w in weights] for few tokens, as one C call (a layer's q, k and v: the rows of
    all of them share one pass of the threads), with the same bits as separate calls. Weights must be
    CPU weights of the C kernels' types with the same number of columns, all packed (`pack`) or none
    (else ValueError); the group keeps them alive. Without the C kernels, or for many tokens of unpacked
    weights, it is separate matmul calls."""

    def __init__(self, weights: list[Weight]):
        views = [weight_view(w) for w in weights]
        if not 1 <= len(views) <= 8 or len({v[4] for v in views}) != 1:
            raise ValueError("a matvec group is 1-8 matrices with the same number of columns")
        packed = [w.packed if isinstance(w, QuantTensor) else None for w in weights]
        self._packed = all(p is not None for p in packed)
        if not self._packed and any(p is not None for p in packed):
            raise ValueError(
                "a matvec group's weights are all packed or none (each layout has its own kernel)"
            )
        n = len(views)
        self.weights = list(weights)
        self.d = views[0][4]
        self.rows = [v[3] for v in views]
        self._wts = (ctypes.c_int * n)(*[_WT[v[0]] for v in views])
        data = packed if self._packed else [v[1] for v in views]
        self._ptrs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in data])
        self._strides = (ctypes.c_int64 * n)(*[v[2] for v in views])
        self._fs = (ctypes.c_int64 * n)(*self.rows)
        self._out_ptrs = ctypes.c_void_p * n

    @property
    def packed(self) -> bool:
        """Whether the group multiplies packed copies (then one C call at any token count)."""
        return self._packed

    @property
    def c_fields(self) -> dict:
        """The group as hc_decode_head takes it (build.HCLayer's wts, Ws, strides, Fs, packed); the group
        keeps the arrays alive."""
        return dict(
            wts=self._wts, Ws=self._ptrs, strides=self._strides, Fs=self._fs, packed=int(self._packed)
        )

    def __call__(
        self, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None, threads: int | None = None
    ) -> list[torch.Tensor]:
        """With norm = (weight, eps), the matrices multiply rms_norm(x) (in the same C call for few tokens,
        else `rms_norm` first: the same bits)."""
        lib = build.get_lib()
        x2, one = as_tokens(x, self.d, "x")
        t = x2.shape[0]
        norm_w, eps = norm_weight(norm, self.d)
        if lib is None or (t >= GEMM_MIN_TOKENS and not self._packed):  # packed: one call at any t (the GEMM)
            h = x2 if norm_w is None else rms_norm(x2, norm_w, eps)
            outs = [matmul(w, h, threads=threads) for w in self.weights]
            return [o[0] for o in outs] if one else outs
        outs = [torch.empty(t, f, dtype=torch.float32) for f in self.rows]
        out_ptrs = self._out_ptrs(*[o.data_ptr() for o in outs])  # per call: two threads may share a model
        if self._packed:
            fn, weights = lib.hc_packed_matvec_multi, (len(outs), self._wts, self._ptrs, self._fs, self.d)
        else:
            fn, weights = (
                lib.hc_matvec_multi,
                (len(outs), self._wts, self._ptrs, self._strides, self._fs, self.d),
            )
        if fn(*weights, x2.data_ptr(), t, ptr(norm_w), eps, out_ptrs, nthreads(threads)) != 0:
            raise MemoryError(f"{fn.__name__} failed")
        return [o[0] for o in outs] if one else outs

    def attend(self, x, norm, k_cache, v_cache, pos: int, cos, sin, *, heads: tuple[int, int, int], neox: bool,
               window: int, threads=None) -> torch.Tensor | None:  # fmt: skip
        """This group as a layer's q, k, v for ONE token, then attention_decode over the caches at pos, in
        one C call: [1, H*Dh] with the bits of the group call and attention_decode one after the other.
        heads = (H, Hkv, Dh). None where that call does not apply (the caller then makes the two calls)."""
        lib, (h, hkv, dh) = build.get_lib(), heads
        if lib is None or self.rows != [h * dh, hkv * dh, hkv * dh] or x.shape != (1, self.d) or h % hkv:
            return None
        r = cos.shape[-1] * 2
        tensors = (x, cos, sin, k_cache, v_cache)
        if (
            cos.shape != (1, r // 2)
            or sin.shape != cos.shape
            or r > dh
            or not all(map(f32_contiguous, tensors))
        ):
            return None
        if (
            k_cache.shape[1:] != (hkv, dh)
            or v_cache.shape != k_cache.shape
            or not 0 <= pos < k_cache.shape[0]
        ):
            return None
        norm_w, eps = norm_weight(norm, self.d)
        outs = [torch.empty(1, f, dtype=torch.float32) for f in self.rows]
        out = torch.empty(1, h * dh, dtype=torch.float32)
        group = (3, self._wts, self._ptrs, self._strides, self._fs, int(self._packed), self.d, x.data_ptr())
        caches = (self._out_ptrs(*[o.data_ptr() for o in outs]), k_cache.data_ptr(), v_cache.data_ptr(), pos)
        rope = (h, hkv, dh, r, cos.data_ptr(), sin.data_ptr(), int(neox), window)
        if (
            lib.hc_decode_head(*group, ptr(norm_w), eps, *caches, *rope, out.data_ptr(), nthreads(threads))
            != 0
        ):
            raise MemoryError("hc_decode_head failed")
        return out
