/* hotcold's CPU kernels, compiled as one translation unit (inlining across the pieces, one build cache
 * entry): the pieces in kernels/c/, in this order. The contract (determinism, layouts) opens c/base.c. */
#include "c/base.c" /* the contract, includes, weight type codes, scalar helpers */
#include "c/hotcold.h" /* what Python calls: every exported function and struct (bound by cabi.py) */
#include "c/simd.c" /* the SIMD layer (AVX-512, AVX2, portable) and the block types decoded without SIMD code */
#include "c/dots.c" /* dot products of weight rows with token vectors: float, and integer for block weights */
#include "c/row_kernels.c" /* the gather (GEMV) tiles and the axpy blocks and batches over rows */
#include "c/row_calls.c" /* thread splitting and the exported GEMV, matvec group, axpy and dequantize calls */
#include "c/packed.c" /* dense GEMV over a repacked copy */
#include "c/packed_gemm.c" /* the same products as a GEMM for prompt chunks (tiles of tokens and rows) */
#include "c/ffn.c" /* the sparse, dense and thresholded FFN steps and decode tails */
#include "c/decode.c" /* a decode layer (hc_layer) and a whole decode step (hc_decode_step) */
#include "c/norm_attention.c" /* RMS norm, LayerNorm, RoPE and attention over the KV caches */
#include "c/prefill_attention.c" /* a prompt chunk's causal attention as small GEMMs */
#include "c/screen.c" /* the output head's Q8_0 screen with per-row error bounds (head_screen.py) */
