/* hotcold CPU kernels: sparse row-gather GEMV and sparse axpy over float and GGML block weights.
 *
 * Built lazily by hotcold/kernels/cpu.py (cc -O3 -march=native -fopenmp -shared -fPIC) and called
 * through ctypes, which releases the GIL for the duration of a call.
 *
 * Weights are [F, D] matrices given as a byte pointer plus a row stride in bytes; row i is neuron i.
 * Float types are converted to fp32 on load, block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
 * IQ4_NL, IQ4_XS) are dequantized
 * exactly as ggml does (w = d * q, bit for bit) inside the inner loop, reading the file's bytes once.
 * Activations and accumulation are fp32.
 *
 * Determinism (the original PowerInfer races in its axpy): every output element is produced by
 * exactly one thread with an arithmetic sequence that does not depend on the thread count or on
 * which other tokens share the call:
 *   - gather_matvec: rows of the (union) index list are split among threads; a dot product's
 *     accumulator layout is fixed (NACC vector accumulators, fixed reduction tree).
 *   - axpy: a token's active rows (ascending) are cut into blocks of HC_AXB rows; a block's sum is a
 *     chain of fused multiply-adds in row order starting from zero, and the output is the sum of the
 *     block sums in block order. Blocks are a property of the token's own rows, so threads can take
 *     whole blocks (whole rows, read as in the gather) and a batch reproduces each token exactly.
 * So results are bit-identical for any thread count, and a prefill batch equals token by token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifndef HC_PF
#define HC_PF 1 /* software prefetch of the next rows */
#endif
#ifndef HC_PF_HINT
#define HC_PF_HINT _MM_HINT_T0
#endif
#ifndef HC_G
#define HC_G 4 /* rows streamed side by side in a one-token gather */
#endif
#ifndef HC_AG
#define HC_AG 4 /* rows accumulated together in a one-token axpy (8 measured slower) */
#endif
#define HC_WANT_MAX 128 /* masked gathers of up to this many tokens list a row's tokens in one mask scan */
#ifndef HC_PF_L1_BYTES
/* Rows ahead are prefetched into L1 while the next group (HC_G or HC_AG rows) is at most this many
 * bytes, else into L2, where the group being read and the next one do not evict each other (measured:
 * F32 rows of 2048 gain 10-17%, F16 rows of 2048 lose ~3% in L2). */
#define HC_PF_L1_BYTES 16384
#endif
#ifndef HC_ITEM_ROWS
#define HC_ITEM_ROWS 64 /* most rows in one work item of a gather */
#endif
#ifndef HC_PK_ITEMS
#define HC_PK_ITEMS 8 /* work items per thread in a packed GEMV */
#endif
#ifndef HC_AXB
#define HC_AXB 64 /* active rows per block of an axpy sum (part of the arithmetic: fixed, never tuned per call) */
#endif
#ifndef HC_AXPY_PART_BYTES
#define HC_AXPY_PART_BYTES (256 * 1024) /* a batch axpy's partial sums per thread */
#endif
#if HC_G < 1 || HC_G > 4
#error "HC_G must be 1..4"
#endif

enum { WT_F32 = 0, WT_F16 = 1, WT_BF16 = 2, WT_Q8_0 = 3, WT_Q4_0 = 4, WT_Q5_0 = 5, WT_Q6_K = 6 };
/* Decoded through chunk_ints (below): one SIMD-independent decoder per type. */
enum { WT_Q4_1 = 7, WT_Q5_1 = 8, WT_Q2_K = 9, WT_Q3_K = 10, WT_Q4_K = 11, WT_Q5_K = 12, WT_IQ4_NL = 13, WT_IQ4_XS = 14,
       WT_MXFP4 = 15 };

#define HC_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------------
 * Scalar helpers
 * ---------------------------------------------------------------------------------------------- */

HC_INLINE uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

HC_INLINE uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

HC_INLINE float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__F16C__)
HC_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__aarch64__)
HC_INLINE float h2f(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
#else
HC_INLINE float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return f32_from_bits(sign);
        float v = (float)man * (1.0f / 16777216.0f); /* man * 2^-24, exact */
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}
#endif

HC_INLINE float bf2f(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* One element of a row, exactly dequantized (used for column tails of float types and for Q6_K
 * checks; block types never have tails because D is a multiple of the block size). */
HC_INLINE float wscalar(const int wt, const uint8_t *row, int64_t j) {
    switch (wt) {
    case WT_F32: {
        float v;
        memcpy(&v, row + 4 * j, 4);
        return v;
    }
    case WT_F16: return h2f(rd16(row + 2 * j));
    case WT_BF16: return bf2f(rd16(row + 2 * j));
    default: return 0.0f;
    }
}

/* Byte offset of 32-element chunk c inside a row. */
HC_INLINE int64_t chunk_off(const int wt, int64_t c) {
    switch (wt) {
    case WT_F32: return c * 128;
    case WT_F16:
    case WT_BF16: return c * 64;
    case WT_Q8_0: return c * 34;
    case WT_Q4_0: return c * 18;
    case WT_Q5_0: return c * 22;
    case WT_Q4_1: return c * 20;
    case WT_Q5_1: return c * 24;
    case WT_IQ4_NL: return c * 18;
    case WT_MXFP4: return c * 17;
    /* super-blocks of 256 values: the chunk's share of its block (for prefetching only) */
    case WT_Q2_K: return (c >> 3) * 84 + (c & 7) * 10;
    case WT_Q3_K: return (c >> 3) * 110 + (c & 7) * 13;
    case WT_Q4_K: return (c >> 3) * 144 + (c & 7) * 18;
    case WT_Q5_K: return (c >> 3) * 176 + (c & 7) * 22;
    case WT_IQ4_XS: return (c >> 3) * 136 + (c & 7) * 17;
    default: return (c >> 3) * 210 + (c & 7) * 26; /* Q6_K */
    }
}

