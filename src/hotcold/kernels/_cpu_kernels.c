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

#define HC_ABI_VERSION 28
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
enum { WT_Q4_1 = 7, WT_Q5_1 = 8, WT_Q2_K = 9, WT_Q3_K = 10, WT_Q4_K = 11, WT_Q5_K = 12, WT_IQ4_NL = 13, WT_IQ4_XS = 14 };

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
    /* super-blocks of 256 values: the chunk's share of its block (for prefetching only) */
    case WT_Q2_K: return (c >> 3) * 84 + (c & 7) * 10;
    case WT_Q3_K: return (c >> 3) * 110 + (c & 7) * 13;
    case WT_Q4_K: return (c >> 3) * 144 + (c & 7) * 18;
    case WT_Q5_K: return (c >> 3) * 176 + (c & 7) * 22;
    case WT_IQ4_XS: return (c >> 3) * 136 + (c & 7) * 17;
    default: return (c >> 3) * 210 + (c & 7) * 26; /* Q6_K */
    }
}

/* ------------------------------------------------------------------------------------------------
 * SIMD layer: vf is VL floats; load32 produces one 32-element chunk as NV = 32 / VL vectors.
 * ---------------------------------------------------------------------------------------------- */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HC_SIMD "avx512"
#define VL 16
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vloadu(p) _mm512_loadu_ps(p)
#define vstoreu(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
HC_INLINE vf vload_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
HC_INLINE float vhsum(vf v) {
    /* the upper half through the AVX512F extract (extractf32x8 is AVX512DQ, which the guard does not ask for) */
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
HC_INLINE vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
HC_INLINE vf vload_bf16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
/* fp16 scale at p broadcast to all lanes: broadcast the 16-bit pattern, then convert (3 uops). */
HC_INLINE vf vbcast_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_set1_epi16((short)rd16(p))); }
HC_INLINE void load_q8_0(const uint8_t *b, vf *w) {
    const vf d = vbcast_f16(b);
    w[0] = vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
    w[1] = vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
}
/* Q4_0: w = d * (q - 8) looked up in a 16-entry table (vpermps uses the low 4 index bits). */
HC_INLINE void load_q4_0(const uint8_t *b, vf *w) {
    const vf tab = vmul(vbcast_f16(b),
                        _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    w[0] = _mm512_permutexvar_ps(q, tab);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab);
}
/* Q5_0: 5-bit index into a 32-entry table d * (q - 16) spread over two registers. */
HC_INLINE void load_q5_0(const uint8_t *b, vf *w) {
    const vf d = vbcast_f16(b);
    const vf t0 = vmul(d, _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1));
    const vf t1 = vmul(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const uint32_t qh = rd32(b + 2);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
    __m512i hi = _mm512_srli_epi32(q, 4);
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xffff), lo, sixteen);
    hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
    w[0] = _mm512_permutex2var_ps(t0, lo, t1);
    w[1] = _mm512_permutex2var_ps(t0, hi, t1);
}
/* Q6_K: chunk j (0..7) of a 256-element super-block; w = (d * scale) * q as ggml computes it. */
HC_INLINE void load_q6_k(const uint8_t *b, int j, vf *w) {
    const int h = j >> 2, qq = j & 3;
    const uint8_t *ql = b + h * 64 + (qq & 1) * 32;
    const uint8_t *qh = b + 128 + h * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
    const float d = h2f(rd16(b + 208));
    for (int v = 0; v < 2; v++) {
        __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * v)));
        l = (qq >= 2) ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, _mm512_set1_epi32(15));
        __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * v)));
        hb = _mm512_and_si512(_mm512_srli_epi32(hb, 2 * qq), _mm512_set1_epi32(3));
        __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(hb, 4)), _mm512_set1_epi32(32));
        w[v] = vmul(_mm512_cvtepi32_ps(q), vset1(d * (float)sc[v]));
    }
}
HC_INLINE void vprefetch(const void *p) { _mm_prefetch((const char *)p, HC_PF_HINT); }
HC_INLINE void vprefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
/* Attention helpers (attn_head's vector path). vmaxv: lane max that keeps a NaN of b. vround and
 * vscale2: vexp's (after the SIMD sections) rounding to an integer and p * 2^n. vsum_rows: out[p] = the
 * sum of acc[p]'s lanes for VL vectors, in a tree of shuffles and adds. */
#define HC_ATTN_VEC 1
HC_INLINE vf vmaxv(vf a, vf b) { return _mm512_max_ps(a, b); }
HC_INLINE vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HC_INLINE vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
HC_INLINE float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
HC_INLINE vf vsum_rows(const vf *acc) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: t[i] = (acc[2i] | acc[2i+1]), 8 partials each */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lanes: 4 positions of 4 partials */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    static const int order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15}; /* z holds a 4 x 4 transpose */
    return _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)order), z);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HC_SIMD "avx2"
#define VL 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vloadu(p) _mm256_loadu_ps(p)
#define vstoreu(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
HC_INLINE vf vload_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
HC_INLINE float vhsum(vf v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
HC_INLINE vf vload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
HC_INLINE vf vload_bf16(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
HC_INLINE __m256i ld8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
HC_INLINE void load_q8_0(const uint8_t *b, vf *w) {
    const vf d = vset1(h2f(rd16(b)));
    for (int v = 0; v < 4; v++)
        w[v] = vmul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v)))), d);
}
HC_INLINE void load_q4_0(const uint8_t *b, vf *w) {
    const vf d = vset1(h2f(rd16(b)));
    const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int v = 0; v < 2; v++) {
        __m256i q = ld8_u8(b + 2 + 8 * v);
        w[v] = vmul(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, m15), eight)), d);
        w[v + 2] = vmul(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight)), d);
    }
}
HC_INLINE void load_q5_0(const uint8_t *b, vf *w) {
    const vf d = vset1(h2f(rd16(b)));
    const uint32_t qh = rd32(b + 2);
    const __m256i m15 = _mm256_set1_epi32(15), sixteen = _mm256_set1_epi32(16), one = _mm256_set1_epi32(1);
    const __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 4; v++) {
        __m256i q = ld8_u8(b + 6 + 8 * (v & 1));
        q = (v < 2) ? _mm256_and_si256(q, m15) : _mm256_srli_epi32(q, 4);
        __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (8 * v))), sh), one);
        q = _mm256_sub_epi32(_mm256_or_si256(q, _mm256_slli_epi32(hb, 4)), sixteen);
        w[v] = vmul(_mm256_cvtepi32_ps(q), d);
    }
}
HC_INLINE void load_q6_k(const uint8_t *b, int j, vf *w) {
    const int h = j >> 2, qq = j & 3;
    const uint8_t *ql = b + h * 64 + (qq & 1) * 32;
    const uint8_t *qh = b + 128 + h * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
    const float d = h2f(rd16(b + 208));
    for (int v = 0; v < 4; v++) {
        __m256i l = ld8_u8(ql + 8 * v);
        l = (qq >= 2) ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, _mm256_set1_epi32(15));
        __m256i hb = _mm256_and_si256(_mm256_srli_epi32(ld8_u8(qh + 8 * v), 2 * qq), _mm256_set1_epi32(3));
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(hb, 4)), _mm256_set1_epi32(32));
        w[v] = vmul(_mm256_cvtepi32_ps(q), vset1(d * (float)sc[v >> 1]));
    }
}
HC_INLINE void vprefetch(const void *p) { _mm_prefetch((const char *)p, HC_PF_HINT); }
HC_INLINE void vprefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
/* Attention helpers: see the AVX-512 section. */
#define HC_ATTN_VEC 1
HC_INLINE vf vmaxv(vf a, vf b) { return _mm256_max_ps(a, b); }
HC_INLINE vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
HC_INLINE vf vscale2(vf p, vf n) { /* p * 2^n through the exponent bits: n >= -126 in vexp; a NaN's n
                                      converts to INT_MIN, and NaN * anything stays NaN */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
HC_INLINE float vhmax(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
HC_INLINE vf vsum_rows(const vf *acc) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

#else /* portable: GCC vector extensions (any architecture) */
#define HC_SIMD "generic"
#define VL 8
typedef float vf __attribute__((vector_size(32)));
HC_INLINE vf vzero(void) { return (vf){0, 0, 0, 0, 0, 0, 0, 0}; }
HC_INLINE vf vset1(float x) { return (vf){x, x, x, x, x, x, x, x}; }
HC_INLINE vf vloadu(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
HC_INLINE void vstoreu(float *p, vf v) { memcpy(p, &v, sizeof v); }
HC_INLINE vf vfma(vf a, vf b, vf c) {
    vf r;
    for (int i = 0; i < VL; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}
#define vadd(a, b) ((a) + (b))
#define vmul(a, b) ((a) * (b))
#define vsub(a, b) ((a) - (b))
HC_INLINE vf vload_i8(const int8_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = (float)p[i];
    return v;
}
HC_INLINE float vhsum(vf v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
HC_INLINE vf vload_f16(const uint16_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = h2f(p[i]);
    return v;
}
HC_INLINE vf vload_bf16(const uint16_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = bf2f(p[i]);
    return v;
}
HC_INLINE void load_q8_0(const uint8_t *b, vf *w) {
    const float d = h2f(rd16(b));
    for (int i = 0; i < 32; i++) w[i / VL][i % VL] = (float)(int8_t)b[2 + i] * d;
}
HC_INLINE void load_q4_0(const uint8_t *b, vf *w) {
    const float d = h2f(rd16(b));
    for (int i = 0; i < 16; i++) {
        w[i / VL][i % VL] = (float)((b[2 + i] & 15) - 8) * d;
        w[(i + 16) / VL][(i + 16) % VL] = (float)((b[2 + i] >> 4) - 8) * d;
    }
}
HC_INLINE void load_q5_0(const uint8_t *b, vf *w) {
    const float d = h2f(rd16(b));
    const uint32_t qh = rd32(b + 2);
    for (int i = 0; i < 16; i++) {
        int lo = (b[6 + i] & 15) | (((qh >> i) & 1) << 4), hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        w[i / VL][i % VL] = (float)(lo - 16) * d;
        w[(i + 16) / VL][(i + 16) % VL] = (float)(hi - 16) * d;
    }
}
HC_INLINE void load_q6_k(const uint8_t *b, int j, vf *w) {
    const int h = j >> 2, qq = j & 3;
    const uint8_t *ql = b + h * 64 + (qq & 1) * 32;
    const uint8_t *qh = b + 128 + h * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
    const float d = h2f(rd16(b + 208));
    for (int l = 0; l < 32; l++) {
        int lo = (qq >= 2) ? (ql[l] >> 4) : (ql[l] & 15);
        int q = (lo | (((qh[l] >> (2 * qq)) & 3) << 4)) - 32;
        w[l / VL][l % VL] = (d * (float)sc[l / 16]) * (float)q;
    }
}
HC_INLINE void vprefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
HC_INLINE void vprefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }
#define HC_ATTN_VEC 0
#endif

#if HC_ATTN_VEC
/* e^x to about 2 ulp for x in [-87.3, 0] (the softmax's x - max; below, the normal minimum, negligible
 * beside the maximum's 1); NaN stays NaN: x = n ln2 + r, a degree-6 polynomial in r, times 2^n. */
HC_INLINE vf vexp(vf x) {
    x = vmaxv(vset1(-87.3f), x);
    const vf n = vround(vmul(x, vset1(1.44269504f)));
    vf r = vfma(n, vset1(-0.693145752f), x); /* x - n ln2 in two parts, each one rounding */
    r = vfma(n, vset1(-1.42860677e-6f), r);
    vf p = vset1(1.0f / 720.0f);
    p = vfma(p, r, vset1(1.0f / 120.0f));
    p = vfma(p, r, vset1(1.0f / 24.0f));
    p = vfma(p, r, vset1(1.0f / 6.0f));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vscale2(p, n);
}
#endif

/* Prefetch rows pf[0..n) (NULL entries, or pf NULL: nothing) from byte *pfo up to byte end, a line at a
 * time, into L1 or (pf_l2) L2: the row kernels call it as they stream, to keep the next rows coming. */
HC_INLINE void prefetch_rows(const uint8_t *const *pf, int n, int64_t *pfo, int64_t end, int pf_l2) {
#if HC_PF
    if (!pf) return;
    for (; *pfo < end; *pfo += 64)
        for (int r = 0; r < n; r++)
            if (pf[r]) {
                if (pf_l2) vprefetch_l2(pf[r] + *pfo);
                else vprefetch(pf[r] + *pfo);
            }
#else
    (void)pf, (void)n, (void)pfo, (void)end, (void)pf_l2;
#endif
}

#define NV (32 / VL) /* vectors per 32-element chunk */
#ifndef UNR
#define UNR 1 /* chunks per step of a dot product (1: one cache line of F16 per row per step) */
#endif
/* Vector accumulators per dot product: vector v of a chunk goes into accumulator v % NACC, so a dot's
 * fma chain is the same whatever else shares its pass (2: enough chains in flight for one token, few
 * enough registers that several tokens share a pass over a row on AVX2). */
#define NACC 2
#define ACC_OF(u, v) (((u) * NV + (v)) % NACC)
#ifndef NTMAX /* tokens sharing one pass over a weight row: NTMAX * NACC accumulators in registers */
#if VL == 16
#define NTMAX 8
#else
#define NTMAX 4
#endif
#endif

/* Fixed pairwise reduction of a token's NACC accumulators. */
HC_INLINE vf vsum_acc(const vf *a) {
#if NACC == 2
    return vadd(a[0], a[1]);
#elif NACC == 4
    return vadd(vadd(a[0], a[1]), vadd(a[2], a[3]));
#elif NACC == 8
    return vadd(vadd(vadd(a[0], a[1]), vadd(a[2], a[3])), vadd(vadd(a[4], a[5]), vadd(a[6], a[7])));
#else
#error "unsupported NACC"
#endif
}


/* ------------------------------------------------------------------------------------------------
 * The other block types, decoded without SIMD code of their own: a 32-value chunk becomes 32 small
 * integers plus the scale (and min) of each half of 16, and emit_chunk turns those into floats with
 * ggml's formula and rounding: s * q (MUL), s * q - m (SUB, the K-quants with a min), s * q + m (ADD,
 * Q4_1 and Q5_1). The decoders are plain byte loops (the compiler vectorises them); ggml's layouts
 * are in quants.py.
 * ---------------------------------------------------------------------------------------------- */
typedef struct {
    int8_t q[32];
    float s[2], m[2]; /* per half of 16 values */
} chunk_ints;

enum { AFF_MUL = 0, AFF_SUB = 1, AFF_ADD = 2 };

static const int8_t IQ4_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

HC_INLINE void emit_chunk(const chunk_ints *ci, const int mode, vf *w) {
    for (int v = 0; v < NV; v++) {
        const int h = (v * VL) / 16;
        vf x = vmul(vset1(ci->s[h]), vload_i8(ci->q + v * VL));
        if (mode == AFF_SUB) x = vsub(x, vset1(ci->m[h]));
        else if (mode == AFF_ADD) x = vadd(x, vset1(ci->m[h]));
        w[v] = x;
    }
}

HC_INLINE void both_halves(chunk_ints *ci, float s, float m) {
    ci->s[0] = ci->s[1] = s;
    ci->m[0] = ci->m[1] = m;
}

/* Q4_1, 20 bytes: d, m, qs[16]; value l < 16 is the low nibble of qs[l], l >= 16 the high one. */
HC_INLINE void dec_q4_1(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), h2f(rd16(b + 2)));
    for (int l = 0; l < 16; l++) {
        ci->q[l] = (int8_t)(b[4 + l] & 15);
        ci->q[l + 16] = (int8_t)(b[4 + l] >> 4);
    }
}

/* Q5_1, 24 bytes: d, m, u32 qh (bit l is bit 4 of value l), qs[16] as Q4_1. */
HC_INLINE void dec_q5_1(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), h2f(rd16(b + 2)));
    const uint32_t qh = rd32(b + 4);
    for (int l = 0; l < 16; l++) {
        ci->q[l] = (int8_t)((b[8 + l] & 15) | (((qh >> l) & 1) << 4));
        ci->q[l + 16] = (int8_t)((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
    }
}

/* IQ4_NL, 18 bytes: d, qs[16] as Q4_0, each nibble an index into the non-linear table. */
HC_INLINE void dec_iq4_nl(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), 0.0f);
    for (int l = 0; l < 16; l++) {
        ci->q[l] = IQ4_KVALUES[b[2 + l] & 15];
        ci->q[l + 16] = IQ4_KVALUES[b[2 + l] >> 4];
    }
}

/* Chunk j (0..7) of a 256-value super-block: values 32j..32j+31. */

/* Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min of each 16 values), qs[64], d, dmin.
 * Value 32j + l is bits 2(j%4).. of qs[32(j/4) + l]. */
HC_INLINE void dec_q2_k(const uint8_t *b, int j, chunk_ints *ci) {
    const float d = h2f(rd16(b + 80)), dmin = h2f(rd16(b + 82));
    const uint8_t *qs = b + 16 + (j >> 2) * 32;
    const int sh = 2 * (j & 3);
    for (int k = 0; k < 2; k++) {
        ci->s[k] = d * (float)(b[2 * j + k] & 15);
        ci->m[k] = dmin * (float)(b[2 * j + k] >> 4);
    }
    for (int l = 0; l < 32; l++) ci->q[l] = (int8_t)((qs[l] >> sh) & 3);
}

/* Q3_K, 110 bytes: hmask[32] (bit j of hmask[l]: value 32j + l has no -4 offset), qs[64] (2 low bits
 * as Q2_K), scales[12] (16 six-bit scales, minus 32), d. */
HC_INLINE void dec_q3_k(const uint8_t *b, int j, chunk_ints *ci) {
    const uint8_t *hm = b, *qs = b + 32 + (j >> 2) * 32, *sc = b + 96;
    const float d = h2f(rd16(b + 108));
    const int sh = 2 * (j & 3);
    for (int k = 0; k < 2; k++) {
        const int i = 2 * j + k;
        const int lo = (sc[i & 7] >> (4 * (i >> 3))) & 15, hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        ci->s[k] = d * (float)((lo | (hi << 4)) - 32);
        ci->m[k] = 0.0f;
    }
    for (int l = 0; l < 32; l++)
        ci->q[l] = (int8_t)(((qs[l] >> sh) & 3) - ((((hm[l] >> j) & 1) ^ 1) << 2));
}

/* The six-bit scale and min of sub-block j of Q4_K / Q5_K (ggml's get_scale_min_k4). */
HC_INLINE void scale_min_k4(const uint8_t *sc, int j, int *s, int *m) {
    if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Q4_K, 144 bytes: d, dmin, scales[12], qs[128]; value 32j + l is nibble j%2 of qs[32(j/2) + l]. */
HC_INLINE void dec_q4_k(const uint8_t *b, int j, chunk_ints *ci) {
    int s, m;
    scale_min_k4(b + 4, j, &s, &m);
    both_halves(ci, h2f(rd16(b)) * (float)s, h2f(rd16(b + 2)) * (float)m);
    const uint8_t *qs = b + 16 + (j >> 1) * 32;
    const int sh = 4 * (j & 1);
    for (int l = 0; l < 32; l++) ci->q[l] = (int8_t)((qs[l] >> sh) & 15);
}

/* Q5_K, 176 bytes: d, dmin, scales[12], qh[32] (bit j of qh[l] is bit 4 of value 32j + l), qs[128]. */
HC_INLINE void dec_q5_k(const uint8_t *b, int j, chunk_ints *ci) {
    int s, m;
    scale_min_k4(b + 4, j, &s, &m);
    both_halves(ci, h2f(rd16(b)) * (float)s, h2f(rd16(b + 2)) * (float)m);
    const uint8_t *qh = b + 16, *qs = b + 48 + (j >> 1) * 32;
    const int sh = 4 * (j & 1);
    for (int l = 0; l < 32; l++) ci->q[l] = (int8_t)(((qs[l] >> sh) & 15) | (((qh[l] >> j) & 1) << 4));
}

/* IQ4_XS, 136 bytes: d, u16 scales_h, scales_l[4], qs[128]; sub-block j's scale is
 * (nibble j%2 of scales_l[j/2] | bits 2j.. of scales_h << 4) - 32, its values IQ4_NL's table indexed
 * by qs[16j..16j+15] (low nibbles, then high nibbles). */
HC_INLINE void dec_iq4_xs(const uint8_t *b, int j, chunk_ints *ci) {
    const int lo = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 15, hi = (rd16(b + 2) >> (2 * j)) & 3;
    both_halves(ci, h2f(rd16(b)) * (float)((lo | (hi << 4)) - 32), 0.0f);
    const uint8_t *qs = b + 8 + 16 * j;
    for (int l = 0; l < 16; l++) {
        ci->q[l] = IQ4_KVALUES[qs[l] & 15];
        ci->q[l + 16] = IQ4_KVALUES[qs[l] >> 4];
    }
}

/* The 32 weights of chunk c of a row, as fp32, exactly as ggml dequantizes them. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
HC_INLINE void load32_simd(const int wt, const uint8_t *row, int64_t c, vf *w);
#endif
HC_INLINE void load32(const int wt, const uint8_t *row, int64_t c, vf *w) {
    switch (wt) {
    case WT_F32:
        for (int v = 0; v < NV; v++) w[v] = vloadu((const float *)row + c * 32 + v * VL);
        break;
    case WT_F16:
        for (int v = 0; v < NV; v++) w[v] = vload_f16((const uint16_t *)row + c * 32 + v * VL);
        break;
    case WT_BF16:
        for (int v = 0; v < NV; v++) w[v] = vload_bf16((const uint16_t *)row + c * 32 + v * VL);
        break;
    case WT_Q8_0: load_q8_0(row + c * 34, w); break;
    case WT_Q4_0: load_q4_0(row + c * 18, w); break;
    case WT_Q5_0: load_q5_0(row + c * 22, w); break;
    case WT_Q6_K: load_q6_k(row + (c >> 3) * 210, (int)(c & 7), w); break;
    default: {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        load32_simd(wt, row, c, w); /* the SIMD unpack below (qchunk): the same values */
        break;
#endif
        chunk_ints ci;
        const int j = (int)(c & 7);
        switch (wt) {
        case WT_Q4_1: dec_q4_1(row + c * 20, &ci); break;
        case WT_Q5_1: dec_q5_1(row + c * 24, &ci); break;
        case WT_IQ4_NL: dec_iq4_nl(row + c * 18, &ci); break;
        case WT_Q2_K: dec_q2_k(row + (c >> 3) * 84, j, &ci); break;
        case WT_Q3_K: dec_q3_k(row + (c >> 3) * 110, j, &ci); break;
        case WT_Q4_K: dec_q4_k(row + (c >> 3) * 144, j, &ci); break;
        case WT_Q5_K: dec_q5_k(row + (c >> 3) * 176, j, &ci); break;
        default: dec_iq4_xs(row + (c >> 3) * 136, j, &ci); break;
        }
        const int mode = (wt == WT_Q4_1 || wt == WT_Q5_1)   ? AFF_ADD
                         : (wt == WT_Q2_K || wt == WT_Q4_K || wt == WT_Q5_K) ? AFF_SUB
                                                                             : AFF_MUL;
        emit_chunk(&ci, mode, w);
    }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Dot products of one weight row with NT token vectors (NT <= NTMAX, a constant after inlining).
 * The accumulator layout is the same for every NT, so a token's result does not depend on which
 * other tokens share the pass. pf, if not NULL, is the next row to read: its lines are prefetched
 * while this row streams.
 * ---------------------------------------------------------------------------------------------- */
HC_INLINE void dot_row(const int wt, const int NT, const uint8_t *row, const float *const *xs, int64_t D,
                       float *res, const uint8_t *pf) {
    vf acc[NTMAX][NACC];
    for (int t = 0; t < NT; t++)
        for (int a = 0; a < NACC; a++) acc[t][a] = vzero();
    const int64_t nchunk = D / 32;
    int64_t c = 0, pfo = 0;
    for (; c + UNR <= nchunk; c += UNR) {
        for (int u = 0; u < UNR; u++) {
            vf w[NV];
            load32(wt, row, c + u, w);
            for (int t = 0; t < NT; t++)
                for (int v = 0; v < NV; v++)
                    acc[t][ACC_OF(u, v)] = vfma(w[v], vloadu(xs[t] + (c + u) * 32 + v * VL), acc[t][ACC_OF(u, v)]);
        }
        if (pf) {
            const int64_t end = chunk_off(wt, c + UNR);
            for (; pfo < end; pfo += 64) vprefetch(pf + pfo);
        }
    }
    for (; c < nchunk; c++) {
        vf w[NV];
        load32(wt, row, c, w);
        for (int t = 0; t < NT; t++)
            for (int v = 0; v < NV; v++) acc[t][ACC_OF(0, v)] = vfma(w[v], vloadu(xs[t] + c * 32 + v * VL), acc[t][ACC_OF(0, v)]);
    }
    for (int t = 0; t < NT; t++) {
        float r = vhsum(vsum_acc(acc[t]));
        for (int64_t j = nchunk * 32; j < D; j++) r = fmaf(wscalar(wt, row, j), xs[t][j], r);
        res[t] = r;
    }
}

/* Vector v of chunk c of a float row, as fp32 (load32's float cases, one vector at a time). */
HC_INLINE vf load_vec(const int wt, const uint8_t *row, int64_t c, int v) {
    if (wt == WT_F32) return vloadu((const float *)row + c * 32 + v * VL);
    if (wt == WT_F16) return vload_f16((const uint16_t *)row + c * 32 + v * VL);
    if (wt == WT_Q8_0 || wt == WT_Q4_0 || wt == WT_Q5_0) { /* a block is one chunk: load32's values (w = d * q);
                                                            * the vectors not asked for are dead code */
        vf w[NV];
        load32(wt, row, c, w);
        return w[v];
    }
    return vload_bf16((const uint16_t *)row + c * 32 + v * VL);
}

#if defined(__GNUC__) && (defined(__AVX2__) || defined(__AVX512F__))
/* Keeps a vector in a register: without it GCC folds the x loads into every fma as memory operands,
 * 16 loads per 12 fma instead of 7, and the tile becomes load-bound. */
#define REG_BARRIER(v) __asm__("" : "+v"(v))
#else
#define REG_BARRIER(v) (void)0
#endif
#define TILE_R 4                  /* rows of a batch GEMV tile */
#define TILE_T (VL == 16 ? 4 : 3) /* tokens of a tile: TILE_R * TILE_T accumulators + TILE_T x vectors */
#ifndef TILE_BLOCK
#define TILE_BLOCK 16 /* chunks (of 32 columns) per column block: 16 is 3-5% over 8 with 12-token tiles */
#endif
#ifndef TILE_TOKENS
/* Tokens whose accumulators a tile keeps over the whole row: their x blocks stay in L1 (48 read them
 * from L2: 33-38 against 46-55 Gfma/s, F16 5632 x 2048, T=40-80, 2 threads). */
#define TILE_TOKENS 12
#endif

/* One parity of a tile's dot products over chunks [0, nc) of its column block: acc[r][t][par] +=
 * w_r . x_t over the vectors v of each chunk with v % NACC == par (ACC_OF's assignment). A dot's two
 * accumulators never meet before the reduction, so taking them in two passes keeps dot_row's fma
 * chains (same vectors, same order) while each pass holds one accumulator per (row, token) in
 * registers: a 4 x 3 tile, 7 loads per 12 fma where two-accumulator tiles of 2 x 3 needed 16. */
HC_INLINE void tile_pass(const int wt, const int NT, const uint8_t *const *ws, const float *const *xs, int64_t nc,
                         int par, vf (*acc)[TILE_T][NACC], const uint8_t *const *pf, int64_t pbase, int *ipq,
                         int npq, int pstep) {
    vf a[TILE_R][TILE_T];
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < NT; t++) a[r][t] = acc[r][t][par];
    int ip = *ipq;
    for (int64_t c = 0; c < nc; c++) {
        for (int j = 0; j < pstep && ip < npq; j++, ip++) /* line ip / TILE_R of row ip % TILE_R: spread out */
            if (pf[ip % TILE_R]) vprefetch_l2(pf[ip % TILE_R] + pbase + (int64_t)(ip / TILE_R) * 64);
        for (int v = par; v < NV; v += NACC) {
            vf xv[TILE_T];
            for (int t = 0; t < NT; t++) xv[t] = vloadu(xs[t] + c * 32 + v * VL);
            for (int t = 0; t < NT; t++) REG_BARRIER(xv[t]);
            for (int r = 0; r < TILE_R; r++) {
                vf w = load_vec(wt, ws[r], c, v);
                REG_BARRIER(w); /* float32 rows: one load, not a memory operand in each of NT fma */
                for (int t = 0; t < NT; t++) a[r][t] = vfma(w, xv[t], a[r][t]);
            }
        }
    }
    *ipq = ip;
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < NT; t++) acc[r][t][par] = a[r][t];
}

/* A row's result from its accumulators, as dot_row ends: the fixed reduction, then the columns past
 * the last whole chunk. */
HC_INLINE float tile_finish(const int wt, const vf *acc, const uint8_t *row, const float *x, int64_t D) {
    float q = vhsum(vsum_acc(acc));
    for (int64_t j = D / 32 * 32; j < D; j++) q = fmaf(wscalar(wt, row, j), x[j], q);
    return q;
}

/* out[t, rows_i[r]] = W[row r] . x_t for the first nr <= TILE_R of TILE_R float rows (a short tile repeats
 * its last row) and every token: the rows' columns in blocks, each block against every token in tiles of
 * TILE_T, so the blocks of x and of the rows are read from L1. Each (row, token) has dot_row's bits.
 * (Converting a half-precision block to fp32 once for all token groups measured slower than converting in
 * the tile: 24.6 against 34.7 Gfma/s, T=8, one core.) */
HC_INLINE void dot_rows_tokens(const int wt, const int nr, const uint8_t *const *rows, const int64_t *rows_i,
                               const float *X, int64_t T, int64_t D, float *out, int64_t F,
                               const uint8_t *const *pf) {
    const int64_t nchunk = D / 32, esz = wt == WT_F32 ? 4 : 2;
    for (int64_t s0 = 0; s0 < T; s0 += TILE_TOKENS) {
        const int64_t ns = T - s0 < TILE_TOKENS ? T - s0 : TILE_TOKENS;
        const int ngroup = (int)((ns + TILE_T - 1) / TILE_T);
        int64_t start[(TILE_TOKENS + TILE_T - 1) / TILE_T + 1]; /* groups of as equal sizes as can be */
        for (int g = 0; g <= ngroup; g++) start[g] = s0 + (int64_t)g * ns / ngroup;
        vf acc[(TILE_TOKENS + TILE_T - 1) / TILE_T][TILE_R][TILE_T][NACC];
        for (int g = 0; g < ngroup; g++)
            for (int r = 0; r < TILE_R; r++)
                for (int t = 0; t < TILE_T; t++)
                    for (int a = 0; a < NACC; a++) acc[g][r][t][a] = vzero();
        for (int64_t c0 = 0; c0 < nchunk; c0 += TILE_BLOCK) {
            const int64_t nc = nchunk - c0 < TILE_BLOCK ? nchunk - c0 : TILE_BLOCK;
            const uint8_t *ws[TILE_R];
            for (int r = 0; r < TILE_R; r++) ws[r] = rows[r] + c0 * 32 * esz;
            /* the next tile's block is prefetched while this one computes, a line per chunk step (the tile
             * alone kept only 19-30 GB/s in flight at T = 2-8 against 56 at T = 1, F16, 2 threads) */
            static const uint8_t *const no_pf[TILE_R] = {NULL, NULL, NULL, NULL};
            const int npq = pf && s0 == 0 ? (int)(TILE_R * ((nc * 32 * esz + 63) / 64)) : 0; /* lines to fetch */
            const int steps = (int)(ngroup * NACC * nc), pstep = (npq + steps - 1) / steps; /* lines a chunk step */
            const uint8_t *const *pfr = pf ? pf : no_pf;
            const int64_t pbase = c0 * 32 * esz;
            int ipq = 0;
            for (int g = 0; g < ngroup; g++) {
                const int nt = (int)(start[g + 1] - start[g]);
                const float *xs[TILE_T];
                for (int j = 0; j < nt; j++) xs[j] = X + (start[g] + j) * D + c0 * 32;
                for (int par = 0; par < NACC; par++) switch (nt) { /* constant counts: registers */
                    case 1: tile_pass(wt, 1, ws, xs, nc, par, acc[g], pfr, pbase, &ipq, npq, pstep); break;
                    case 2: tile_pass(wt, 2, ws, xs, nc, par, acc[g], pfr, pbase, &ipq, npq, pstep); break;
#if TILE_T > 3
                    case 3: tile_pass(wt, 3, ws, xs, nc, par, acc[g], pfr, pbase, &ipq, npq, pstep); break;
#endif
                    default: tile_pass(wt, TILE_T, ws, xs, nc, par, acc[g], pfr, pbase, &ipq, npq, pstep); break;
                    }
            }
        }
        for (int g = 0; g < ngroup; g++)
            for (int64_t t = start[g]; t < start[g + 1]; t++)
                for (int r = 0; r < nr; r++)
                    out[t * F + rows_i[r]] = tile_finish(wt, acc[g][r][t - start[g]], rows[r], X + t * D, D);
    }
}

/* Dot products of NR rows with one token vector: the same per-row arithmetic as dot_row (so the
 * grouping of rows, which depends on the thread partition, never changes a result); the rows
 * stream side by side, which keeps more cache misses in flight than one row at a time. */
HC_INLINE void dot_rows1(const int wt, const int NR, const uint8_t *const *rows, const float *x, int64_t D,
                         float *res, const uint8_t *const *pf, int pf_l2) {
    vf acc[4][NACC];
    for (int r = 0; r < NR; r++)
        for (int a = 0; a < NACC; a++) acc[r][a] = vzero();
    const int64_t nchunk = D / 32;
    int64_t c = 0, pfo = 0;
    for (; c + UNR <= nchunk; c += UNR) {
        for (int u = 0; u < UNR; u++) {
            vf xv[NV];
            for (int v = 0; v < NV; v++) xv[v] = vloadu(x + (c + u) * 32 + v * VL);
            for (int r = 0; r < NR; r++) {
                vf w[NV];
                load32(wt, rows[r], c + u, w);
                for (int v = 0; v < NV; v++) acc[r][ACC_OF(u, v)] = vfma(w[v], xv[v], acc[r][ACC_OF(u, v)]);
            }
        }
        prefetch_rows(pf, 4, &pfo, chunk_off(wt, c + UNR), pf_l2);
    }
    for (; c < nchunk; c++) {
        vf xv[NV];
        for (int v = 0; v < NV; v++) xv[v] = vloadu(x + c * 32 + v * VL);
        for (int r = 0; r < NR; r++) {
            vf w[NV];
            load32(wt, rows[r], c, w);
            for (int v = 0; v < NV; v++) acc[r][ACC_OF(0, v)] = vfma(w[v], xv[v], acc[r][ACC_OF(0, v)]);
        }
    }
    for (int r = 0; r < NR; r++) {
        float q = vhsum(vsum_acc(acc[r]));
        for (int64_t j = nchunk * 32; j < D; j++) q = fmaf(wscalar(wt, rows[r], j), x[j], q);
        res[r] = q;
    }
}

typedef struct {
    const uint8_t *W;  /* weight bytes, row i at W + i * stride */
    int64_t stride;    /* bytes between rows */
    int64_t F, D, T;   /* rows, columns, tokens */
    const float *x;    /* gather: [T, D]; axpy: coefficients a [T, F] */
    const uint8_t *mask; /* [T, F] bytes (0 / nonzero) or NULL */
    float *out;        /* gather: [T, F]; axpy: [T, D] */
    const int32_t *idx; /* rows to visit, ascending (NULL: every row) */
    const float *coef; /* axpy, T == 1: a[idx[k]] */
    int64_t n;         /* number of rows to visit */
    const struct hc_xq_s *xq; /* block weights: the tokens' quantized activations [T] (gather only) */
} hc_args;

/* Position p of the index list, or -1: positions past k1 continue at kn (the start of the next
 * work item this thread has claimed, or -1), so prefetching runs on across item boundaries. */
HC_INLINE int64_t next_pos(int64_t p, int64_t k1, int64_t kn, int64_t n) {
    if (p < k1) return p;
    if (kn < 0) return -1;
    p = kn + (p - k1);
    return p < n ? p : -1;
}

/* ------------------------------------------------------------------------------------------------
 * Integer dot products for block weights (what keeps a quantized GEMV memory-bound, as in ggml):
 * each token's activations are quantized once per call to int8 in chunks of 32 (scale amax / 127,
 * round to nearest even), and a row's dot product is a sum over chunks of
 *     dx * (s_h * sum_{i in half h} q_w[i] q_x[i])  -/+  m_h * dx * sum_{i in half h} q_x[i]
 * with the integer sums exact. The result differs from the float path by the activations' rounding
 * (at most sum |w| * dx / 2 per chunk); the arithmetic of a row is fixed, so results are still the
 * same for any thread count and for a token alone or in a batch.
 * ---------------------------------------------------------------------------------------------- */
HC_INLINE int wt_is_block(const int wt) { return wt >= WT_Q8_0; }
/* Bytes of a 256-value super-block, or 0 for the types with 32-value blocks. */
HC_INLINE int64_t k_block_bytes(const int wt) {
    switch (wt) {
    case WT_Q2_K: return 84;
    case WT_Q3_K: return 110;
    case WT_Q4_K: return 144;
    case WT_Q5_K: return 176;
    case WT_Q6_K: return 210;
    case WT_IQ4_XS: return 136;
    default: return 0;
    }
}

/* One token's activations, quantized: q [D], d [D/32] (chunk scales), hs [D/16] and hc [D/32] (d
 * times the sum of q over each half of 16 and over the chunk: the min terms), ls [D/32 * 8] (sums of
 * q over each group of 4 values: the offset terms of the SIMD path). */
typedef struct hc_xq_s {
    const int8_t *q;
    const float *d, *hs, *hc;
    const int32_t *ls, *qsum, *qhs; /* qsum [D/32], qhs [D/16]: the sums of q over each chunk, each half */
} hc_xq;

typedef struct { /* T tokens' quantized activations in one allocation */
    void *mem;
    hc_xq *tok;
} hc_xq_set;

static void xq_free(hc_xq_set *s) {
    free(s->mem);
    s->mem = NULL;
    s->tok = NULL;
}

/* Chunk xc (32 floats) -> qc (int8) and its 8 sums of 4 (ls); returns amax and sets *nan. The scalar
 * definition: every other path must give these bits. */
static float xq_chunk_scalar(const float *xc, int8_t *qc, int32_t *ls, int *nan) {
    float amax = 0.0f;
    *nan = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xc[i])), *nan |= xc[i] != xc[i];
    const float id = amax > 0.0f && !*nan ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) qc[i] = (int8_t)lrintf(xc[i] * id); /* |q| <= 127 */
    for (int g = 0; g < 8; g++) ls[g] = qc[4 * g] + qc[4 * g + 1] + qc[4 * g + 2] + qc[4 * g + 3];
    return amax;
}

#if defined(__AVX2__)
/* xq_chunk_scalar for a chunk of finite values, 16x faster: the quantizer runs on every call of every
 * block-weight kernel (the scalar one took ~17 us for D = 2048, libm's fmaxf and lrintf per value).
 * max is exact in any order; x * id is the same single rounding; cvtps2dq rounds to nearest even as
 * lrintf does in the default mode; the sums are exact integers. Chunks with a NaN, an inf, or an amax
 * so small that 127 / amax overflows go the scalar way (their edge cases stay in one place). */
HC_INLINE float xq_chunk_avx2(const float *xc, int8_t *qc, int32_t *ls, int *nan) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    int unord = 0;
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(xc + 8 * k);
        unord |= _mm256_movemask_ps(_mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float ids = amax > 0.0f ? 127.0f / amax : 0.0f;
    if (unord || !(amax <= 3.4028235e38f) || !(ids <= 3.4028235e38f)) return xq_chunk_scalar(xc, qc, ls, nan);
    *nan = 0;
    const __m256 id = _mm256_set1_ps(ids);
    __m256i q[4];
    for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the per-lane packs / hadds */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)qc, _mm256_permutevar8x32_epi32(b, order));
    const __m256i g = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)ls, _mm256_permutevar8x32_epi32(g, order));
    return amax;
}
#define XQ_CHUNK xq_chunk_avx2
#else
#define XQ_CHUNK xq_chunk_scalar
#endif

/* Quantize T rows of D floats (D a multiple of 32). Returns 0, or -1 if memory ran out. */
static int xq_make(const float *x, int64_t T, int64_t D, hc_xq_set *s) {
    const int64_t nc = D / 32;
    const size_t per = (size_t)D + sizeof(float) * (size_t)(4 * nc) + sizeof(int32_t) * (size_t)(11 * nc);
    s->mem = malloc(sizeof(hc_xq) * (size_t)T + per * (size_t)T + 64);
    if (!s->mem) return -1;
    s->tok = (hc_xq *)s->mem;
    uint8_t *p = (uint8_t *)(s->tok + T);
    for (int64_t t = 0; t < T; t++) {
        float *d = (float *)p, *hs = d + nc, *hc = hs + 2 * nc;
        int32_t *ls = (int32_t *)(hc + nc), *qsum = ls + 8 * nc, *qhs = qsum + nc;
        int8_t *q = (int8_t *)(qhs + 2 * nc);
        p = (uint8_t *)(q + D);
        const float *xt = x + t * D;
        for (int64_t c = 0; c < nc; c++) {
            int nan;
            const float amax = XQ_CHUNK(xt + 32 * c, q + 32 * c, ls + 8 * c, &nan);
            /* a NaN activation makes its chunk's scale NaN, so it reaches the output as in the float path */
            const float dc = nan ? NAN : amax / 127.0f;
            const int32_t *lc = ls + 8 * c;
            const int32_t h0 = lc[0] + lc[1] + lc[2] + lc[3], h1 = lc[4] + lc[5] + lc[6] + lc[7];
            d[c] = dc;
            hs[2 * c] = dc * (float)h0;
            hs[2 * c + 1] = dc * (float)h1;
            hc[c] = dc * (float)(h0 + h1);
            qsum[c] = h0 + h1;
            qhs[2 * c] = h0, qhs[2 * c + 1] = h1;
        }
        const hc_xq one = {q, d, hs, hc, ls, qsum, qhs};
        s->tok[t] = one;
    }
    return 0;
}

/* How a type's chunk values relate to the integers a decoder gives: value = s_h * (u - QOFF) with
 * u >= 0 (QOFF a power of two: 2^QOFF_SHIFT, or 0), minus m_h (SUB) or plus m_h (ADD) where the type
 * has a min; the signed types' decoders give the values' integers themselves. */
HC_INLINE int q_signed(const int wt) { return wt == WT_Q8_0 || wt == WT_IQ4_NL || wt == WT_IQ4_XS; }
HC_INLINE int q_off_shift(const int wt) { /* -1: no offset */
    switch (wt) {
    case WT_Q4_0: return 3;
    case WT_Q5_0: return 4;
    case WT_Q6_K: return 5;
    case WT_Q3_K: return 2;
    default: return -1;
    }
}
HC_INLINE int q_mode(const int wt) {
    return (wt == WT_Q4_1 || wt == WT_Q5_1) ? AFF_ADD : (wt == WT_Q2_K || wt == WT_Q4_K || wt == WT_Q5_K) ? AFF_SUB : AFF_MUL;
}
HC_INLINE int q_half_scales(const int wt) { return wt == WT_Q2_K || wt == WT_Q3_K || wt == WT_Q6_K; }

/* The remaining chunk_ints decoders (signed values), for the portable integer path. */
HC_INLINE void dec_q8_0(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), 0.0f);
    memcpy(ci->q, b + 2, 32);
}
HC_INLINE void dec_q4_0(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), 0.0f);
    for (int l = 0; l < 16; l++) {
        ci->q[l] = (int8_t)((b[2 + l] & 15) - 8);
        ci->q[l + 16] = (int8_t)((b[2 + l] >> 4) - 8);
    }
}
HC_INLINE void dec_q5_0(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, h2f(rd16(b)), 0.0f);
    const uint32_t qh = rd32(b + 2);
    for (int l = 0; l < 16; l++) {
        ci->q[l] = (int8_t)(((b[6 + l] & 15) | (((qh >> l) & 1) << 4)) - 16);
        ci->q[l + 16] = (int8_t)(((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
    }
}
HC_INLINE void dec_q6_k(const uint8_t *b, int j, chunk_ints *ci) {
    const int h = j >> 2, qq = j & 3;
    const uint8_t *ql = b + h * 64 + (qq & 1) * 32, *qh = b + 128 + h * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
    const float d = h2f(rd16(b + 208));
    ci->s[0] = d * (float)sc[0], ci->s[1] = d * (float)sc[1];
    ci->m[0] = ci->m[1] = 0.0f;
    for (int l = 0; l < 32; l++) {
        const int lo = (qq >= 2) ? (ql[l] >> 4) : (ql[l] & 15);
        ci->q[l] = (int8_t)((lo | (((qh[l] >> (2 * qq)) & 3) << 4)) - 32);
    }
}

/* Chunk c of a row as signed integers with the scale and min of each half. */
HC_INLINE void chunk_decode(const int wt, const uint8_t *row, int64_t c, chunk_ints *ci) {
    const int j = (int)(c & 7);
    switch (wt) {
    case WT_Q8_0: dec_q8_0(row + c * 34, ci); break;
    case WT_Q4_0: dec_q4_0(row + c * 18, ci); break;
    case WT_Q5_0: dec_q5_0(row + c * 22, ci); break;
    case WT_Q4_1: dec_q4_1(row + c * 20, ci); break;
    case WT_Q5_1: dec_q5_1(row + c * 24, ci); break;
    case WT_IQ4_NL: dec_iq4_nl(row + c * 18, ci); break;
    case WT_Q2_K: dec_q2_k(row + (c >> 3) * 84, j, ci); break;
    case WT_Q3_K: dec_q3_k(row + (c >> 3) * 110, j, ci); break;
    case WT_Q4_K: dec_q4_k(row + (c >> 3) * 144, j, ci); break;
    case WT_Q5_K: dec_q5_k(row + (c >> 3) * 176, j, ci); break;
    case WT_Q6_K: dec_q6_k(row + (c >> 3) * 210, j, ci); break;
    default: dec_iq4_xs(row + (c >> 3) * 136, j, ci); break;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HC_QSIMD 1
#define QNT 8 /* tokens sharing one pass over a row */
HC_INLINE __m256i ld256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* acc + the sums of 4 products u * s (u unsigned, s signed bytes) in each 32-bit lane. With VNNI one
 * instruction (dpbusd); without, maddubs + madd + add. Every caller's products pair up to at most
 * 2 * 128 * 127 in maddubs' 16-bit lanes, which never saturate, so both give the same exact sums and
 * the kernels the same bits on every machine. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HC_VNNI 1
HC_INLINE __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define HC_VNNI 1
HC_INLINE __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define HC_VNNI 0
HC_INLINE __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
HC_INLINE __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
/* 16 bytes -> 32 nibbles: the low nibbles (values 0..15), then the high ones (16..31). */
HC_INLINE __m256i nib16(const uint8_t *p) { /* one broadcast load, a shift of the upper lane, one mask */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}
/* Byte i = 0x10 where bit i of x is set, else 0 (the fifth bit of Q5_0 / Q5_1 values). */
HC_INLINE __m256i bit4_of_32(uint32_t x) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0x0000000000000000LL));
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
}
/* Byte l = v where bit j of p[l] is set, else 0. */
HC_INLINE __m256i bit_j(const uint8_t *p, int j, char v) {
    const __m256i b = _mm256_set1_epi8((char)(1 << j));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(ld256(p), b), b), _mm256_set1_epi8(v));
}
HC_INLINE __m256i iq4_lookup(__m256i nib) {
    const __m128i t = _mm_loadu_si128((const __m128i *)IQ4_KVALUES);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nib);
}

/* qchunk for the types with 256-value super-blocks: chunk j (0..7) of super-block b. Callers that unroll
 * a super-block's 8 chunks make j a constant, and every shift and byte offset below with it. */
HC_INLINE __m256i qchunk_k(const int wt, const uint8_t *b, const int j, float *s, float *m) {
    m[0] = m[1] = 0.0f;
    switch (wt) {
    case WT_Q2_K: {
        const float d = h2f(rd16(b + 80)), dmin = h2f(rd16(b + 82));
        /* both scale bytes in one load: byte loads kept as bytes were spilled by GCC and read back
         * wider, a failed store-to-load forward per byte (a third of the Q2_K gather's time) */
        const uint32_t sc = rd16(b + 2 * j);
        s[0] = d * (float)(sc & 15), m[0] = dmin * (float)((sc >> 4) & 15);
        s[1] = d * (float)((sc >> 8) & 15), m[1] = dmin * (float)(sc >> 12);
        return _mm256_and_si256(srl16(ld256(b + 16 + (j >> 2) * 32), 2 * (j & 3)), _mm256_set1_epi8(3));
    }
    case WT_Q3_K: {
        const uint8_t *sc = b + 96;
        const float d = h2f(rd16(b + 108));
        for (int k = 0; k < 2; k++) {
            const int i = 2 * j + k;
            const int lo = (sc[i & 7] >> (4 * (i >> 3))) & 15, hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
            s[k] = d * (float)((lo | (hi << 4)) - 32);
        }
        const __m256i ql = _mm256_and_si256(srl16(ld256(b + 32 + (j >> 2) * 32), 2 * (j & 3)), _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, bit_j(b, j, 4)); /* u = q + 4 */
    }
    case WT_Q4_K: {
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        s[0] = s[1] = h2f(rd16(b)) * (float)sc;
        m[0] = m[1] = h2f(rd16(b + 2)) * (float)mn;
        return _mm256_and_si256(srl16(ld256(b + 16 + (j >> 1) * 32), 4 * (j & 1)), _mm256_set1_epi8(15));
    }
    case WT_Q5_K: {
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        s[0] = s[1] = h2f(rd16(b)) * (float)sc;
        m[0] = m[1] = h2f(rd16(b + 2)) * (float)mn;
        const __m256i lo = _mm256_and_si256(srl16(ld256(b + 48 + (j >> 1) * 32), 4 * (j & 1)), _mm256_set1_epi8(15));
        return _mm256_or_si256(lo, bit_j(b + 16, j, 0x10));
    }
    case WT_Q6_K: {
        const int h = j >> 2, qq = j & 3;
        const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
        const float d = h2f(rd16(b + 208));
        s[0] = d * (float)sc[0], s[1] = d * (float)sc[1];
        const __m256i lo = _mm256_and_si256(srl16(ld256(b + h * 64 + (qq & 1) * 32), 4 * (qq >> 1)), _mm256_set1_epi8(15));
        const __m256i hb = _mm256_and_si256(srl16(ld256(b + 128 + h * 32), 2 * qq), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)); /* u = q + 32 */
    }
    default: { /* IQ4_XS */
        const int lo = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 15, hi = (rd16(b + 2) >> (2 * j)) & 3;
        s[0] = s[1] = h2f(rd16(b)) * (float)((lo | (hi << 4)) - 32);
        return iq4_lookup(nib16(b + 8 + 16 * j));
    }
    }
}

/* Chunk c of a row as 32 bytes (unsigned u, or the signed values for q_signed types) plus the
 * scale and min of each half (see q_off_shift / q_mode). */
HC_INLINE __m256i qchunk(const int wt, const uint8_t *row, int64_t c, float *s, float *m) {
    m[0] = m[1] = 0.0f;
    switch (wt) {
    case WT_Q8_0: {
        const uint8_t *b = row + c * 34;
        s[0] = s[1] = h2f(rd16(b));
        return ld256(b + 2);
    }
    case WT_Q4_0: {
        const uint8_t *b = row + c * 18;
        s[0] = s[1] = h2f(rd16(b));
        return nib16(b + 2);
    }
    case WT_Q4_1: {
        const uint8_t *b = row + c * 20;
        s[0] = s[1] = h2f(rd16(b));
        m[0] = m[1] = h2f(rd16(b + 2));
        return nib16(b + 4);
    }
    case WT_Q5_0: {
        const uint8_t *b = row + c * 22;
        s[0] = s[1] = h2f(rd16(b));
        return _mm256_or_si256(nib16(b + 6), bit4_of_32(rd32(b + 2)));
    }
    case WT_Q5_1: {
        const uint8_t *b = row + c * 24;
        s[0] = s[1] = h2f(rd16(b));
        m[0] = m[1] = h2f(rd16(b + 2));
        return _mm256_or_si256(nib16(b + 8), bit4_of_32(rd32(b + 4)));
    }
    case WT_IQ4_NL: {
        const uint8_t *b = row + c * 18;
        s[0] = s[1] = h2f(rd16(b));
        return iq4_lookup(nib16(b + 2));
    }
    default: return qchunk_k(wt, row + (c >> 3) * k_block_bytes(wt), (int)(c & 7), s, m);
    }
}

/* A Q3_K / Q4_K / Q5_K / Q6_K super-block's scales as floats, decoded once for its 8 chunks (qchunk decodes
 * a chunk's own, one byte at a time, for every chunk). Each value is qchunk's: d * (float)sc (and dmin *
 * (float)mn), one rounding, so the kernels keep their bits. Q3_K, Q6_K: sv[16], one a half of 16 values;
 * Q4_K / Q5_K: sv[8], mv[8], one a chunk. The byte shuffles are ggml's (kmask). */
HC_INLINE void k_scales(const int wt, const uint8_t *b, float *sv, float *mv) {
    uint32_t a[4];
    if (wt == WT_Q6_K) {
        const __m256 d = _mm256_set1_ps(h2f(rd16(b + 208)));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        _mm256_storeu_ps(sv, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(sv + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    } else if (wt == WT_Q3_K) {
        memcpy(a, b + 96, 12);
        const uint32_t t = a[2];
        a[2] = ((a[0] >> 4) & 0x0f0f0f0f) | (((t >> 4) & 0x03030303) << 4);
        a[3] = ((a[1] >> 4) & 0x0f0f0f0f) | (((t >> 6) & 0x03030303) << 4);
        a[0] = (a[0] & 0x0f0f0f0f) | ((t & 0x03030303) << 4);
        a[1] = (a[1] & 0x0f0f0f0f) | (((t >> 2) & 0x03030303) << 4);
        const __m256 d = _mm256_set1_ps(h2f(rd16(b + 108)));
        const __m128i v = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)a), _mm_set1_epi8(32));
        _mm256_storeu_ps(sv, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
        _mm256_storeu_ps(sv + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
    } else { /* Q4_K, Q5_K: get_scale_min_k4 for all 8 at once */
        memcpy(a, b + 4, 12);
        a[3] = ((a[2] >> 4) & 0x0f0f0f0f) | (((a[1] >> 6) & 0x03030303) << 4);
        const uint32_t lo = a[1] & 0x3f3f3f3f;
        a[1] = (a[2] & 0x0f0f0f0f) | (((a[0] >> 6) & 0x03030303) << 4);
        a[2] = lo;
        a[0] &= 0x3f3f3f3f;
        /* bytes 0-3, 8-11 ... : a[0], a[1] are the scales, a[2], a[3] the mins */
        const __m128i v = _mm_loadu_si128((const __m128i *)a);
        _mm256_storeu_ps(sv, _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
        _mm256_storeu_ps(mv, _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b + 2))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
    }
}

/* Chunk j's values of a Q3_K / Q4_K / Q5_K / Q6_K super-block, as qchunk_k returns them (without the scales). */
HC_INLINE __m256i k_bits(const int wt, const uint8_t *b, const int j) {
    if (wt == WT_Q3_K) {
        const __m256i ql = _mm256_and_si256(srl16(ld256(b + 32 + (j >> 2) * 32), 2 * (j & 3)), _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, bit_j(b, j, 4));
    }
    if (wt == WT_Q4_K) return _mm256_and_si256(srl16(ld256(b + 16 + (j >> 1) * 32), 4 * (j & 1)), _mm256_set1_epi8(15));
    if (wt == WT_Q6_K) {
        const int h = j >> 2, qq = j & 3;
        const __m256i lo = _mm256_and_si256(srl16(ld256(b + h * 64 + (qq & 1) * 32), 4 * (qq >> 1)), _mm256_set1_epi8(15));
        const __m256i hb = _mm256_and_si256(srl16(ld256(b + 128 + h * 32), 2 * qq), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)); /* u = q + 32 */
    }
    const __m256i lo = _mm256_and_si256(srl16(ld256(b + 48 + (j >> 1) * 32), 4 * (j & 1)), _mm256_set1_epi8(15));
    return _mm256_or_si256(lo, bit_j(b + 16, j, 0x10));
}

/* Chunk j's scale and min of each half (qchunk's s and m) from its super-block's k_scales. */
HC_INLINE void k_chunk_scales(const int wt, const float *sv, const float *mv, const int j, float *s, float *m) {
    if (q_half_scales(wt)) { /* Q3_K, Q6_K */
        s[0] = sv[2 * j], s[1] = sv[2 * j + 1];
        m[0] = m[1] = 0.0f;
    } else {
        s[0] = s[1] = sv[j];
        m[0] = m[1] = mv[j];
    }
}

/* acc (8 lanes) += the chunk's products with token x's chunk c; *macc += its min terms. */
HC_INLINE void qdot_chunk(const int wt, __m256i u, const float *s, const float *m, const hc_xq *x, int64_t c,
                          __m256 *acc, float *macc) {
    const __m256i xv = ld256((const uint8_t *)(x->q + 32 * c));
    __m256i p; /* lane g: values 4g..4g+3 */
    if (q_signed(wt)) p = dot4_acc(_mm256_setzero_si256(), _mm256_sign_epi8(u, u), _mm256_sign_epi8(xv, u));
    else p = dot4_acc(_mm256_setzero_si256(), u, xv);
    if (q_off_shift(wt) >= 0)
        p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(x->ls + 8 * c)), q_off_shift(wt)));
    const float dx = x->d[c];
    const __m256 sv = q_half_scales(wt) ? _mm256_set_m128(_mm_set1_ps(s[1] * dx), _mm_set1_ps(s[0] * dx))
                                        : _mm256_set1_ps(s[0] * dx);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, *acc);
    /* one dependent add per chunk on macc (a chain of two fmas would bound the loop's speed) */
    if (q_mode(wt) != AFF_MUL && q_half_scales(wt)) *macc += fmaf(m[1], x->hs[2 * c + 1], m[0] * x->hs[2 * c]);
    else if (q_mode(wt) != AFF_MUL) *macc = fmaf(m[0], x->hc[c], *macc);
}

/* load32 for the types without a float loader of their own (Q4_1, Q5_1, IQ4_NL, Q2_K..Q5_K, IQ4_XS):
 * the chunk's values unpacked by qchunk, then emit_chunk's arithmetic (s * q, then - m or + m, two
 * roundings). The scalar decoders wrote the values byte by byte and emit_chunk read them back as
 * vectors, a failed store-to-load forward per vector: the axpy of these types ran at ~0.6 GB/s. */
/* Vector v (of NV) of 32 signed bytes as floats. */
HC_INLINE vf vcvt_i8(__m256i q, int v) {
#if VL == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v == 0 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1)));
#else
    const __m128i half = v < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((v & 1) ? _mm_srli_si128(half, 8) : half));
#endif
}

/* A chunk's values q (as qchunk returns them) with the scale and min of each half, as floats. */
HC_INLINE void emit_q32(const int wt, __m256i q, const float *s, const float *m, vf *w) {
    if (q_off_shift(wt) >= 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)(1 << q_off_shift(wt))));
    const int mode = q_mode(wt);
    for (int v = 0; v < NV; v++) {
        const int h = (v * VL) / 16;
        vf x = vmul(vset1(s[h]), vcvt_i8(q, v));
        if (mode == AFF_SUB) x = vsub(x, vset1(m[h]));
        else if (mode == AFF_ADD) x = vadd(x, vset1(m[h]));
        w[v] = x;
    }
}

HC_INLINE void load32_simd(const int wt, const uint8_t *row, int64_t c, vf *w) {
    float s[2], m[2];
    const __m256i q = qchunk(wt, row, c, s, m);
    emit_q32(wt, q, s, m, w);
}

/* load32 of chunk j of a Q3_K / Q4_K / Q5_K / Q6_K super-block b from its k_scales: the same values. */
HC_INLINE void k_load32(const int wt, const uint8_t *b, const int j, const float *sv, const float *mv, vf *w) {
    float s[2], m[2];
    k_chunk_scales(wt, sv, mv, j, s, m);
    emit_q32(wt, k_bits(wt, b, j), s, m, w);
}

HC_INLINE float qdot_finish(const int wt, __m256 acc, float macc) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    const float r = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    return q_mode(wt) == AFF_SUB ? r - macc : q_mode(wt) == AFF_ADD ? r + macc : r;
}
#else
#define HC_QSIMD 0
#define QNT 4
#endif

#if HC_QSIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HC_ROWS_VNNI512 1 /* qdot_rows1 takes Q4_0, Q4_K and Q6_K rows to the 512-bit kernels below */
/* qdot_rows1 for Q4_0 rows on AVX512-VNNI machines: two chunks a step in 512-bit registers. Each chunk
 * gives the same 8 integer lane sums as qdot_chunk (lane g: the values of bytes 4g..4g+3 in nib16's order
 * times x's, minus 8 times their x sum, exact in int32), the same scale (float(d) * dx, one rounding) and
 * the same fma into the row's 8-lane accumulator, chunk after chunk, then qdot_finish: the same bits,
 * with about two thirds of the instructions (one dpbusd for maddubs, madd and the offset subtraction;
 * the nibble unpack and the conversion once for two chunks). The sparse FFN's gate and up rows are
 * compute-bound on this kernel at decode (measured 22 G weights/s a core, rows in L3). */
HC_INLINE void q4_0_rows1_vnni(const int NR, const uint8_t *const *rows, const hc_xq *x, int64_t D, float *res,
                               const uint8_t *const *pf, int pf_l2) {
    const int64_t nchunk = D / 32;
    const __m512i m15 = _mm512_set1_epi8(15), shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    int64_t c = 0, pfo = 0;
    for (; c + 2 <= nchunk; c += 2) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x->q + 32 * c));
        const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(),
                                             _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->ls + 8 * c)), 3));
        const __m256 dx0 = _mm256_set1_ps(x->d[c]), dx1 = _mm256_set1_ps(x->d[c + 1]);
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = rows[r] + c * 18;
            const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 2))),
                                                        _mm_loadu_si128((const __m128i *)(b + 20)), 1);
            /* 128-bit lanes: chunk c's bytes twice, then chunk c + 1's twice; the second copy of each
             * shifted by 4 gives the high nibbles (values 16..31), as nib16 does */
            const __m512i v = _mm512_shuffle_i64x2(_mm512_castsi256_si512(two), _mm512_castsi256_si512(two), 0x50);
            const __m512i u = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), m15);
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, u, xv));
            const __m256 s0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b))), dx0);
            const __m256 s1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b + 18))), dx1);
            acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(p), s0, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)), s1, acc[r]);
        }
        prefetch_rows(pf, 4, &pfo, chunk_off(WT_Q4_0, c + 2), pf_l2);
    }
    for (; c < nchunk; c++) /* an odd last chunk: qdot_chunk itself */
        for (int r = 0; r < NR; r++) {
            float s[2], m[2], macc = 0.0f;
            qdot_chunk(WT_Q4_0, qchunk(WT_Q4_0, rows[r], c, s, m), s, m, x, c, &acc[r], &macc);
        }
    for (int r = 0; r < NR; r++) res[r] = qdot_finish(WT_Q4_0, acc[r], 0.0f);
}

/* qdot_rows1 for Q4_K rows on AVX512-VNNI machines: a super-block's d, dmin and 8 scale/min pairs
 * decoded once a row (qchunk decodes them for every chunk), and the two chunks that share 32 bytes of
 * nibbles (low: chunk 2k, high: chunk 2k + 1) unpacked and multiplied in one 512-bit step. Each chunk
 * keeps qdot_chunk's integer lane sums, scale float(d) * sc * dx and min term fmaf(dmin * mn, hc, macc),
 * in chunk order: the same bits. */
HC_INLINE void q4_k_rows1_vnni(const int NR, const uint8_t *const *rows, const hc_xq *x, int64_t D, float *res,
                               const uint8_t *const *pf, int pf_l2) {
    const int64_t nsb = D / 256;
    const __m512i m15 = _mm512_set1_epi8(15), shifts = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[4];
    float macc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
    int64_t pfo = 0;
    for (int64_t sb = 0; sb < nsb; sb++) {
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = rows[r] + sb * 144;
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            for (int k = 0; k < 4; k++) {
                const int64_t c = sb * 8 + 2 * k;
                int sc0, mn0, sc1, mn1;
                scale_min_k4(b + 4, 2 * k, &sc0, &mn0);
                scale_min_k4(b + 4, 2 * k + 1, &sc1, &mn1);
                const __m256i q = ld256(b + 16 + k * 32);
                const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1);
                const __m512i u = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), m15);
                const __m512 p = _mm512_cvtepi32_ps(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512((const void *)(x->q + 32 * c))));
                const float s0 = d * (float)sc0, s1 = d * (float)sc1; /* qchunk's s */
                acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(p), _mm256_set1_ps(s0 * x->d[c]), acc[r]);
                macc[r] = fmaf(dmin * (float)mn0, x->hc[c], macc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)),
                                         _mm256_set1_ps(s1 * x->d[c + 1]), acc[r]);
                macc[r] = fmaf(dmin * (float)mn1, x->hc[c + 1], macc[r]);
            }
        }
        prefetch_rows(pf, 4, &pfo, (sb + 1) * 144, pf_l2);
    }
    for (int r = 0; r < NR; r++) res[r] = qdot_finish(WT_Q4_K, acc[r], macc[r]);
}

/* qdot_rows1 for Q6_K rows on AVX512-VNNI machines: chunks j and j + 2 of a half super-block share 32
 * bytes of low bits (low and high nibbles) and 32 of high bits (2-bit fields), so they are unpacked
 * and multiplied in one 512-bit step; the four chunks of a half are then added to the row's accumulator
 * in chunk order, each with qdot_chunk's lane sums (minus 32 times the x sums), half scales and fma:
 * the same bits. */
HC_INLINE void q6_k_rows1_vnni(const int NR, const uint8_t *const *rows, const hc_xq *x, int64_t D, float *res,
                               const uint8_t *const *pf, int pf_l2) {
    const int64_t nsb = D / 256;
    const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    int64_t pfo = 0;
    for (int64_t sb = 0; sb < nsb; sb++) {
        for (int h = 0; h < 2; h++) {
            const int64_t c0 = sb * 8 + h * 4; /* chunks c0 .. c0 + 3 */
            __m512i xv[2], off[2];
            for (int qq = 0; qq < 2; qq++) { /* x and offsets of chunks c0 + qq and c0 + qq + 2 */
                xv[qq] = _mm512_inserti64x4(_mm512_castsi256_si512(ld256((const uint8_t *)(x->q + 32 * (c0 + qq)))),
                                            ld256((const uint8_t *)(x->q + 32 * (c0 + qq + 2))), 1);
                const __m512i ls = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x->ls + 8 * (c0 + qq)))),
                    _mm256_loadu_si256((const __m256i *)(x->ls + 8 * (c0 + qq + 2))), 1);
                off[qq] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(ls, 5));
            }
            const float dx[4] = {x->d[c0], x->d[c0 + 1], x->d[c0 + 2], x->d[c0 + 3]};
            for (int r = 0; r < NR; r++) {
                const uint8_t *b = rows[r] + sb * 210;
                const float d = h2f(rd16(b + 208));
                const int8_t *sc = (const int8_t *)(b + 192) + h * 8;
                const __m256i qh = ld256(b + 128 + h * 32);
                const __m512i zh = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
                __m512 pf2[2];
                for (int qq = 0; qq < 2; qq++) {
                    const __m256i ql = ld256(b + h * 64 + qq * 32);
                    const __m512i lo = _mm512_and_si512(
                        _mm512_srlv_epi64(_mm512_inserti64x4(_mm512_castsi256_si512(ql), ql, 1), nib), m15);
                    const __m512i hshift = _mm512_setr_epi64(2 * qq, 2 * qq, 2 * qq, 2 * qq, 2 * qq + 4, 2 * qq + 4,
                                                             2 * qq + 4, 2 * qq + 4);
                    const __m512i hb = _mm512_and_si512(_mm512_srlv_epi64(zh, hshift), m3);
                    const __m512i u = _mm512_or_si512(lo, _mm512_slli_epi64(hb, 4)); /* q + 32 */
                    pf2[qq] = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off[qq], u, xv[qq]));
                }
                for (int j = 0; j < 4; j++) { /* chunk c0 + j: lane half j >> 1 of pf2[j & 1] */
                    const __m512 p = pf2[j & 1];
                    const __m256 pj = (j >> 1) ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))
                                               : _mm512_castps512_ps256(p);
                    const float s0 = d * (float)sc[2 * j], s1 = d * (float)sc[2 * j + 1];
                    const __m256 sv = _mm256_set_m128(_mm_set1_ps(s1 * dx[j]), _mm_set1_ps(s0 * dx[j]));
                    acc[r] = _mm256_fmadd_ps(pj, sv, acc[r]);
                }
            }
        }
        prefetch_rows(pf, 4, &pfo, (sb + 1) * 210, pf_l2);
    }
    for (int r = 0; r < NR; r++) res[r] = qdot_finish(WT_Q6_K, acc[r], 0.0f);
}
#else
#define HC_ROWS_VNNI512 0
#endif

/* NR rows (NR <= 4) with one token; pf: the rows to prefetch meanwhile (see dot_rows1). */
HC_INLINE void qdot_rows1(const int wt, const int NR, const uint8_t *const *rows, const hc_xq *x, int64_t D,
                          float *res, const uint8_t *const *pf, int pf_l2) {
#if HC_ROWS_VNNI512
    if (wt == WT_Q4_0) {
        q4_0_rows1_vnni(NR, rows, x, D, res, pf, pf_l2);
        return;
    }
    if (wt == WT_Q4_K) {
        q4_k_rows1_vnni(NR, rows, x, D, res, pf, pf_l2);
        return;
    }
    if (wt == WT_Q6_K) {
        q6_k_rows1_vnni(NR, rows, x, D, res, pf, pf_l2);
        return;
    }
#endif
    const int64_t nchunk = D / 32;
    int64_t pfo = 0;
#if HC_QSIMD
    __m256 acc[4];
    float macc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
#else
    float acc[4], macc[4];
    for (int r = 0; r < NR; r++) acc[r] = 0.0f, macc[r] = 0.0f;
#endif
#if HC_QSIMD
    /* Q2_K, IQ4_XS: a super-block's 8 chunks unrolled, so each chunk's place is a constant (1.2x IQ4_XS
     * gathers; Q3_K, Q4_K and Q5_K ran 1.4-2x slower so and decode their scales once a block below) */
    if (wt == WT_Q2_K || wt == WT_IQ4_XS) {
        const int64_t sbb = k_block_bytes(wt);
        for (int64_t sb = 0; sb < nchunk / 8; sb++) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < NR; r++) {
                    float s[2], m[2];
                    const __m256i u = qchunk_k(wt, rows[r] + sb * sbb, j, s, m);
                    qdot_chunk(wt, u, s, m, x, sb * 8 + j, &acc[r], &macc[r]);
                }
            prefetch_rows(pf, 4, &pfo, (sb + 1) * sbb, pf_l2);
        }
        for (int r = 0; r < NR; r++) res[r] = qdot_finish(wt, acc[r], macc[r]);
        return;
    }
    /* Q3_K, Q4_K, Q5_K, Q6_K: each row's super-block scales decoded once (k_scales), then its 8 chunks */
    if (wt == WT_Q3_K || wt == WT_Q4_K || wt == WT_Q5_K || wt == WT_Q6_K) {
        const int64_t sbb = k_block_bytes(wt);
        float sv[4][16], mv[4][8];
        for (int64_t sb = 0; sb < nchunk / 8; sb++) {
            for (int r = 0; r < NR; r++) k_scales(wt, rows[r] + sb * sbb, sv[r], mv[r]);
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < NR; r++) {
                    float s[2], m[2];
                    k_chunk_scales(wt, sv[r], mv[r], j, s, m);
                    qdot_chunk(wt, k_bits(wt, rows[r] + sb * sbb, j), s, m, x, sb * 8 + j, &acc[r], &macc[r]);
                }
            prefetch_rows(pf, 4, &pfo, (sb + 1) * sbb, pf_l2);
        }
        for (int r = 0; r < NR; r++) res[r] = qdot_finish(wt, acc[r], macc[r]);
        return;
    }
#endif
    for (int64_t c = 0; c < nchunk; c++) {
        for (int r = 0; r < NR; r++) {
#if HC_QSIMD
            float s[2], m[2];
            const __m256i u = qchunk(wt, rows[r], c, s, m);
            qdot_chunk(wt, u, s, m, x, c, &acc[r], &macc[r]);
#else
            chunk_ints ci;
            chunk_decode(wt, rows[r], c, &ci);
            const int8_t *xq = x->q + 32 * c;
            int32_t i0 = 0, i1 = 0;
            for (int l = 0; l < 16; l++) i0 += (int32_t)ci.q[l] * xq[l], i1 += (int32_t)ci.q[l + 16] * xq[l + 16];
            const float dx = x->d[c];
            acc[r] = fmaf(ci.s[1] * dx, (float)i1, fmaf(ci.s[0] * dx, (float)i0, acc[r]));
            macc[r] += fmaf(ci.m[1], x->hs[2 * c + 1], ci.m[0] * x->hs[2 * c]);
#endif
        }
        prefetch_rows(pf, 4, &pfo, chunk_off(wt, c + 1), pf_l2);
    }
    for (int r = 0; r < NR; r++) {
#if HC_QSIMD
        res[r] = qdot_finish(wt, acc[r], macc[r]);
#else
        const int mode = q_mode(wt);
        res[r] = mode == AFF_SUB ? acc[r] - macc[r] : mode == AFF_ADD ? acc[r] + macc[r] : acc[r];
#endif
    }
}

/* One row with NT tokens (NT <= QNT): the row's chunks are decoded once for all of them, and each
 * token's arithmetic is the one qdot_rows1 does for it alone. */
HC_INLINE void qdot_row(const int wt, const int NT, const uint8_t *row, const hc_xq *const *xs, int64_t D,
                        float *res, const uint8_t *pf) {
    const int64_t nchunk = D / 32;
    int64_t pfo = 0;
#if HC_QSIMD
    __m256 acc[QNT];
    float macc[QNT];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps(), macc[t] = 0.0f;
    /* super-block scales decoded once (k_scales); Q6_K stays with the unrolled loop below: 1.5-1.7x over
     * 05077f1 at T = 8 either way on a noisy host, not told apart */
    if (wt == WT_Q3_K || wt == WT_Q4_K || wt == WT_Q5_K) {
        const int64_t sbb = k_block_bytes(wt);
        float sv[16], mv[8];
        for (int64_t sb = 0; sb < nchunk / 8; sb++) {
            k_scales(wt, row + sb * sbb, sv, mv);
            for (int j = 0; j < 8; j++) {
                float s[2], m[2];
                k_chunk_scales(wt, sv, mv, j, s, m);
                const __m256i u = k_bits(wt, row + sb * sbb, j);
                for (int t = 0; t < NT; t++) qdot_chunk(wt, u, s, m, xs[t], sb * 8 + j, &acc[t], &macc[t]);
            }
            prefetch_rows(pf ? &pf : NULL, 1, &pfo, (sb + 1) * sbb, 0);
        }
        for (int t = 0; t < NT; t++) res[t] = qdot_finish(wt, acc[t], macc[t]);
        return;
    }
    if (wt == WT_Q2_K || wt == WT_Q6_K || wt == WT_IQ4_XS) { /* as qdot_rows1: super-blocks unrolled */
        const int64_t sbb = k_block_bytes(wt);
        for (int64_t sb = 0; sb < nchunk / 8; sb++) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                float s[2], m[2];
                const __m256i u = qchunk_k(wt, row + sb * sbb, j, s, m);
                for (int t = 0; t < NT; t++) qdot_chunk(wt, u, s, m, xs[t], sb * 8 + j, &acc[t], &macc[t]);
            }
            prefetch_rows(pf ? &pf : NULL, 1, &pfo, (sb + 1) * sbb, 0);
        }
        for (int t = 0; t < NT; t++) res[t] = qdot_finish(wt, acc[t], macc[t]);
        return;
    }
    for (int64_t c = 0; c < nchunk; c++) {
        float s[2], m[2];
        const __m256i u = qchunk(wt, row, c, s, m);
        for (int t = 0; t < NT; t++) qdot_chunk(wt, u, s, m, xs[t], c, &acc[t], &macc[t]);
        prefetch_rows(pf ? &pf : NULL, 1, &pfo, chunk_off(wt, c + 1), 0);
    }
    for (int t = 0; t < NT; t++) res[t] = qdot_finish(wt, acc[t], macc[t]);
#else
    (void)pf, (void)pfo, (void)nchunk;
    for (int t = 0; t < NT; t++) {
        const uint8_t *rows[1] = {row};
        qdot_rows1(wt, 1, rows, xs[t], D, res + t, NULL, 0);
    }
#endif
}

/* The dot products a gather takes, by weight type (a constant after inlining): block weights the
 * integer ones with the tokens' quantized activations, float weights the float ones. NR rows with
 * token 0, or one row with the NT tokens ts. */
HC_INLINE void rows_dot1(const int wt, const int NR, const uint8_t *const *rows, const hc_args *A, float *res,
                         const uint8_t *const *pf, int pf_l2) {
    if (wt_is_block(wt)) qdot_rows1(wt, NR, rows, A->xq, A->D, res, pf, pf_l2);
    else dot_rows1(wt, NR, rows, A->x, A->D, res, pf, pf_l2);
}

#define TOKMAX (QNT > NTMAX ? QNT : NTMAX)
HC_INLINE int tokens_per_pass(const int wt) { return wt_is_block(wt) ? QNT : NTMAX; }

HC_INLINE void row_dot_tokens(const int wt, const int NT, const uint8_t *row, const hc_args *A, const int64_t *ts,
                              float *res, const uint8_t *pf) {
    if (NT > tokens_per_pass(wt)) return; /* never called so: keeps each body's arrays in bounds */
    if (wt_is_block(wt)) {
        const hc_xq *xs[QNT];
        for (int j = 0; j < NT; j++) xs[j] = A->xq + ts[j];
        qdot_row(wt, NT, row, xs, A->D, res, pf);
    } else {
        const float *xs[NTMAX];
        for (int j = 0; j < NT; j++) xs[j] = A->x + ts[j] * A->D;
        dot_row(wt, NT, row, xs, A->D, res, pf);
    }
}

#ifndef HC_HOT_MIN_T
#define HC_HOT_MIN_T 4 /* fewer tokens: every masked row its own pass (not part of the arithmetic) */
#endif

/* Float rows rows_i[0..nr) (nr <= TILE_R) against every token through dot_rows_tokens (a short tile repeats its
 * last row); with a mask, 0 again where it does not want them. The rows pf (TILE_R, NULL entries skipped) are
 * prefetched meanwhile. */
HC_INLINE void tile_rows_pf(const int wt, const hc_args *A, int nr, const int64_t *rows_i, const uint8_t *const *pf) {
    const int64_t F = A->F, T = A->T;
    const uint8_t *rows[TILE_R];
    int64_t ti[TILE_R];
    for (int r = 0; r < TILE_R; r++) {
        ti[r] = rows_i[r < nr ? r : nr - 1];
        rows[r] = A->W + ti[r] * A->stride;
    }
    dot_rows_tokens(wt, nr, rows, ti, A->x, T, A->D, A->out, F, pf);
    if (A->mask)
        for (int r = 0; r < nr; r++)
            for (int64_t t = 0; t < T; t++)
                if (!A->mask[t * F + ti[r]]) A->out[t * F + ti[r]] = 0.0f;
}

/* tile_rows_pf with the index list entries from position k on prefetched. */
HC_INLINE void tile_rows(const int wt, const hc_args *A, int nr, const int64_t *rows_i, int64_t k, int64_t k1,
                         int64_t kn) {
    const uint8_t *pf[TILE_R] = {NULL, NULL, NULL, NULL};
    for (int r = 0; r < TILE_R; r++) {
        const int64_t q = next_pos(k + r, k1, kn, A->n);
        if (q >= 0) pf[r] = A->W + (A->idx ? (int64_t)A->idx[q] : q) * A->stride;
    }
    tile_rows_pf(wt, A, nr, rows_i, pf);
}

/* gather_matvec over index list entries [k0, k1); kn: see next_pos. */
HC_INLINE void gather_part(const int wt, const hc_args *A, int64_t k0, int64_t k1, int64_t kn) {
    const int64_t F = A->F, D = A->D, T = A->T;
    const int32_t *idx = A->idx;
#define ROW_OF(k) (idx ? (int64_t)idx[k] : (int64_t)(k))
    if (idx) { /* this item owns outputs [lo, hi): zero them here, not in another thread's cache */
        const int64_t lo = k0 == 0 ? 0 : idx[k0], hi = k1 == A->n ? F : idx[k1];
        for (int64_t t = 0; t < T; t++) memset(A->out + t * F + lo, 0, sizeof(float) * (size_t)(hi - lo));
    }
    if (T == 1) {
        const int pf_l2 = HC_G * chunk_off(wt, (D + 31) / 32) > HC_PF_L1_BYTES;
        int64_t k = k0;
        for (; k + HC_G <= k1; k += HC_G) {
            const uint8_t *rows[4], *pf[4] = {NULL, NULL, NULL, NULL};
            float res[4];
            for (int r = 0; r < HC_G; r++) {
                rows[r] = A->W + ROW_OF(k + r) * A->stride;
                const int64_t q = next_pos(k + HC_G + r, k1, kn, A->n);
                if (q >= 0) pf[r] = A->W + ROW_OF(q) * A->stride;
            }
            rows_dot1(wt, HC_G, rows, A, res, pf, pf_l2);
            for (int r = 0; r < HC_G; r++) A->out[ROW_OF(k + r)] = res[r];
        }
        for (; k < k1; k++) {
            const uint8_t *rows[1] = {A->W + ROW_OF(k) * A->stride};
            rows_dot1(wt, 1, rows, A, A->out + ROW_OF(k), NULL, 0);
        }
        return;
    }
    if (!wt_is_block(wt) && !A->mask) { /* every token needs every row: tiles of rows x tokens */
        for (int64_t k = k0; k < k1; k += TILE_R) {
            const int nr = k1 - k < TILE_R ? (int)(k1 - k) : TILE_R;
            int64_t rows_i[TILE_R];
            for (int r = 0; r < nr; r++) rows_i[r] = ROW_OF(k + r);
            tile_rows(wt, A, nr, rows_i, k + TILE_R, k1, kn);
        }
        return;
    }
    const int per = tokens_per_pass(wt);
    /* Float rows that most tokens want go through the every-token tile (dot_rows_tokens) in groups of TILE_R,
     * the other tokens' results then set back to 0 (a hot neuron fires for many tokens of a batch). The tile's
     * multiply-adds run up to twice as fast as a row's pass over its own tokens, which reads their x from L2
     * when there are many: from 16 tokens a row that half of them want costs less in the tile; below, where
     * the tokens' x stay close, only a row that nearly all want does (F16, 128 x 2048, one core, random
     * masks: T = 52 half wanted 1.0x, 70% 1.5x, all 2.4x; T = 8 all 1.5x). Each result keeps dot_row's bits. */
    const int hot_tile = !wt_is_block(wt) && A->mask && T >= HC_HOT_MIN_T && T <= HC_WANT_MAX;
    const int64_t hot_min = T >= 16 ? (T + 1) / 2 : T - T / 8;
    /* Blocks of up to HC_ITEM_ROWS positions: the rows are sorted first (the one scan of each row's mask column,
     * bytes F apart, lists the tokens that want it), then the hot ones go through the tile four at a time with
     * the next four hot rows prefetched, then the others one at a time with the next of them prefetched (the hot
     * tiles prefetched the next index entries before, mostly rows that were not theirs: a 52-token gate's tiles
     * ran at half the rate of the same tile over contiguous rows). */
    for (int64_t b0 = k0; b0 < k1; b0 += HC_ITEM_ROWS) {
        const int64_t b1 = k1 - b0 < HC_ITEM_ROWS ? k1 : b0 + HC_ITEM_ROWS;
        int64_t hot_i[HC_ITEM_ROWS], own_k[HC_ITEM_ROWS];
        uint8_t wanted[HC_ITEM_ROWS][HC_WANT_MAX]; /* hot_tile: the tokens that want own_k[j], nwant[j] of them */
        int16_t nwant[HC_ITEM_ROWS];
        int nhot = 0, nown = 0;
        for (int64_t k = b0; k < b1; k++) {
            if (!hot_tile) {
                own_k[nown++] = k;
                continue;
            }
            const int64_t i = ROW_OF(k);
            int64_t want = 0;
            uint8_t *wl = wanted[nown];
            for (int64_t t = 0; t < T; t++) {
                wl[want] = (uint8_t)t;
                want += A->mask[t * F + i] != 0;
            }
            if (want >= hot_min) hot_i[nhot++] = i;
            else if (want > 0) nwant[nown] = (int16_t)want, own_k[nown++] = k;
        }
        const uint8_t *next_block = NULL; /* the first row after this block, for the last prefetch */
        {
            const int64_t q = next_pos(b1, k1, kn, A->n);
            if (q >= 0) next_block = A->W + ROW_OF(q) * A->stride;
        }
        for (int j = 0; j < nhot; j += TILE_R) {
            const int nr = nhot - j < TILE_R ? nhot - j : TILE_R;
            const uint8_t *pf[TILE_R] = {NULL, NULL, NULL, NULL};
            for (int r = 0; r < TILE_R; r++) {
                const int h = j + TILE_R + r, o = h - nhot; /* the next hot rows, then this block's others */
                if (h < nhot) pf[r] = A->W + hot_i[h] * A->stride;
                else if (o < nown) pf[r] = A->W + ROW_OF(own_k[o]) * A->stride;
                else if (o == nown) pf[r] = next_block;
            }
            tile_rows_pf(wt, A, nr, hot_i + j, pf);
        }
        for (int j = 0; j < nown; j++) {
            const int64_t k = own_k[j], i = ROW_OF(k);
            const uint8_t *row = A->W + i * A->stride;
            const uint8_t *pf = j + 1 < nown ? A->W + ROW_OF(own_k[j + 1]) * A->stride : next_block;
            int64_t ts[TOKMAX];
            float res[TOKMAX];
            int cnt = 0;
            const int64_t nt = hot_tile ? nwant[j] : T;
            for (int64_t u = 0; u < nt; u++) {
                const int64_t t = hot_tile ? wanted[j][u] : u;
                if (!hot_tile && A->mask && !A->mask[t * F + i]) continue;
                ts[cnt++] = t;
                if (cnt == per) {
                    if (per == QNT) row_dot_tokens(wt, QNT, row, A, ts, res, pf);
                    else row_dot_tokens(wt, NTMAX, row, A, ts, res, pf);
                    pf = NULL;
                    for (int q = 0; q < cnt; q++) A->out[ts[q] * F + i] = res[q];
                    cnt = 0;
                }
            }
            switch (cnt) { /* the rest, with a constant token count so the accumulators stay in registers */
            case 1: row_dot_tokens(wt, 1, row, A, ts, res, pf); break;
#if TOKMAX > 2
            case 2: row_dot_tokens(wt, 2, row, A, ts, res, pf); break;
            case 3: row_dot_tokens(wt, 3, row, A, ts, res, pf); break;
#endif
#if TOKMAX > 4
            case 4: row_dot_tokens(wt, 4, row, A, ts, res, pf); break;
            case 5: row_dot_tokens(wt, 5, row, A, ts, res, pf); break;
            case 6: row_dot_tokens(wt, 6, row, A, ts, res, pf); break;
            case 7: row_dot_tokens(wt, 7, row, A, ts, res, pf); break;
#endif
            default: break;
            }
            for (int q = 0; q < cnt; q++) A->out[ts[q] * F + i] = res[q];
        }
    }
#undef ROW_OF
}

#if HC_QSIMD
/* Q4_K chunks c (even) and c + 1 as floats, w[0, NV) and w[NV, 2 NV): they share 32 bytes of nibbles
 * (low: chunk c, high: c + 1) and a super-block header, unpacked once; each value is load32's (qchunk's
 * s and m, then s * q - m, two roundings). */
HC_INLINE void load_q4_k_pair(const uint8_t *row, int64_t c, vf *w) {
    const uint8_t *b = row + (c >> 3) * 144;
    const int j = (int)(c & 7);
    const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
    const __m256i q = ld256(b + 16 + (j >> 1) * 32), m15 = _mm256_set1_epi8(15);
    for (int half = 0; half < 2; half++) {
        int sc, mn;
        scale_min_k4(b + 4, j + half, &sc, &mn);
        const vf s = vset1(d * (float)sc), m = vset1(dmin * (float)mn);
        const __m256i u = _mm256_and_si256(half ? _mm256_srli_epi16(q, 4) : q, m15);
        for (int v = 0; v < NV; v++) w[half * NV + v] = vsub(vmul(s, vcvt_i8(u, v)), m);
    }
}
#endif

/* acc[j] += a_r * row_r[j] for NR rows in order (one fma per row and element), columns chunks
 * [c0, c1); pf: rows whose lines are prefetched meanwhile. */
HC_INLINE void axpy_rows(const int wt, const int NR, const uint8_t *const *rows, const float *coef, float *acc,
                         int64_t c0, int64_t c1, const uint8_t *const *pf) {
    const int pf_l2 = HC_AG * chunk_off(wt, (c1 - c0)) > HC_PF_L1_BYTES;
    vf va[HC_AG];
    for (int r = 0; r < NR; r++) va[r] = vset1(coef[r]);
    int64_t pfo = chunk_off(wt, c0) & ~(int64_t)63;
#if HC_QSIMD
    if (wt == WT_Q4_K && !((c0 | c1) & 1)) { /* chunks in pairs: the same values and fma per element */
        for (int64_t c = c0; c < c1; c += 2) {
            vf s[2 * NV];
            for (int v = 0; v < 2 * NV; v++) s[v] = vloadu(acc + c * 32 + v * VL);
            for (int r = 0; r < NR; r++) {
                vf w[2 * NV];
                load_q4_k_pair(rows[r], c, w);
                for (int v = 0; v < 2 * NV; v++) s[v] = vfma(va[r], w[v], s[v]);
            }
            for (int v = 0; v < 2 * NV; v++) vstoreu(acc + c * 32 + v * VL, s[v]);
            prefetch_rows(pf, HC_AG, &pfo, chunk_off(wt, c + 2), pf_l2);
        }
        return;
    }
    if ((wt == WT_Q3_K || wt == WT_Q5_K || wt == WT_Q6_K) && !((c0 | c1) & 7)) { /* whole super-blocks: scales
                                                                                * decoded once a block */
        const int64_t sbb = k_block_bytes(wt);
        float sv[HC_AG][16], mv[HC_AG][8];
        for (int64_t sb = c0 / 8; sb < c1 / 8; sb++) {
            for (int r = 0; r < NR; r++) k_scales(wt, rows[r] + sb * sbb, sv[r], mv[r]);
            for (int j = 0; j < 8; j++) {
                const int64_t c = sb * 8 + j;
                vf s[NV];
                for (int v = 0; v < NV; v++) s[v] = vloadu(acc + c * 32 + v * VL);
                for (int r = 0; r < NR; r++) {
                    vf w[NV];
                    k_load32(wt, rows[r] + sb * sbb, j, sv[r], mv[r], w);
                    for (int v = 0; v < NV; v++) s[v] = vfma(va[r], w[v], s[v]);
                }
                for (int v = 0; v < NV; v++) vstoreu(acc + c * 32 + v * VL, s[v]);
            }
            prefetch_rows(pf, HC_AG, &pfo, (sb + 1) * sbb, pf_l2);
        }
        return;
    }
#endif
    for (int64_t c = c0; c < c1; c++) {
        vf s[NV];
        for (int v = 0; v < NV; v++) s[v] = vloadu(acc + c * 32 + v * VL);
        for (int r = 0; r < NR; r++) {
            vf w[NV];
            load32(wt, rows[r], c, w);
            for (int v = 0; v < NV; v++) s[v] = vfma(va[r], w[v], s[v]);
        }
        for (int v = 0; v < NV; v++) vstoreu(acc + c * 32 + v * VL, s[v]);
        prefetch_rows(pf, HC_AG, &pfo, chunk_off(wt, c + 1), pf_l2);
    }
}

HC_INLINE void axpy_tail(const int wt, const uint8_t *row, float a, float *acc, int64_t j0, int64_t D) {
    for (int64_t j = j0; j < D; j++) acc[j] = fmaf(a, wscalar(wt, row, j), acc[j]);
}

/* One token: acc (zeroed, D floats) = the fma chain over index list entries [k0, k1), all columns;
 * kn: see next_pos. */
HC_INLINE void axpy_block(const int wt, const hc_args *A, int64_t k0, int64_t k1, int64_t kn, float *acc,
                          int64_t c0, int64_t c1, int tail) {
    const int64_t D = A->D, jt = (D / 32) * 32;
    int64_t k = k0;
    for (; k + HC_AG <= k1; k += HC_AG) {
        const uint8_t *rows[HC_AG], *pf[HC_AG];
        for (int r = 0; r < HC_AG; r++) {
            rows[r] = A->W + (int64_t)A->idx[k + r] * A->stride;
            const int64_t q = next_pos(k + HC_AG + r, k1, kn, A->n);
            pf[r] = q >= 0 ? A->W + (int64_t)A->idx[q] * A->stride : NULL;
        }
        axpy_rows(wt, HC_AG, rows, A->coef + k, acc, c0, c1, pf);
        if (tail)
            for (int r = 0; r < HC_AG; r++) axpy_tail(wt, rows[r], A->coef[k + r], acc, jt, D);
    }
    for (; k < k1; k++) { /* the last rows one at a time: the same fma per row and element */
        const uint8_t *rows[1] = {A->W + (int64_t)A->idx[k] * A->stride};
        axpy_rows(wt, 1, rows, A->coef + k, acc, c0, c1, NULL);
        if (tail) axpy_tail(wt, rows[0], A->coef[k], acc, jt, D);
    }
}

/* out[j0, j1) += part[j0, j1) (the ordered sum of block sums). */
HC_INLINE void add_into(float *out, const float *part, int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + VL <= j1; j += VL) vstoreu(out + j, vadd(vloadu(out + j), vloadu(part + j)));
    for (; j < j1; j++) out[j] = out[j] + part[j];
}

/* Several tokens, column chunks [c0, c1) (+ the scalar tail columns if tail): each union row is read
 * once and applied to every token that needs it; part ([T, width] floats, zeroed) and cnt ([T],
 * zeroed) hold each token's open block, flushed into out every HC_AXB of its rows. */
HC_INLINE void axpy_batch(const int wt, const hc_args *A, int64_t c0, int64_t c1, int tail, float *part,
                          int64_t *cnt, int64_t *ts, float *as) {
    const int64_t F = A->F, D = A->D, T = A->T, n = A->n;
    const int64_t j0 = c0 * 32, j1 = tail ? D : c1 * 32, width = j1 - j0, jt = (D / 32) * 32;
    for (int64_t k = 0; k < n; k++) {
        const int64_t i = A->idx[k];
        const uint8_t *row = A->W + i * A->stride;
        const uint8_t *pf = (k + 1 < n) ? A->W + (int64_t)A->idx[k + 1] * A->stride : NULL;
        int64_t m = 0;
        for (int64_t t = 0; t < T; t++) { /* branch-free: whether a token takes a row is data */
            const float a = A->x[t * F + i];
            ts[m] = t;
            as[m] = a;
            m += (a != 0.0f) & (!A->mask || A->mask[t * F + i] != 0);
        }
#if HC_QSIMD
        const int whole_blocks = !((c0 | c1) & 7) && (wt == WT_Q3_K || wt == WT_Q4_K || wt == WT_Q5_K || wt == WT_Q6_K);
        float sv[16], mv[8]; /* the current super-block's scales (whole_blocks) */
#endif
        for (int64_t c = c0; c < c1; c++) {
            vf w[NV];
#if HC_QSIMD
            if (whole_blocks) { /* a super-block's scales decoded once for its 8 chunks: load32's values */
                const uint8_t *b = row + (c >> 3) * k_block_bytes(wt);
                if (!(c & 7)) k_scales(wt, b, sv, mv);
                k_load32(wt, b, (int)(c & 7), sv, mv, w);
            } else
#endif
                load32(wt, row, c, w);
            for (int64_t q = 0; q < m; q++) {
                float *acc = part + ts[q] * width + (c - c0) * 32;
                const vf va = vset1(as[q]);
                for (int v = 0; v < NV; v++) vstoreu(acc + v * VL, vfma(va, w[v], vloadu(acc + v * VL)));
            }
            if (HC_PF && pf)
                for (int64_t o = chunk_off(wt, c) & ~(int64_t)63; o < chunk_off(wt, c + 1); o += 64) vprefetch(pf + o);
        }
        for (int64_t q = 0; q < m; q++) {
            float *acc = part + ts[q] * width;
            if (tail)
                for (int64_t j = jt; j < D; j++) acc[j - j0] = fmaf(as[q], wscalar(wt, row, j), acc[j - j0]);
            if (++cnt[ts[q]] == HC_AXB) { /* the token's block is complete */
                add_into(A->out + ts[q] * D + j0, acc, 0, width);
                memset(acc, 0, sizeof(float) * (size_t)width);
                cnt[ts[q]] = 0;
            }
        }
    }
    for (int64_t t = 0; t < T; t++)
        if (cnt[t]) add_into(A->out + t * D + j0, part + t * width, 0, width);
}

#ifndef HC_AXG
#define HC_AXG 64 /* union rows per group of a float batch axpy (not part of the arithmetic) */
#endif

/* axpy_batch for float weights (and Q8_0, Q4_0, Q5_0), the same arithmetic with fewer memory operations: the union rows go in
 * groups of HC_AXG; for each token, its rows of the group (ascending) are applied chunk by chunk with
 * the token's open block sum in registers (one load and store of it per chunk and group, not per row).
 * part / cnt: as axpy_batch; lk, la ([T * HC_AXG]) and nl ([T]): each token's rows of the group. Where a
 * token's block ends inside a group (list positions fl, fl + HC_AXB, ...), its sum goes into out. */
#ifndef AXPY_CHUNKS
#define AXPY_CHUNKS (VL == 16 ? 4 : 3) /* column chunks a token's rows pass over together */
#endif
#if AXPY_CHUNKS < 1 || AXPY_CHUNKS > 4
#error "AXPY_CHUNKS must be 1..4 (axpy_batch_float has a case for each shorter remainder)"
#endif

/* Every token's rows of every group of a batch axpy, built once per call for all its column items (each
 * item built them again before, for all groups: 28% of a 52-token axpy over 49% of 5632 x 2048 F16 rows).
 * Group g is union positions [g * HC_AXG, ...) of A->idx; token t's rows in it (ascending, those with
 * a[t, i] != 0 and the mask set) are rows[off[g * T + t], off[g * T + t + 1]), coefficients alongside. */
typedef struct {
    int64_t *off;
    int32_t *rows;
    float *coef;
} hc_axlists;

static void axlists_free(hc_axlists *L) {
    free(L->off);
    free(L->rows);
    free(L->coef);
}

/* Token t's wanted rows in [r0, r1): counted (rows NULL) or written from position o on. Returns the count. A
 * row is wanted where a[t, i] != 0 (NaN included) and the mask is NULL or set, as axpy_batch decides. */
static int64_t axlist_scan(const hc_args *A, int64_t t, int64_t r0, int64_t r1, int32_t *rows, float *coef) {
    const float *a = A->x + t * A->F;
    const uint8_t *m = A->mask ? A->mask + t * A->F : NULL;
    int64_t o = 0, i = r0;
#define HC_AXL_TAKE(BITS, BASE)                                                                              \
    do {                                                                                                     \
        uint64_t b_ = (BITS);                                                                                \
        if (!rows) o += __builtin_popcountll(b_);                                                            \
        else                                                                                                 \
            for (; b_; b_ &= b_ - 1, o++) {                                                                  \
                const int64_t j_ = (BASE) + __builtin_ctzll(b_);                                             \
                rows[o] = (int32_t)j_;                                                                       \
                coef[o] = a[j_];                                                                             \
            }                                                                                                \
    } while (0)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; i + 16 <= r1; i += 16) {
        uint64_t bits = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + i), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (m) {
            const __m128i mb = _mm_loadu_si128((const __m128i *)(m + i));
            bits &= _mm_test_epi8_mask(mb, mb);
        }
        HC_AXL_TAKE(bits, i);
    }
#elif defined(__AVX2__)
    for (; i + 8 <= r1; i += 8) {
        uint64_t bits = (uint64_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + i), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        if (m) {
            const __m128i mb = _mm_loadl_epi64((const __m128i *)(m + i));
            bits &= ~(uint64_t)_mm_movemask_epi8(_mm_cmpeq_epi8(mb, _mm_setzero_si128())) & 0xff;
        }
        HC_AXL_TAKE(bits, i);
    }
#endif
    for (; i < r1; i++) HC_AXL_TAKE((a[i] != 0.0f) & (!m || m[i] != 0), i);
#undef HC_AXL_TAKE
    return o;
}

/* The lists of A (A->idx, A->n union rows, T tokens): counted, then written, groups in parallel. -1 if memory
 * ran out. */
static int axlists_make(const hc_args *A, int nth, hc_axlists *L) {
    const int64_t T = A->T, n = A->n, ng = (n + HC_AXG - 1) / HC_AXG;
    L->rows = NULL;
    L->coef = NULL;
    L->off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(ng * T + 1));
    if (!L->off) return -1;
    nth = nth < 1 ? 1 : ng < nth ? (int)(ng > 0 ? ng : 1) : nth;
    (void)nth; /* unused without OpenMP */
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static)
#endif
    for (int64_t g = 0; g < ng; g++) {
        const int64_t r0 = A->idx[g * HC_AXG], r1 = A->idx[(g + 1) * HC_AXG < n ? (g + 1) * HC_AXG - 1 : n - 1] + 1;
        for (int64_t t = 0; t < T; t++) L->off[g * T + t + 1] = axlist_scan(A, t, r0, r1, NULL, NULL);
    }
    L->off[0] = 0;
    for (int64_t j = 1; j <= ng * T; j++) L->off[j] += L->off[j - 1];
    const int64_t total = L->off[ng * T];
    L->rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    L->coef = (float *)malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!L->rows || !L->coef) {
        axlists_free(L);
        return -1;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static)
#endif
    for (int64_t g = 0; g < ng; g++) {
        const int64_t r0 = A->idx[g * HC_AXG], r1 = A->idx[(g + 1) * HC_AXG < n ? (g + 1) * HC_AXG - 1 : n - 1] + 1;
        for (int64_t t = 0; t < T; t++) axlist_scan(A, t, r0, r1, L->rows + L->off[g * T + t], L->coef + L->off[g * T + t]);
    }
    return 0;
}

/* n bytes from src to dst (a few hundred: a group copy's row), 64 at a time. */
HC_INLINE void copy_bytes(uint8_t *dst, const uint8_t *src, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 64 <= n; j += 64) _mm512_storeu_si512((void *)(dst + j), _mm512_loadu_si512((const void *)(src + j)));
#elif defined(__AVX2__)
    for (; j + 32 <= n; j += 32) _mm256_storeu_si256((__m256i *)(dst + j), _mm256_loadu_si256((const __m256i *)(src + j)));
#endif
    if (j < n) memcpy(dst + j, src + j, (size_t)(n - j));
}

/* One token's list rows rk[0..m) (coefficients ra) into NCH chunks of columns: row i's chunks read from
 * S + (i - r0) * sb (the group's copy, see axpy_batch_float, or the matrix itself); the open block sum (pc) in registers, added into
 * oc when the list position fl closes the block. Each vector's fma chain is the one-chunk loop's (same rows,
 * same order); NCH chunks side by side give NCH * NV chains in flight, where one chunk's NV = 4 left the fma
 * latency-bound. */
HC_INLINE void axpy_rows_chunks(const int wt, const int NCH, const uint8_t *S, int64_t sb, int64_t r0,
                                const int32_t *rk, const float *ra, int64_t m, int64_t fl, float *pc, float *oc) {
    vf acc[AXPY_CHUNKS][NV];
    for (int h = 0; h < NCH; h++)
        for (int v = 0; v < NV; v++) acc[h][v] = vloadu(pc + h * 32 + v * VL);
    for (int64_t q = 0; q < m; q++) {
        const uint8_t *row = S + ((int64_t)rk[q] - r0) * sb;
        const vf va = vset1(ra[q]);
        for (int h = 0; h < NCH; h++)
            for (int v = 0; v < NV; v++) acc[h][v] = vfma(va, load_vec(wt, row, h, v), acc[h][v]);
        if (q == fl) {
            for (int h = 0; h < NCH; h++)
                for (int v = 0; v < NV; v++) {
                    vstoreu(oc + h * 32 + v * VL, vadd(vloadu(oc + h * 32 + v * VL), acc[h][v]));
                    acc[h][v] = vzero();
                }
            fl += HC_AXB;
        }
    }
    for (int h = 0; h < NCH; h++)
        for (int v = 0; v < NV; v++) vstoreu(pc + h * 32 + v * VL, acc[h][v]);
}

HC_INLINE void axpy_batch_float(const int wt, const hc_args *A, const hc_axlists *L, int64_t c0, int64_t c1, int tail,
                                float *part, int64_t *cnt, uint8_t *S) {
    const int64_t D = A->D, T = A->T, n = A->n;
    const int64_t j0 = c0 * 32, j1 = tail ? D : c1 * 32, width = j1 - j0, jt = (D / 32) * 32;
    for (int64_t g0 = 0; g0 < n; g0 += HC_AXG) {
        const int64_t g1 = g0 + HC_AXG < n ? g0 + HC_AXG : n;
        const int64_t *off = L->off + (g0 / HC_AXG) * T;
        const int64_t r0 = A->idx[g0];
        const int copy = off[T] - off[0] >= 2 * (g1 - g0); /* (pairs of the group: its lists are contiguous) */
        /* Column chunks outside, tokens inside: every token that takes a row of the group reads the same
         * AXPY_CHUNKS chunks of it (HC_AXG x AXPY_CHUNKS x 64 B of F16: 16 KB, the group copy below). */
        for (int64_t c = c0; c < c1; c += AXPY_CHUNKS) {
            const int64_t nch = c1 - c < AXPY_CHUNKS ? c1 - c : AXPY_CHUNKS;
            /* Where the group's tokens take its rows twice on average or more, the rows' bytes of these
             * chunks are first copied side by side, slot i - r0 for row i: rows of a matrix lie a power
             * of two apart, so the same columns of many rows share a few L1 sets and evicted each other
             * between the tokens that take them (52 tokens over 49% of 5632 x 2048 F16 rows, 22 matrices:
             * 37 -> 31 ms; 8 tokens, ~3 takers a row: 11 -> 9.5 ms). A row with one taker is read once
             * either way, so groups of such rows are not copied. */
            const int64_t cb0 = chunk_off(wt, c), sb = chunk_off(wt, c + nch) - cb0;
            const uint8_t *base = A->W + cb0;
            int64_t bstride = A->stride, bfirst = 0;
            if (copy) {
                for (int64_t k = g0; k < g1; k++) {
                    const int64_t i = A->idx[k];
                    copy_bytes(S + (i - r0) * sb, A->W + i * A->stride + cb0, sb);
                }
                base = S, bstride = sb, bfirst = r0;
            }
            if (HC_PF && g1 < n) /* the next group's rows, these columns' lines, spread over the steps */
                for (int64_t k = g1; k < n && k < g1 + HC_AXG; k++)
                    for (int64_t o = chunk_off(wt, c) & ~(int64_t)63; o < chunk_off(wt, c + nch); o += 64)
                        vprefetch_l2(A->W + (int64_t)A->idx[k] * A->stride + o);
            for (int64_t t = 0; t < T; t++) {
                const int64_t m = off[t + 1] - off[t];
                if (!m) continue;
                const int64_t fl = HC_AXB - cnt[t] - 1; /* the list position after which the first block ends */
                const int32_t *rk = L->rows + off[t];
                const float *ra = L->coef + off[t];
                float *pc = part + t * width + (c - c0) * 32, *oc = A->out + t * D + c * 32;
                /* Constant counts keep the accumulators in registers. Every remainder shorter than
                 * AXPY_CHUNKS needs its own case: default reads and writes AXPY_CHUNKS whole chunks
                 * (AVX-512's 4 with a remainder of 3 ran one chunk past the item's partial sums). */
                switch (nch) {
#if AXPY_CHUNKS > 1
                case 1: axpy_rows_chunks(wt, 1, base, bstride, bfirst, rk, ra, m, fl, pc, oc); break;
#endif
#if AXPY_CHUNKS > 2
                case 2: axpy_rows_chunks(wt, 2, base, bstride, bfirst, rk, ra, m, fl, pc, oc); break;
#endif
#if AXPY_CHUNKS > 3
                case 3: axpy_rows_chunks(wt, 3, base, bstride, bfirst, rk, ra, m, fl, pc, oc); break;
#endif
                default: axpy_rows_chunks(wt, AXPY_CHUNKS, base, bstride, bfirst, rk, ra, m, fl, pc, oc); break;
                }
            }
        }
        for (int64_t t = 0; t < T; t++) {
            const int64_t m = off[t + 1] - off[t];
            if (!m) continue;
            if (tail) {
                const int32_t *rk = L->rows + off[t];
                const float *ra = L->coef + off[t];
                float *pt = part + t * width, *ot = A->out + t * D + j0;
                for (int64_t q = 0, ft = HC_AXB - cnt[t] - 1; q < m; q++) {
                    const uint8_t *row = A->W + (int64_t)rk[q] * A->stride;
                    for (int64_t j = jt; j < D; j++) pt[j - j0] = fmaf(ra[q], wscalar(wt, row, j), pt[j - j0]);
                    if (q == ft) {
                        for (int64_t j = jt; j < D; j++) {
                            ot[j - j0] = ot[j - j0] + pt[j - j0];
                            pt[j - j0] = 0.0f;
                        }
                        ft += HC_AXB;
                    }
                }
            }
            cnt[t] = (cnt[t] + m) % HC_AXB;
        }
    }
    for (int64_t t = 0; t < T; t++)
        if (cnt[t]) add_into(A->out + t * D + j0, part + t * width, 0, width);
}

/* Dispatch on the weight type so every kernel body is specialised with a constant wt. */
#define HC_DISPATCH(WT, CALL)                                                                                \
    switch (WT) {                                                                                            \
    case WT_F32: CALL(WT_F32); break;                                                                        \
    case WT_F16: CALL(WT_F16); break;                                                                        \
    case WT_BF16: CALL(WT_BF16); break;                                                                      \
    case WT_Q8_0: CALL(WT_Q8_0); break;                                                                      \
    case WT_Q4_0: CALL(WT_Q4_0); break;                                                                      \
    case WT_Q5_0: CALL(WT_Q5_0); break;                                                                      \
    case WT_Q6_K: CALL(WT_Q6_K); break;                                                                      \
    case WT_Q4_1: CALL(WT_Q4_1); break;                                                                      \
    case WT_Q5_1: CALL(WT_Q5_1); break;                                                                      \
    case WT_Q2_K: CALL(WT_Q2_K); break;                                                                      \
    case WT_Q3_K: CALL(WT_Q3_K); break;                                                                      \
    case WT_Q4_K: CALL(WT_Q4_K); break;                                                                      \
    case WT_Q5_K: CALL(WT_Q5_K); break;                                                                      \
    case WT_IQ4_NL: CALL(WT_IQ4_NL); break;                                                                  \
    default: CALL(WT_IQ4_XS); break;                                                                         \
    }

static void gather_range(int wt, const hc_args *A, int64_t k0, int64_t k1, int64_t kn) {
#define CALL(W) gather_part(W, A, k0, k1, kn)
    HC_DISPATCH(wt, CALL)
#undef CALL
}

static void axpy_block_range(int wt, const hc_args *A, int64_t k0, int64_t k1, int64_t kn, float *acc,
                             int64_t c0, int64_t c1, int tail) {
#define CALL(W) axpy_block(W, A, k0, k1, kn, acc, c0, c1, tail)
    HC_DISPATCH(wt, CALL)
#undef CALL
}

/* The batch axpy types whose lists are built once per call (axlists_make) for axpy_batch_float. */
HC_INLINE int axpy_listed(int wt) {
    return wt == WT_F16 || wt == WT_F32 || wt == WT_BF16 || wt == WT_Q8_0 || wt == WT_Q4_0 || wt == WT_Q5_0;
}

static void axpy_batch_range(int wt, const hc_args *A, const hc_axlists *L, int64_t c0, int64_t c1, int tail,
                             float *part, int64_t *cnt, int64_t *ts, float *as, uint8_t *S) {
    if (wt == WT_F16) axpy_batch_float(WT_F16, A, L, c0, c1, tail, part, cnt, S);
    else if (wt == WT_F32) axpy_batch_float(WT_F32, A, L, c0, c1, tail, part, cnt, S);
    else if (wt == WT_BF16) axpy_batch_float(WT_BF16, A, L, c0, c1, tail, part, cnt, S);
    /* Q8_0 (the default type of a sparsified float file's copies), Q4_0 and Q5_0 too: a block is one chunk,
     * so a vector is load32's; the register-held sums took a 52-token axpy over 48% of 5632 x 2048 from 51 to
     * ~8 ms for Q8_0 (every token's partial sum went through memory for every row) */
    else if (wt == WT_Q8_0) axpy_batch_float(WT_Q8_0, A, L, c0, c1, tail, part, cnt, S);
    else if (wt == WT_Q4_0) axpy_batch_float(WT_Q4_0, A, L, c0, c1, tail, part, cnt, S);
    else if (wt == WT_Q5_0) axpy_batch_float(WT_Q5_0, A, L, c0, c1, tail, part, cnt, S);
    else {
#define CALL(W) axpy_batch(W, A, c0, c1, tail, part, cnt, ts, as)
        HC_DISPATCH(wt, CALL)
#undef CALL
    }
}

/* Indices i with m[i] != 0, ascending. */
static int64_t mask_to_idx(const uint8_t *m, int64_t F, int32_t *idx) {
    int64_t n = 0, i = 0;
#if defined(__AVX512BW__)
    for (; i + 64 <= F; i += 64) {
        const __m512i v = _mm512_loadu_si512((const void *)(m + i));
        uint64_t bits = _mm512_test_epi8_mask(v, v);
        while (bits) {
            idx[n++] = (int32_t)(i + __builtin_ctzll(bits));
            bits &= bits - 1;
        }
    }
#elif defined(__AVX2__)
    for (; i + 32 <= F; i += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(m + i));
        uint32_t bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_setzero_si256()));
        while (bits) {
            idx[n++] = (int32_t)(i + __builtin_ctz(bits));
            bits &= bits - 1;
        }
    }
#endif
    for (; i < F; i++)
        if (m[i]) idx[n++] = (int32_t)i;
    return n;
}

HC_INLINE int clamp_threads(int nth, int64_t work) {
    if (nth < 1) nth = 1;
    if (work < nth) nth = work > 0 ? (int)work : 1;
    return nth;
}

/* Work items handed out dynamically, one claimed ahead: a thread that the OS (or a GPU driver
 * thread) preempts does not hold the others up, and a thread knows its next item early enough to
 * prefetch its first rows. Which thread computes an item never changes a result. */
HC_INLINE int64_t claim(int64_t *next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }

/* The gathers of nmat index lists (A[m].n rows each; nmat > 1: a layer's q, k, v over all rows) with
 * nth threads: items of a few rows (about 64 KB of F16, short enough that the last ones even out), a
 * matrix's items in order; prefetching runs into the next item when it is in the same matrix. */
static void gather_parallel(int nmat, const int *wts, const hc_args *A, int nth) {
    int64_t first[9] = {0}; /* first work item of each matrix */
    int64_t total = 0;
    for (int m = 0; m < nmat; m++) total += A[m].n;
    nth = clamp_threads(nth, total);
    if (nth == 1) {
        for (int m = 0; m < nmat; m++) gather_range(wts[m], &A[m], 0, A[m].n, -1);
        return;
    }
    int64_t ch = (total / (16 * (int64_t)nth)) & ~(int64_t)(HC_G - 1);
    ch = ch < 8 ? 8 : ch > HC_ITEM_ROWS ? HC_ITEM_ROWS : ch;
    for (int m = 0; m < nmat; m++) first[m + 1] = first[m] + (A[m].n + ch - 1) / ch;
    const int64_t items = first[nmat];
    int64_t next = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
    {
        int64_t it = claim(&next);
        while (it < items) {
            const int64_t nx = claim(&next);
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int64_t k0 = (it - first[m]) * ch, k1 = k0 + ch < A[m].n ? k0 + ch : A[m].n;
            const int64_t kn = nx < first[m + 1] ? (nx - first[m]) * ch : -1;
            gather_range(wts[m], &A[m], k0, k1, kn);
            it = nx;
        }
    }
}

int hc_abi_version(void) { return HC_ABI_VERSION; }

const char *hc_simd(void) { return HC_SIMD; }

/* The rows i that some token t wants, ascending, into idx [F]: (mask NULL or mask[t, i]) and (a NULL or
 * a[t, i] != 0), mask and a [T, F] (not both NULL). Their count, or -1 if memory ran out. */
static int64_t union_rows(const uint8_t *mask, const float *a, int64_t T, int64_t F, int32_t *idx, int nth) {
    if (T == 1 && !a) return mask_to_idx(mask, F, idx);
    uint8_t *u = (uint8_t *)calloc((size_t)(F > 0 ? F : 1), 1);
    if (!u) return -1;
    nth = T * F < (1 << 16) ? 1 : nth; /* a prompt chunk's rows: columns in parallel */
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static)
#endif
    for (int64_t i0 = 0; i0 < F; i0 += 512) {
        const int64_t i1 = i0 + 512 < F ? i0 + 512 : F;
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *m = mask ? mask + t * F : NULL;
            const float *at = a ? a + t * F : NULL;
            if (m && at)
                for (int64_t i = i0; i < i1; i++) u[i] |= (uint8_t)((m[i] != 0) & (at[i] != 0.0f));
            else if (m)
                for (int64_t i = i0; i < i1; i++) u[i] |= (uint8_t)(m[i] != 0);
            else
                for (int64_t i = i0; i < i1; i++) u[i] |= (uint8_t)(at[i] != 0.0f);
        }
    }
    const int64_t n = mask_to_idx(u, F, idx);
    free(u);
    return n;
}

/* hc_gather_matvec of nmat (1 or 2) matrices of F rows and D columns over one mask (NULL: every row), in one
 * parallel region (a thresholded FFN's gate and up); the tokens' quantized activations given (xq, for block
 * weights) or made here. Each matrix's results are those of its own call. */
static int gather_masked_xq(int nmat, const int *wts, const uint8_t *const *Ws, const int64_t *strides, int64_t F,
                            int64_t D, const float *x, int64_t T, const uint8_t *mask, float *const *outs, int nth,
                            const hc_xq *xq) {
    hc_xq_set own = {NULL, NULL};
    int block = 0;
    for (int m = 0; m < nmat; m++) block |= wt_is_block(wts[m]);
    if (block && !xq) {
        if (xq_make(x, T, D, &own) != 0) return -1;
        xq = own.tok;
    }
    int32_t *idx = NULL;
    int64_t n = F;
    if (mask) { /* outputs are zeroed by the work items that own them (gather_part) */
        idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(F > 0 ? F : 1));
        n = idx ? union_rows(mask, NULL, T, F, idx, nth) : -1;
        if (n < 0) {
            free(idx);
            xq_free(&own);
            return -1;
        }
    }
    hc_args A[2]; /* nmat <= 2 */
    for (int m = 0; m < nmat; m++) {
        const hc_args a = {Ws[m], strides[m], F, D, T, x, mask, outs[m], idx, NULL, n,
                           wt_is_block(wts[m]) ? xq : NULL};
        A[m] = a;
        if (mask && n == 0) memset(outs[m], 0, sizeof(float) * (size_t)(T * F));
    }
    gather_parallel(nmat, wts, A, nth);
    free(idx);
    xq_free(&own);
    return 0;
}

/* out[t, i] = dot(W[i], x[t]) where mask is NULL or mask[t, i]; exactly 0 elsewhere (hc_gather_matvec with
 * the tokens' quantized activations given or made here). Returns 0, or -1 if memory ran out. */
static int gather_matvec_xq(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, const float *x, int64_t T,
                            const uint8_t *mask, float *out, int nth, const hc_xq *xq) {
    const uint8_t *Ws[1] = {W};
    const int64_t strides[1] = {stride};
    float *outs[1] = {out};
    return gather_masked_xq(1, &wt, Ws, strides, F, D, x, T, mask, outs, nth, xq);
}

/* out[t, i] = dot(W[i], x[t]) where mask is NULL or mask[t, i]; exactly 0 elsewhere (block weights:
 * the integer dot product with x quantized, see above). Returns 0, or -1 if memory ran out. */
int hc_gather_matvec(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, const float *x, int64_t T,
                     const uint8_t *mask, float *out, int nth) {
    return gather_matvec_xq(wt, W, stride, F, D, x, T, mask, out, nth, NULL);
}

void hc_rms_norm(const float *x, const float *w, float eps, int64_t T, int64_t D, float *out);
void hc_layer_norm(const float *x, const float *w, const float *b, float eps, int64_t T, int64_t D, float *out);

/* With norm_w, *x replaced by hc_rms_norm(*x) in a new buffer *xn (the caller frees it; NULL without norm_w).
 * Returns 0, or -1 if memory ran out. */
static int with_norm(const float **x, const float *norm_w, float eps, int64_t T, int64_t D, float **xn) {
    *xn = NULL;
    if (!norm_w) return 0;
    *xn = (float *)malloc(sizeof(float) * (size_t)(T * D > 0 ? T * D : 1));
    if (!*xn) return -1;
    hc_rms_norm(*x, norm_w, eps, T, D, *xn);
    *x = *xn;
    return 0;
}

/* Several dense matrices that multiply the same x (a layer's q, k and v): out_m [T, F_m] = x @ W_m.T,
 * rows of all of them in one parallel region. Each row's arithmetic is hc_gather_matvec's, so the
 * results equal separate calls bit for bit. At most 8 matrices; all have D columns. With norm_w, x is
 * first replaced by hc_rms_norm(x, norm_w, eps) (the layer's attention norm, saving a call). */
int hc_matvec_multi(int nmat, const int *wts, const uint8_t *const *Ws, const int64_t *strides, const int64_t *Fs,
                    int64_t D, const float *x, int64_t T, const float *norm_w, float eps, float *const *outs,
                    int nth) {
    if (nmat < 1 || nmat > 8) return -1;
    float *xn = NULL;
    if (with_norm(&x, norm_w, eps, T, D, &xn) != 0) return -1;
    hc_xq_set xq = {NULL, NULL}; /* quantized once for every block matrix */
    for (int m = 0; m < nmat; m++)
        if (wt_is_block(wts[m]) && !xq.tok && xq_make(x, T, D, &xq) != 0) {
            free(xn);
            return -1;
        }
    hc_args A[8];
    for (int m = 0; m < nmat; m++) {
        const hc_args a = {Ws[m], strides[m], Fs[m], D, T, x, NULL, outs[m], NULL, NULL, Fs[m],
                           wt_is_block(wts[m]) ? xq.tok : NULL};
        A[m] = a;
    }
    gather_parallel(nmat, wts, A, nth);
    xq_free(&xq);
    free(xn);
    return 0;
}

#ifndef HC_TBLOCK_MAX_T
#define HC_TBLOCK_MAX_T 16 /* batch axpys of float rows up to this many tokens go by token blocks (not part of the arithmetic) */
#endif

/* A block of one token's rows in a batch axpy by token blocks: its first row orders the work. */
typedef struct {
    int64_t first;
    int32_t t, k;
} hc_tblock;

static int tblock_cmp(const void *a, const void *b) {
    const hc_tblock *x = (const hc_tblock *)a, *y = (const hc_tblock *)b;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return x->t < y->t ? -1 : x->t > y->t;
}

/* A batch axpy of a few tokens as the one-token axpy runs each token: the token's rows (a[t, i] != 0, mask set) in
 * blocks of HC_AXB, each block from zero into its own partial sum over whole rows (axpy_block, HC_AG rows a pass),
 * then each token's partial sums added into out in block order: axpy_batch's arithmetic. The blocks of every token
 * are handed out in the order of their first rows, so the tokens that take a row read it close together in time
 * (from cache after the first), and each block prefetches the first rows of the one handed out after it. Against
 * axpy_batch_float's groups, whose threads read half rows a few chunks at a time (measured, the 1B synthetic's 22
 * down_t of 5632 x 2048 F16 in huge pages, masks of a batched step: 8 tokens 0.85x the time; the batch step
 * 1.064x the tokens/s at 8 sequences, 1.051x at 4, 1.031x at 16; 52 tokens 1.16x slower, so prompts keep the
 * groups). -1 if memory ran out. */
static int axpy_token_blocks(int wt, const hc_args *A, int nth) {
    const int64_t T = A->T, F = A->F, D = A->D, nchunk = D / 32;
    const int tail = (D % 32) != 0;
    int64_t *toff = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1)); /* token t's rows: [toff[t], toff[t + 1]) */
    int64_t *tb = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1));   /* token t's blocks: [tb[t], tb[t + 1]) */
    if (!toff || !tb) {
        free(toff);
        free(tb);
        return -1;
    }
    toff[0] = 0, tb[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t m = axlist_scan(A, t, 0, F, NULL, NULL);
        toff[t + 1] = toff[t] + m;
        tb[t + 1] = tb[t] + (m + HC_AXB - 1) / HC_AXB;
    }
    const int64_t total = toff[T], items = tb[T];
    int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    float *coef = (float *)malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    hc_tblock *order = (hc_tblock *)malloc(sizeof(hc_tblock) * (size_t)(items > 0 ? items : 1));
    float *part = (float *)malloc(sizeof(float) * (size_t)((items > 0 ? items : 1) * D)); /* block q's sum at q * D */
    const int rc = rows && coef && order && part ? 0 : -1;
    if (rc == 0 && items > 0) {
        for (int64_t t = 0; t < T; t++) {
            axlist_scan(A, t, 0, F, rows + toff[t], coef + toff[t]);
            for (int64_t k = 0; k < tb[t + 1] - tb[t]; k++) {
                hc_tblock *o = order + tb[t] + k;
                o->first = rows[toff[t] + k * HC_AXB], o->t = (int32_t)t, o->k = (int32_t)k;
            }
        }
        qsort(order, (size_t)items, sizeof(hc_tblock), tblock_cmp);
        nth = clamp_threads(nth, items);
        int64_t next = 0;
        const int64_t ncol = (D + 255) / 256; /* reduction items of 256 columns */
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
        {
            int32_t li[HC_AXB + HC_AG]; /* the block's rows, then the next block's first HC_AG (prefetched) */
            float lc[HC_AXB + HC_AG];
            int64_t it = claim(&next);
            while (it < items) {
                const int64_t nx = claim(&next);
                const hc_tblock *o = order + it;
                const int64_t t = o->t, m = toff[t + 1] - toff[t];
                const int64_t k0 = (int64_t)o->k * HC_AXB, len = (k0 + HC_AXB < m ? k0 + HC_AXB : m) - k0;
                memcpy(li, rows + toff[t] + k0, sizeof(int32_t) * (size_t)len);
                memcpy(lc, coef + toff[t] + k0, sizeof(float) * (size_t)len);
                int64_t extra = 0;
                if (nx < items) {
                    const hc_tblock *p = order + nx;
                    const int64_t pk0 = (int64_t)p->k * HC_AXB, pleft = toff[p->t + 1] - toff[p->t] - pk0;
                    extra = pleft < HC_AG ? pleft : HC_AG;
                    memcpy(li + len, rows + toff[p->t] + pk0, sizeof(int32_t) * (size_t)extra);
                }
                hc_args At = *A;
                At.idx = li, At.coef = lc, At.n = len + extra;
                float *acc = part + (tb[t] + o->k) * D;
                memset(acc, 0, sizeof(float) * (size_t)D);
                axpy_block_range(wt, &At, 0, len, extra ? len : -1, acc, 0, nchunk, tail);
                it = nx;
            }
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(static)
#endif
            for (int64_t j = 0; j < T * ncol; j++) {
                const int64_t t = j / ncol, j0 = (j % ncol) * 256, j1 = j0 + 256 < D ? j0 + 256 : D;
                for (int64_t q = tb[t]; q < tb[t + 1]; q++) add_into(A->out + t * D, part + q * D, j0, j1);
            }
        }
    }
    free(toff);
    free(tb);
    free(rows);
    free(coef);
    free(order);
    free(part);
    return rc;
}

/* out[t] = sum over rows i (ascending) with (mask NULL or mask[t, i]) and a[t, i] != 0 of a[t, i] * W[i],
 * summed in blocks of HC_AXB rows (see the top of this file). Returns 0, or -1 if memory ran out. */
int hc_sparse_axpy(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, const float *a, int64_t T,
                   const uint8_t *mask, float *out, int nth) {
    hc_args A = {W, stride, F, D, T, a, mask, out, NULL, NULL, 0, NULL};
    memset(out, 0, sizeof(float) * (size_t)(T * D));
    /* a few tokens of float rows: each token's own rows, so the union below is not needed */
    if (T > 1 && T <= HC_TBLOCK_MAX_T && (wt == WT_F16 || wt == WT_BF16 || wt == WT_F32))
        return axpy_token_blocks(wt, &A, nth);
    int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(F > 0 ? F : 1));
    float *coef = (float *)malloc(sizeof(float) * (size_t)(F > 0 ? F : 1));
    A.n = idx && coef ? union_rows(mask, a, T, F, idx, nth) : -1;
    if (A.n < 0) {
        free(idx);
        free(coef);
        return -1;
    }
    for (int64_t k = 0; k < A.n; k++) coef[k] = a[idx[k]]; /* used when T == 1 */
    A.idx = idx;
    A.coef = coef;
    int rc = 0;
    const int64_t n = A.n, nblk = (n + HC_AXB - 1) / HC_AXB, nchunk = D / 32;
    const int tail = (D % 32) != 0;

    if (T == 1 && nblk <= 1) {
        axpy_block_range(wt, &A, 0, n, -1, out, 0, nchunk, tail); /* one block: its chain is the result */
    } else if (T == 1) {
        /* Blocks are computed side by side into their own partial sums, then added in block order
         * (columns split among the threads). One thread reuses a single partial buffer. */
        nth = clamp_threads(nth, nblk);
        float *part = (float *)malloc(sizeof(float) * (size_t)(D * (nth == 1 ? 1 : nblk)));
        if (!part) {
            rc = -1;
        } else if (nth == 1) {
            for (int64_t b = 0; b < nblk; b++) {
                const int64_t k0 = b * HC_AXB, k1 = k0 + HC_AXB < n ? k0 + HC_AXB : n;
                memset(part, 0, sizeof(float) * (size_t)D);
                axpy_block_range(wt, &A, k0, k1, k1 < n ? k1 : -1, part, 0, nchunk, tail);
                add_into(out, part, 0, D);
            }
        } else {
            int64_t next = 0;
            const int64_t ncol = (D + 255) / 256; /* reduction items of 256 columns */
            /* Items are whole blocks, except the last nth blocks, which go as column halves so the
             * threads finish together (columns are independent: the arithmetic is the same; measured
             * +3-4% at 10% of a 1B FFN with 2 threads). */
            const int64_t nsplit = nchunk >= 2 ? (nblk < nth ? nblk : nth) : 0, nwhole = nblk - nsplit;
            const int64_t items = nwhole + 2 * nsplit, half = nchunk / 2;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
            {
                int64_t it = claim(&next);
                while (it < items) {
                    const int64_t nx = claim(&next);
                    const int64_t b = it < nwhole ? it : nwhole + (it - nwhole) / 2;
                    const int64_t bn = nx < nwhole ? nx : nwhole + (nx - nwhole) / 2; /* next item's block */
                    const int64_t k0 = b * HC_AXB, k1 = k0 + HC_AXB < n ? k0 + HC_AXB : n;
                    int64_t c0 = 0, c1 = nchunk, j0 = 0, j1 = D;
                    if (it >= nwhole) { /* a column half of a block */
                        const int second = (int)((it - nwhole) & 1);
                        c0 = second ? half : 0, c1 = second ? nchunk : half;
                        j0 = c0 * 32, j1 = second ? D : half * 32;
                    }
                    float *acc = part + b * D;
                    memset(acc + j0, 0, sizeof(float) * (size_t)(j1 - j0));
                    axpy_block_range(wt, &A, k0, k1, nx < items ? bn * HC_AXB : -1, acc, c0, c1, tail && j1 == D);
                    it = nx;
                }
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(static)
#endif
                for (int64_t cb = 0; cb < ncol; cb++) {
                    const int64_t j0 = cb * 256, j1 = j0 + 256 < D ? j0 + 256 : D;
                    for (int64_t q = 0; q < nblk; q++) add_into(out, part + q * D, j0, j1);
                }
            }
        }
        free(part);
    } else if (n > 0) {
        /* Columns split among the threads; each item keeps every token's open block for its columns
         * (at most ~256 KB of partial sums per thread). */
        /* As few items as the partial sums allow, a multiple of the threads: each item reads its columns
         * of every union row, and the longer that stretch of a row, the better the rows stream from memory
         * (one item a thread against two: 1.3-1.5x at T = 8-40, F16 5632 x 2048, 2 threads). */
        const int64_t nt = nth > 1 ? nth : 1, fit = (HC_AXPY_PART_BYTES / 4) / (32 * T);
        const int64_t cb_max = fit > 1 ? fit : 1, per_thread = (nchunk + nt * cb_max - 1) / (nt * cb_max);
        int64_t cb = nchunk > 0 ? (nchunk + nt * per_thread - 1) / (nt * per_thread) : 1;
        cb = cb < 1 ? 1 : cb;
        const int64_t items = nchunk > 0 ? (nchunk + cb - 1) / cb : 1;
        const int64_t wmax = cb * 32 + (tail ? D % 32 : 0);
        hc_axlists L = {NULL, NULL, NULL};
        if (axpy_listed(wt) && axlists_make(&A, nth, &L) != 0) {
            free(idx);
            free(coef);
            return -1;
        }
        int64_t axg_span = 1; /* rows spanned by the widest group */
        for (int64_t g0 = 0; g0 < n; g0 += HC_AXG) {
            const int64_t span = idx[g0 + HC_AXG < n ? g0 + HC_AXG - 1 : n - 1] - idx[g0] + 1;
            axg_span = span > axg_span ? span : axg_span;
        }
        nth = clamp_threads(nth, items);
        int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
        {
            float *part = (float *)malloc(sizeof(float) * (size_t)(T * wmax));
            int64_t *cnt = (int64_t *)malloc(sizeof(int64_t) * (size_t)T);
            int64_t *ts = (int64_t *)malloc(sizeof(int64_t) * (size_t)T); /* axpy_batch's row tokens */
            float *as = (float *)malloc(sizeof(float) * (size_t)T);
            /* axpy_batch_float's group copy: a slot per row of the widest group's row range */
            uint8_t *S = axpy_listed(wt) ? (uint8_t *)malloc((size_t)(axg_span * chunk_off(wt, AXPY_CHUNKS))) : NULL;
            failed = !part || !cnt || !ts || !as || (axpy_listed(wt) && !S);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t it = 0; it < items; it++) {
                if (failed) continue;
                const int64_t c0 = it * cb, c1 = c0 + cb < nchunk ? c0 + cb : nchunk;
                const int last = it == items - 1;
                memset(part, 0, sizeof(float) * (size_t)(T * wmax));
                memset(cnt, 0, sizeof(int64_t) * (size_t)T);
                axpy_batch_range(wt, &A, &L, c0, c1, tail && last, part, cnt, ts, as, S);
            }
            free(part);
            free(cnt);
            free(ts);
            free(as);
            free(S);
        }
        axlists_free(&L);
        rc = failed ? -1 : 0;
    }
    free(idx);
    free(coef);
    return rc;
}

/* out[k, :] = dequantized row rows[k] (rows NULL: row k), k < n; exact as ggml. */
HC_INLINE void dequant_part(const int wt, const uint8_t *W, int64_t stride, const int32_t *rows, int64_t D,
                            float *out, int64_t k0, int64_t k1) {
    const int64_t nchunk = D / 32;
    for (int64_t k = k0; k < k1; k++) {
        const uint8_t *row = W + (rows ? (int64_t)rows[k] : k) * stride;
        float *o = out + k * D;
        for (int64_t c = 0; c < nchunk; c++) {
            vf w[NV];
            load32(wt, row, c, w);
            for (int v = 0; v < NV; v++) vstoreu(o + c * 32 + v * VL, w[v]);
        }
        for (int64_t j = nchunk * 32; j < D; j++) o[j] = wscalar(wt, row, j);
    }
}

static void dequant_range(int wt, const uint8_t *W, int64_t stride, const int32_t *rows, int64_t D, float *out,
                          int64_t k0, int64_t k1) {
#define CALL(WTC) dequant_part(WTC, W, stride, rows, D, out, k0, k1)
    HC_DISPATCH(wt, CALL)
#undef CALL
}

int hc_dequantize(int wt, const uint8_t *W, int64_t stride, const int32_t *rows, int64_t n, int64_t D, float *out,
                  int nth) {
    nth = clamp_threads(nth, n);
    if (nth == 1 || n * D < (1 << 16)) {
        dequant_range(wt, W, stride, rows, D, out, 0, n);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
    {
        const int64_t ith = omp_get_thread_num(), nt = omp_get_num_threads();
        dequant_range(wt, W, stride, rows, D, out, n * ith / nt, n * (ith + 1) / nt);
    }
#else
    dequant_range(wt, W, stride, rows, D, out, 0, n);
#endif
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Dense GEMV over a repacked copy (Q4_0, Q4_K, Q6_K): rows in groups of 8, each 32-value chunk stored as the 8
 * rows' fp16 scales (16 bytes) and 4 x 32 bytes where byte 4r + j of part k holds value 4k + j of row
 * r in its low nibble and value 4k + 16 + j in its high one. One 32-bit broadcast of 4 activations
 * then multiplies 4 values of all 8 rows (maddubs), a chunk's products add up in 16-bit lanes (at
 * most 8 * 2 * 15 * 127 = 30480) and one multiply-add per chunk applies the 8 rows' scales: about a
 * third of the row kernel's instructions per weight, with no horizontal sums (each lane is a row).
 * The packed copy is made at load for matrices that are only ever multiplied whole (attention, the
 * head, a dense file's FFN); sparse gathers keep the file's rows. A row's arithmetic (integer chunk
 * sum, then fma of (float)sum * (d * dx) in chunk order) is fixed: any thread count, any batch.
 * ---------------------------------------------------------------------------------------------- */
#define PK_ROWS 8
#define PK_Q4_0_CHUNK (16 + 128) /* bytes of one chunk of a group */
/* Q4_K: per super-block of a group the 8 rows' d and dmin (fp16), then per chunk their 6-bit scale and
 * min (one byte each) and the nibbles as Q4_0's: 32 + 8 * (16 + 128) bytes, the file's 8 * 144 + 32. */
#define PK_Q4_K_SUPER (32 + 8 * (16 + 128))
/* Q6_K: per super-block the 8 rows' d, then per chunk their two int8 scales (first halves, then second
 * halves), the low nibbles in Q4_0's order (128 bytes) and the 2 high bits (64 bytes: byte 4r + j of
 * pair kk holds those of values 4kk + j, 4kk + 16 + j, 4kk + 8 + j, 4kk + 24 + j, two bits each):
 * exactly the file's 8 * 210 bytes. */
#define PK_Q6_K_CHUNK (16 + 128 + 64)
#define PK_Q6_K_SUPER (16 + 8 * PK_Q6_K_CHUNK)
/* Q8_0: per chunk the 8 rows' scales (fp16), then the values in groups of 4: byte 32k + 4r + j is value
 * 4k + j of row r (k = 0..7): exactly the file's 8 * 34 bytes. */
#define PK_Q8_0_CHUNK (16 + 256)

HC_INLINE int packable(int wt, int64_t D) {
    return ((wt == WT_Q4_0 || wt == WT_Q8_0) && D % 32 == 0) || ((wt == WT_Q4_K || wt == WT_Q6_K) && D % 256 == 0) ||
           ((wt == WT_F16 || wt == WT_BF16) && D > 0);
}

/* Packed 16-bit float rows (F16, BF16): blocks of PKF_ROWS rows, column by column ([k][PKF_ROWS] halves, the last block
 * padded with zero rows), so a product broadcasts x[t, k] against PKF_V vectors of rows: one fma chain per
 * (row, token) over the columns in order, whatever the token count or the tile, so a token's bits never depend
 * on the batch (and do not on the vector width either). PKF_T tokens a tile. */
#if VL == 16
#define PKF_V 4
#define PKF_T 6
#else
#define PKF_V 2
#define PKF_T 4
#endif
#define PKF_ROWS (PKF_V * VL)
#define PKF_KSEG 256 /* columns a pass: PKF_ROWS x 256 halves (32 KB with 512-bit vectors) stay in L1 for the tokens */
#define PKF_KSEG2 64 /* columns a pass with two token tiles (pkf_block) */
#define PKF_PF (32 * PKF_ROWS) /* prefetch distance in halves: 32 columns (4 KB with 512-bit vectors) */

int64_t hc_packed_nbytes(int wt, int64_t F, int64_t D) {
    if (!packable(wt, D)) return -1;
    if (wt == WT_F16 || wt == WT_BF16) return (F + PKF_ROWS - 1) / PKF_ROWS * PKF_ROWS * D * 2;
    const int64_t ng = (F + PK_ROWS - 1) / PK_ROWS;
    return wt == WT_Q4_0   ? ng * (D / 32) * PK_Q4_0_CHUNK
           : wt == WT_Q8_0 ? ng * (D / 32) * PK_Q8_0_CHUNK
           : wt == WT_Q4_K ? ng * (D / 256) * PK_Q4_K_SUPER
                           : ng * (D / 256) * PK_Q6_K_SUPER;
}

/* The nibbles of 8 rows' chunks (u[r]: 32 values 0..15 each) in the packed order. */
static void pack_nibbles(const uint8_t u[PK_ROWS][32], uint8_t *dst) {
    for (int r = 0; r < PK_ROWS; r++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++)
                dst[32 * k + 4 * r + j] = (uint8_t)(u[r][4 * k + j] | (u[r][4 * k + 16 + j] << 4));
}

/* W (rows stride bytes apart) -> P (hc_packed_nbytes bytes); the last group is padded with zero rows
 * (scales 0). Returns 0, or -1 for a type that has no packed form. */
int hc_pack(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, uint8_t *P) {
    if (!packable(wt, D)) return -1;
    if (wt == WT_F16 || wt == WT_BF16) { /* 16-bit values moved as they are */
        const int64_t nb = (F + PKF_ROWS - 1) / PKF_ROWS;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t b = 0; b < nb; b++) {
            uint16_t *dst = (uint16_t *)P + b * PKF_ROWS * D;
            const uint16_t *rows[PKF_ROWS];
            for (int64_t i = 0; i < PKF_ROWS; i++) {
                const int64_t r = b * PKF_ROWS + i;
                rows[i] = r < F ? (const uint16_t *)(W + r * stride) : NULL;
            }
            int64_t k = 0;
            for (; k + 4 <= D; k += 4) /* four columns of a row in one (little-endian) read, four lines written */
                for (int64_t i = 0; i < PKF_ROWS; i++) {
                    uint64_t v = 0;
                    if (rows[i]) memcpy(&v, rows[i] + k, 8);
                    for (int j = 0; j < 4; j++) dst[(k + j) * PKF_ROWS + i] = (uint16_t)(v >> (16 * j));
                }
            for (; k < D; k++)
                for (int64_t i = 0; i < PKF_ROWS; i++) dst[k * PKF_ROWS + i] = rows[i] ? rows[i][k] : 0;
        }
        return 0;
    }
    const int64_t nc = D / 32, ng = (F + PK_ROWS - 1) / PK_ROWS;
    memset(P, 0, (size_t)hc_packed_nbytes(wt, F, D));
#ifdef _OPENMP
#pragma omp parallel for schedule(static) /* groups are independent: at load, every core */
#endif
    for (int64_t g = 0; g < ng; g++) {
        const int nr = F - g * PK_ROWS < PK_ROWS ? (int)(F - g * PK_ROWS) : PK_ROWS;
        for (int64_t c = 0; c < nc; c++) {
            if (wt == WT_Q8_0) {
                uint8_t *dst = P + (g * nc + c) * PK_Q8_0_CHUNK;
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + c * 34;
                    memcpy(dst + 2 * r, b, 2);
                    for (int k = 0; k < 8; k++) memcpy(dst + 16 + 32 * k + 4 * r, b + 2 + 4 * k, 4);
                }
                continue;
            }
            uint8_t u[PK_ROWS][32] = {{0}};
            uint8_t *dst;
            if (wt == WT_Q4_0) {
                dst = P + (g * nc + c) * PK_Q4_0_CHUNK;
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + c * 18;
                    memcpy(dst + 2 * r, b, 2);
                    for (int l = 0; l < 16; l++) u[r][l] = b[2 + l] & 15, u[r][l + 16] = b[2 + l] >> 4;
                }
                dst += 16;
            } else if (wt == WT_Q6_K) {
                const int j = (int)(c & 7);
                uint8_t *sb = P + (g * (nc / 8) + c / 8) * PK_Q6_K_SUPER;
                dst = sb + 16 + j * PK_Q6_K_CHUNK;
                uint8_t hb[PK_ROWS][32] = {{0}};
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + (c / 8) * 210;
                    if (j == 0) memcpy(sb + 2 * r, b + 208, 2);
                    chunk_ints ci;
                    dec_q6_k(b, j, &ci);
                    const int h = j >> 2, qq = j & 3;
                    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
                    dst[r] = (uint8_t)sc[0], dst[8 + r] = (uint8_t)sc[1];
                    for (int l = 0; l < 32; l++) {
                        const int v = ci.q[l] + 32; /* 0..63 */
                        u[r][l] = (uint8_t)(v & 15), hb[r][l] = (uint8_t)(v >> 4);
                    }
                }
                uint8_t *hi = dst + 16 + 128;
                for (int r = 0; r < PK_ROWS; r++)
                    for (int kk = 0; kk < 2; kk++)
                        for (int jj = 0; jj < 4; jj++) {
                            const int v0 = 4 * kk + jj;
                            hi[32 * kk + 4 * r + jj] = (uint8_t)(hb[r][v0] | (hb[r][v0 + 16] << 2) | (hb[r][v0 + 8] << 4) |
                                                                 (hb[r][v0 + 24] << 6));
                        }
                dst += 16;
            } else { /* Q4_K */
                const int j = (int)(c & 7);
                uint8_t *sb = P + (g * (nc / 8) + c / 8) * PK_Q4_K_SUPER;
                dst = sb + 32 + j * (16 + 128);
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + (c / 8) * 144;
                    if (j == 0) memcpy(sb + 2 * r, b, 2), memcpy(sb + 16 + 2 * r, b + 2, 2);
                    int sc, mn;
                    scale_min_k4(b + 4, j, &sc, &mn);
                    dst[r] = (uint8_t)sc, dst[8 + r] = (uint8_t)mn;
                    const uint8_t *qs = b + 16 + (j >> 1) * 32;
                    for (int l = 0; l < 32; l++) u[r][l] = (qs[l] >> (4 * (j & 1))) & 15;
                }
                dst += 16;
            }
            pack_nibbles((const uint8_t(*)[32])u, dst);
        }
    }
    return 0;
}

#if HC_QSIMD
/* The 8 rows' sums over one chunk of sum_i u_r[i] x[i] (nib: the chunk's 4 x 32 packed bytes). */
HC_INLINE __m256i packed_chunk_sums(const uint8_t *nib, const int8_t *xc) {
    const __m256i m15 = _mm256_set1_epi8(15);
#if HC_VNNI /* the same exact sums, accumulated in 32-bit lanes by dpbusd */
    __m256i s32 = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        const __m256i p = ld256(nib + 32 * k);
        int32_t x0, x1;
        memcpy(&x0, xc + 4 * k, 4);
        memcpy(&x1, xc + 4 * k + 16, 4);
        s32 = dot4_acc(s32, _mm256_and_si256(p, m15), _mm256_set1_epi32(x0));
        s32 = dot4_acc(s32, _mm256_and_si256(_mm256_srli_epi16(p, 4), m15), _mm256_set1_epi32(x1));
    }
    return s32;
#else
    __m256i s16 = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        const __m256i p = ld256(nib + 32 * k);
        int32_t x0, x1;
        memcpy(&x0, xc + 4 * k, 4);
        memcpy(&x1, xc + 4 * k + 16, 4);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(p, m15), _mm256_set1_epi32(x0)));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 4), m15),
                                                          _mm256_set1_epi32(x1)));
    }
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}
#endif

#if HC_QSIMD
/* The 8 rows' exact sums over one Q8_0 chunk (v: its 8 x 32 packed values): signed x signed through
 * maddubs, |w| (unsigned) times x with w's sign; |w x + w x| <= 2 * 128 * 127 fits int16. */
HC_INLINE __m256i packed_q8_chunk_sums(const uint8_t *v, const int8_t *xc) {
    __m256i i32 = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i w = ld256(v + 32 * k);
        int32_t xk;
        memcpy(&xk, xc + 4 * k, 4);
        i32 = dot4_acc(i32, _mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(xk), w));
    }
    return i32;
}
#endif
/* Row r's packed chunk sum, portable. */
HC_INLINE int32_t packed_chunk_sum1(const uint8_t *nib, const int8_t *xc, int r) {
    int32_t s = 0;
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) {
            const uint8_t v = nib[32 * k + 4 * r + j];
            s += (int32_t)(v & 15) * xc[4 * k + j] + (int32_t)(v >> 4) * xc[4 * k + 16 + j];
        }
    return s;
}

/* Row r's exact sum over one Q8_0 chunk, portable. */
HC_INLINE int32_t packed_q8_chunk_sum1(const uint8_t *v, const int8_t *xc, int r) {
    int32_t s = 0;
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 4; j++) s += (int32_t)(int8_t)v[32 * k + 4 * r + j] * xc[4 * k + j];
    return s;
}

/* out[8] = the 8 rows of a Q4_0 or Q8_0 group (Pg: its chunks, 8 fp16 scales then the values) with one
 * token: per chunk each row's exact integer sum (Q4_0: sum (u - 8) x = sum u x - 8 sum x), then
 * (float)sum * (d * dx) accumulated in chunk order. */
HC_INLINE void packed_group_block(const int wt, const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
    const int64_t cb = wt == WT_Q4_0 ? PK_Q4_0_CHUNK : PK_Q8_0_CHUNK;
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * cb;
        const int8_t *xc = x->q + 32 * c;
        const __m256i i32 = wt == WT_Q4_0
                                ? _mm256_sub_epi32(packed_chunk_sums(b + 16, xc), _mm256_set1_epi32(8 * x->qsum[c]))
                                : packed_q8_chunk_sums(b + 16, xc);
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), _mm256_set1_ps(x->d[c]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), d, acc);
    }
    _mm256_storeu_ps(out8, acc);
#else
    float acc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * cb;
        const int8_t *xc = x->q + 32 * c;
        for (int r = 0; r < PK_ROWS; r++) {
            const int32_t s = wt == WT_Q4_0 ? packed_chunk_sum1(b + 16, xc, r) - 8 * x->qsum[c]
                                            : packed_q8_chunk_sum1(b + 16, xc, r);
            acc[r] = fmaf((float)s, h2f(rd16(b + 2 * r)) * x->d[c], acc[r]);
        }
    }
    memcpy(out8, acc, sizeof acc);
#endif
}
#if HC_QSIMD
HC_INLINE __m256 cvt8_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* out[8] = the 8 rows of a Q4_K group (Pg: its super-blocks) with one token: per chunk,
 * (float)sum * (d * sc * dx) accumulated, then minus the mins' terms (dmin * mn * dx * sum x). */
HC_INLINE void packed_group_q4_k(const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sb = Pg + sbi * PK_Q4_K_SUPER;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16)));
        for (int j = 0; j < 8; j++) {
            const int64_t c = sbi * 8 + j;
            const uint8_t *b = sb + 32 + j * (16 + 128);
            const __m256i i32 = packed_chunk_sums(b + 16, x->q + 32 * c);
            const __m256 s = _mm256_mul_ps(_mm256_mul_ps(d, cvt8_u8(b)), _mm256_set1_ps(x->d[c]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), s, acc);
            macc = _mm256_fmadd_ps(_mm256_mul_ps(dmin, cvt8_u8(b + 8)), _mm256_set1_ps(x->hc[c]), macc);
        }
    }
    _mm256_storeu_ps(out8, _mm256_sub_ps(acc, macc));
#else
    float acc[PK_ROWS] = {0}, macc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *sb = Pg + (c / 8) * PK_Q4_K_SUPER, *b = sb + 32 + (c & 7) * (16 + 128);
        for (int r = 0; r < PK_ROWS; r++) {
            const float s = h2f(rd16(sb + 2 * r)) * (float)b[r], m = h2f(rd16(sb + 16 + 2 * r)) * (float)b[8 + r];
            acc[r] = fmaf((float)packed_chunk_sum1(b + 16, x->q + 32 * c, r), s * x->d[c], acc[r]);
            macc[r] = fmaf(m, x->hc[c], macc[r]);
        }
    }
    for (int r = 0; r < PK_ROWS; r++) out8[r] = acc[r] - macc[r];
#endif
}

/* Value l of row r in a packed Q6_K chunk (b: the chunk), 0..63. */
HC_INLINE int packed_q6_value(const uint8_t *b, int r, int l) {
    const int half = l >> 4, m = l & 15, k = m >> 2, j = m & 3; /* l = 4k + j + 16 half */
    const uint8_t nib = b[16 + 32 * k + 4 * r + j];
    const int lo = half ? nib >> 4 : nib & 15;
    const int kk = k & 1, which = (k >> 1) * 2 + half; /* value 4kk + j + 8 (k >> 1) + 16 half */
    return lo | (((b[16 + 128 + 32 * kk + 4 * r + j] >> (2 * which)) & 3) << 4);
}

/* out[8] = the 8 rows of a Q6_K group with one token: per half of each chunk, (float)(sum u x - 32 sum x)
 * * (d * scale * dx), accumulated in chunk and half order. */
HC_INLINE void packed_group_q6_k(const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps();
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sb = Pg + sbi * PK_Q6_K_SUPER;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        for (int j = 0; j < 8; j++) {
            const int64_t c = sbi * 8 + j;
            const uint8_t *b = sb + 16 + j * PK_Q6_K_CHUNK;
            const int8_t *xc = x->q + 32 * c;
            const __m256i h0 = ld256(b + 16 + 128), h1 = ld256(b + 16 + 128 + 32);
            __m256i i32[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int k = 0; k < 4; k++) {
                const __m256i p = ld256(b + 16 + 32 * k), hb = (k & 1) ? h1 : h0;
                const int sh = (k >> 1) * 4;
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(p, m15),
                                                   _mm256_slli_epi16(_mm256_and_si256(srl16(hb, sh), m3), 4));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), m15),
                                                   _mm256_slli_epi16(_mm256_and_si256(srl16(hb, sh + 2), m3), 4));
                int32_t x0, x1;
                memcpy(&x0, xc + 4 * k, 4);
                memcpy(&x1, xc + 4 * k + 16, 4);
                i32[0] = dot4_acc(i32[0], lo, _mm256_set1_epi32(x0));
                i32[1] = dot4_acc(i32[1], hi, _mm256_set1_epi32(x1));
            }
            const __m256 dx = _mm256_set1_ps(x->d[c]);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_sub_epi32(i32[h], _mm256_set1_epi32(32 * x->qhs[2 * c + h]));
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h))));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(_mm256_mul_ps(d, sc), dx), acc);
            }
        }
    }
    _mm256_storeu_ps(out8, acc);
#else
    float acc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *sb = Pg + (c / 8) * PK_Q6_K_SUPER, *b = sb + 16 + (c & 7) * PK_Q6_K_CHUNK;
        const int8_t *xc = x->q + 32 * c;
        for (int r = 0; r < PK_ROWS; r++)
            for (int h = 0; h < 2; h++) {
                int32_t sum = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) sum += packed_q6_value(b, r, l) * xc[l];
                sum -= 32 * x->qhs[2 * c + h];
                const float s = h2f(rd16(sb + 2 * r)) * (float)(int8_t)b[8 * h + r];
                acc[r] = fmaf((float)sum, s * x->d[c], acc[r]);
            }
    }
    memcpy(out8, acc, sizeof acc);
#endif
}

/* outs[m] [T, Fs[m]] = x [T, D] @ W_m.T for nmat (1-8) matrices from their packed copies Ps[m] (a
 * layer's q, k, v or an FFN's up and gate): x quantized once, every matrix's groups in one parallel
 * region (work items of 32 rows, claimed in order), each group's result as in a call of its own. With
 * norm_w the matrices multiply hc_rms_norm(x). Returns 0, or -1 (memory, or a type or width with no
 * packed form). */
/* NT tokens (x rows at xt, D apart) against packed block Pb over columns [k0, k1): acc [PKF_V][NT] carried in.
 * The first token tile prefetches its pass's columns into L1 just ahead (up to pf_end); with several tiles, tile
 * `phase` of `every` also asks for every every-th column of the next pass into L2 (up to l2_end), so memory keeps
 * streaming while the later tiles work from L1 (every = 0: none); kseg: the columns of a pass. */
HC_INLINE void pkf_tile(const int BF, const int NT, const uint16_t *Pb, const float *xt, int64_t D, int64_t k0,
                        int64_t k1, vf (*acc)[PKF_T], const uint16_t *pf_end, int64_t every, int64_t phase,
                        const uint16_t *l2_end, int64_t kseg) {
    vf a[PKF_V][PKF_T];
    for (int v = 0; v < PKF_V; v++)
        for (int t = 0; t < NT; t++) a[v][t] = acc[v][t];
    const uint16_t *p = Pb + k0 * PKF_ROWS;
    for (int64_t k = k0; k < k1; k++, p += PKF_ROWS) {
        if (p + PKF_PF < pf_end) /* the block streams from memory once (the first token tile): ahead of it */
            for (int l = 0; l < PKF_ROWS * 2; l += 64) vprefetch((const uint8_t *)(p + PKF_PF) + l);
        if (every && (k - k0) % every == phase && p + kseg * PKF_ROWS < l2_end)
            for (int l = 0; l < PKF_ROWS * 2; l += 64) vprefetch_l2((const uint8_t *)(p + kseg * PKF_ROWS) + l);
        vf w[PKF_V];
        for (int v = 0; v < PKF_V; v++) w[v] = BF ? vload_bf16(p + v * VL) : vload_f16(p + v * VL);
        for (int t = 0; t < NT; t++) {
            const vf xb = vset1(xt[t * D + k]);
            for (int v = 0; v < PKF_V; v++) a[v][t] = vfma(w[v], xb, a[v][t]);
        }
    }
    for (int v = 0; v < PKF_V; v++)
        for (int t = 0; t < NT; t++) acc[v][t] = a[v][t];
}

/* out [T, F] rows [b * PKF_ROWS, +PKF_ROWS) of one packed F16 block: the columns in passes of PKF_KSEG or PKF_KSEG2 (the
 * block's pass stays in L1 for every token tile), each (row, token) one fma chain over the columns in order. */
HC_INLINE void pkf_block(const int BF, const uint16_t *Pb, const float *x, int64_t T, int64_t D, float *out,
                         int64_t F, int64_t b, vf *accs) {
    const int last = (b + 1) * PKF_ROWS >= F; /* the matrix's last block: nothing of its own after it */
    const int64_t ntile = (T + PKF_T - 1) / PKF_T;
    for (int64_t j = 0; j < ntile * PKF_V * PKF_T; j++) accs[j] = vzero();
    /* Two token tiles (T = 7-12 with 512-bit vectors: a batched decode step) take passes of PKF_KSEG2 columns:
     * the second tile re-reads a shorter stretch while the first's prefetches are still landing (measured, 2048 x
     * 2048 F16, 2 threads: T = 8 0.93x the time of 256-column passes, T = 16 0.99x; in the batch-8 step of the 1B
     * synthetic 1.053x the tokens/s). The passes change where the accumulators rest, not the fma chains: the
     * same bits. */
    const int64_t kseg = VL == 16 && ntile == 2 ? PKF_KSEG2 : PKF_KSEG;
    for (int64_t k0 = 0; k0 < D; k0 += kseg) {
        const int64_t k1 = k0 + kseg < D ? k0 + kseg : D;
        for (int64_t i = 0; i < ntile; i++) {
            const int64_t t0 = i * PKF_T, nt = T - t0 < PKF_T ? T - t0 : PKF_T;
            vf(*acc)[PKF_T] = (vf(*)[PKF_T])(accs + i * PKF_V * PKF_T);
            const float *xt = x + t0 * D;
            const uint16_t *pe = i == 0 ? Pb + D * PKF_ROWS : Pb; /* prefetch on the first tile only */
            /* the next pass: this block's next columns, or the next block's first (blocks lie back to back;
             * measured with 2-3 tiles: T=10-16 5-9% faster, a 52-token prompt 2%, T <= 6 has one tile) */
            const int64_t every = ntile > 1 ? ntile : 0;
            const uint16_t *le = Pb + (last ? D : D + kseg) * PKF_ROWS;
            switch (nt) { /* constant counts: registers */
            case 1: pkf_tile(BF, 1, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 2: pkf_tile(BF, 2, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 3: pkf_tile(BF, 3, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
#if PKF_T > 4
            case 4: pkf_tile(BF, 4, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 5: pkf_tile(BF, 5, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
#endif
            default: pkf_tile(BF, PKF_T, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            }
        }
    }
    const int64_t r0 = b * PKF_ROWS, nr = F - r0 < PKF_ROWS ? F - r0 : PKF_ROWS;
    for (int64_t t = 0; t < T; t++) {
        vf(*acc)[PKF_T] = (vf(*)[PKF_T])(accs + (t / PKF_T) * PKF_V * PKF_T);
        float o[PKF_ROWS];
        for (int v = 0; v < PKF_V; v++) vstoreu(o + v * VL, acc[v][t % PKF_T]);
        memcpy(out + t * F + r0, o, sizeof(float) * (size_t)nr);
    }
}

/* The packed 16-bit float matrices (F16, BF16) of a hc_packed_matvec_multi call: blocks of all of them handed out
 * as work items. */
static int pkf_multi(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D, const float *x,
                     int64_t T, float *const *outs, int nth) {
    int64_t first[9] = {0};
    for (int m = 0; m < nmat; m++) first[m + 1] = first[m] + (Fs[m] + PKF_ROWS - 1) / PKF_ROWS;
    const int64_t items = first[nmat];
    nth = clamp_threads(nth, items);
    int64_t next = 0;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
    {
        /* a decode token's few rows use the stack: no allocation on the hottest path */
        vf local[4 * PKF_V * PKF_T];
        const size_t nacc = (size_t)(((T + PKF_T - 1) / PKF_T) * PKF_V * PKF_T), bytes = sizeof(vf) * nacc;
        vf *accs = nacc <= 4 * PKF_V * PKF_T ? local : (vf *)aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed = accs == NULL;
        for (int64_t it = claim(&next); it < items && accs; it = claim(&next)) {
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int64_t b = it - first[m];
            const uint16_t *Pb = (const uint16_t *)Ps[m] + b * PKF_ROWS * D;
            if (wts[m] == WT_BF16) pkf_block(1, Pb, x, T, D, outs[m], Fs[m], b, accs);
            else pkf_block(0, Pb, x, T, D, outs[m], Fs[m], b, accs);
        }
        if (accs != local) free(accs);
    }
    return failed ? -1 : 0;
}

int hc_packed_matvec_multi(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                           const float *x, int64_t T, const float *norm_w, float eps, float *const *outs, int nth) {
    if (nmat < 1 || nmat > 8) return -1;
    int nf16 = 0;
    for (int m = 0; m < nmat; m++) {
        if (!packable(wts[m], D)) return -1;
        nf16 += wts[m] == WT_F16 || wts[m] == WT_BF16;
    }
    if (nf16) { /* the F16 matrices in their own pass (a group mixing them with block types: two passes) */
        const uint8_t *fP[8], *bP[8];
        int64_t fF[8], bF[8];
        float *fo[8], *bo[8];
        int bw[8], fw[8], nb = 0, nf = 0;
        for (int m = 0; m < nmat; m++) {
            if (wts[m] == WT_F16 || wts[m] == WT_BF16) fP[nf] = Ps[m], fF[nf] = Fs[m], fo[nf] = outs[m], fw[nf++] = wts[m];
            else bP[nb] = Ps[m], bF[nb] = Fs[m], bo[nb] = outs[m], bw[nb++] = wts[m];
        }
        float *xn = NULL;
        if (with_norm(&x, norm_w, eps, T, D, &xn) != 0) return -1;
        int rc = pkf_multi(nf, fw, fP, fF, D, x, T, fo, nth);
        if (rc == 0 && nb) rc = hc_packed_matvec_multi(nb, bw, bP, bF, D, x, T, NULL, 0.0f, bo, nth);
        free(xn);
        return rc;
    }
    int64_t first[9] = {0}, gbytes[8], ngs[8], total = 0;
    for (int m = 0; m < nmat; m++) total += (Fs[m] + PK_ROWS - 1) / PK_ROWS;
    /* groups per work item: about HC_PK_ITEMS items a thread (at least 4 groups, 32 rows). Long runs of
     * contiguous rows per item keep the hardware prefetchers' streams going (measured +5-8% over items of
     * 32 rows, 2 threads, DRAM-bound); several items a thread still even out a preempted thread. */
    const int64_t nt = nth > 0 ? nth : 1, per = total / (HC_PK_ITEMS * nt) > 4 ? total / (HC_PK_ITEMS * nt) : 4;
    for (int m = 0; m < nmat; m++) {
        gbytes[m] = hc_packed_nbytes(wts[m], PK_ROWS, D); /* one group */
        ngs[m] = (Fs[m] + PK_ROWS - 1) / PK_ROWS;
        first[m + 1] = first[m] + (ngs[m] + per - 1) / per;
    }
    const int64_t items = first[nmat], nc = D / 32;
    float *xn = NULL;
    if (with_norm(&x, norm_w, eps, T, D, &xn) != 0) return -1;
    hc_xq_set xq = {NULL, NULL};
    if (xq_make(x, T, D, &xq) != 0) {
        free(xn);
        return -1;
    }
    nth = clamp_threads(nth, items);
    int64_t next = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
    {
        for (int64_t it = claim(&next); it < items; it = claim(&next)) {
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int wt = wts[m];
            const int64_t F = Fs[m], ng = ngs[m], g0 = (it - first[m]) * per;
            for (int64_t g = g0; g < ng && g < g0 + per; g++)
                for (int64_t t = 0; t < T; t++) { /* the group stays in L1 for the other tokens */
                    float o[PK_ROWS];
                    const uint8_t *Pg = Ps[m] + g * gbytes[m];
                    if (wt == WT_Q4_0 || wt == WT_Q8_0) packed_group_block(wt, Pg, xq.tok + t, nc, o);
                    else if (wt == WT_Q4_K) packed_group_q4_k(Pg, xq.tok + t, nc, o);
                    else packed_group_q6_k(Pg, xq.tok + t, nc, o);
                    const int64_t n = F - g * PK_ROWS < PK_ROWS ? F - g * PK_ROWS : PK_ROWS;
                    memcpy(outs[m] + t * F + g * PK_ROWS, o, sizeof(float) * (size_t)n);
                }
        }
    }
    xq_free(&xq);
    free(xn);
    return 0;
}

/* out [T, F] = x [T, D] @ W.T from W's packed copy P: hc_packed_matvec_multi of one matrix. */
int hc_packed_matvec(int wt, const uint8_t *P, int64_t F, int64_t D, const float *x, int64_t T, float *out,
                     int nth) {
    const uint8_t *Ps[1] = {P};
    float *outs[1] = {out};
    return hc_packed_matvec_multi(1, &wt, Ps, &F, D, x, T, NULL, 0.0f, outs, nth);
}

/* ------------------------------------------------------------------------------------------------
 * One sparse FFN step of a ReLU model, for a few tokens: the predictor, the row gathers, the
 * activation and the axpy in one call, so no interpreter work (and no cache-cold glue) runs in
 * between. It is built from the kernels above, so its results equal theirs bit for bit.
 * ---------------------------------------------------------------------------------------------- */
typedef struct {
    int wt;
    const uint8_t *data; /* row i at data + i * stride */
    int64_t stride, rows, cols;
    const uint8_t *packed; /* the packed GEMV copy (hc_pack) or NULL */
} hc_weight;

/* out [T, rows] = x @ W.T over every row: the packed GEMV where W has a packed copy (the predictor's
 * matrices, always multiplied whole), else the row kernel; each as a matmul call would choose. */
static int weight_matvec(const hc_weight *w, const float *x, int64_t T, float *out, int nth) {
    if (w->packed) return hc_packed_matvec(w->wt, w->packed, w->rows, w->cols, x, T, out, nth);
    return hc_gather_matvec(w->wt, w->data, w->stride, w->rows, w->cols, x, T, NULL, out, nth);
}

enum { KIND_GATED = 0, KIND_GATED_BOTH = 1, KIND_PLAIN = 2 };

HC_INLINE float relu1(float v) { return v < 0.0f ? 0.0f : v; } /* NaN stays NaN, as torch.relu */

/* mask [T, F] (bytes 0/1): computed by the predictor when fc1 is not NULL (fire iff
 * (fc2 @ relu(fc1 @ p))[i] >= thr), else given. With v = up (+ up_bias), a = relu(gate) * v (gated),
 * relu(gate) * relu(v) (gated_both) or relu(v) (plain) on the firing rows, 0 elsewhere (up is read
 * only where relu(gate) != 0, as SparseFFN does); with norm_w the FFN input is hc_rms_norm(x); out [T, D] = the axpy of
 * a over down_t. gate may be NULL for plain. Returns the number of firing (token, neuron) pairs, or
 * -1 if memory ran out. */
int64_t hc_sparse_ffn(const hc_weight *fc1, const hc_weight *fc2, float thr, const float *p, const hc_weight *up,
                      const hc_weight *gate, const hc_weight *down_t, const float *up_bias, int kind, int64_t T,
                      const float *x, const float *norm_w, float eps, uint8_t *mask, float *out, int nth) {
    const int64_t F = up->rows, D = up->cols;
    /* the passes over [T, F] run in parallel for a prompt chunk (serial they were ~2% of a 52-token step) */
    const int pth = T * F < (1 << 16) ? 1 : nth;
    (void)pth; /* unused without OpenMP */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(T * F * (gate ? 2 : 1) + (norm_w ? T * D : 0)));
    if (!buf) return -1;
    float *u = buf, *g = gate ? buf + T * F : NULL;
    if (norm_w) { /* the FFN input is the normed x (the llama family's FFN norm, saving a call) */
        float *xn = buf + T * F * (gate ? 2 : 1);
        hc_rms_norm(x, norm_w, eps, T, D, xn);
        x = xn;
    }
    if (fc1) {
        const int64_t R = fc1->rows;
        float *h = (float *)malloc(sizeof(float) * (size_t)(T * R));
        int rc = h ? weight_matvec(fc1, p, T, h, nth) : -1;
        if (rc == 0) {
            for (int64_t j = 0; j < T * R; j++) h[j] = relu1(h[j]);
            rc = weight_matvec(fc2, h, T, u, nth); /* logits */
        }
        free(h);
        if (rc != 0) {
            free(buf);
            return -1;
        }
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static)
#endif
        for (int64_t j = 0; j < T * F; j++) mask[j] = u[j] >= thr;
    }
    int64_t fired = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static) reduction(+ : fired)
#endif
    for (int64_t j = 0; j < T * F; j++) fired += mask[j] != 0;
    /* Gate first: where relu(gate) is 0 the activation is 0 whatever up is, so up is read only for
     * the rows still alive (the predictor's false positives cost one row, not two). */
    uint8_t *live = mask;
    int rc = 0;
    hc_xq_set xq = {NULL, NULL}; /* block gate / up: x quantized once for both */
    if ((wt_is_block(up->wt) || (gate && wt_is_block(gate->wt))) && xq_make(x, T, D, &xq) != 0) rc = -1;
    if (gate && rc == 0) {
        live = (uint8_t *)malloc((size_t)(T * F > 0 ? T * F : 1));
        rc = live ? gather_matvec_xq(gate->wt, gate->data, gate->stride, F, D, x, T, mask, g, nth, xq.tok) : -1;
        if (rc == 0) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static)
#endif
            for (int64_t j = 0; j < T * F; j++) live[j] = mask[j] && relu1(g[j]) != 0.0f; /* NaN stays alive */
        }
    }
    if (rc == 0) rc = gather_matvec_xq(up->wt, up->data, up->stride, F, D, x, T, live, u, nth, xq.tok);
    xq_free(&xq);
    if (rc == 0) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static)
#endif
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < F; i++) {
                const int64_t j = t * F + i;
                if (!live[j]) continue; /* u[j] is already exactly 0 */
                const float v = up_bias ? u[j] + up_bias[i] : u[j];
                if (kind == KIND_GATED) u[j] = relu1(g[j]) * v;
                else if (kind == KIND_GATED_BOTH) u[j] = relu1(g[j]) * relu1(v);
                else u[j] = relu1(v);
            }
        rc = hc_sparse_axpy(down_t->wt, down_t->data, down_t->stride, F, D, u, T, live, out, nth);
    }
    if (live && live != mask) free(live);
    free(buf);
    return rc == 0 ? fired : -1;
}

/* A decode tail's first step: o = attn @ wo.T into a new buffer [T, D] (the caller frees it; the FFN's output
 * goes there next), y1 = x + o. NULL if memory ran out. */
static float *o_residual(const hc_weight *wo, const float *attn, const float *x, int64_t T, float *y1, int nth) {
    const int64_t D = wo->rows;
    float *o = (float *)malloc(sizeof(float) * (size_t)(T * D > 0 ? T * D : 1));
    if (!o || weight_matvec(wo, attn, T, o, nth) != 0) {
        free(o);
        return NULL;
    }
    for (int64_t j = 0; j < T * D; j++) y1[j] = x[j] + o[j];
    return o;
}

/* The rest of a decode layer after attention, for T tokens (rows of x): y1 = x + attn @ wo.T (the
 * residual after attention, also the predictor's input), then y2 = y1 + hc_sparse_ffn(y1, p = y1, the
 * RMS norm folded): two float adds and the same calls as op by op, so the same bits, without the
 * interpreter between them. y1, y2 [T, D]; mask [T, F]. Returns hc_sparse_ffn's firing count, or -1
 * if memory ran out. */
int64_t hc_decode_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *fc1,
                       const hc_weight *fc2, float thr, const hc_weight *up, const hc_weight *gate,
                       const hc_weight *down_t, const float *up_bias, int kind, int64_t T, const float *norm_w,
                       float eps, uint8_t *mask, float *y1, float *y2, int nth) {
    const int64_t D = wo->rows;
    float *o = o_residual(wo, attn, x, T, y1, nth);
    if (!o) return -1;
    const int64_t fired =
        hc_sparse_ffn(fc1, fc2, thr, y1, up, gate, down_t, up_bias, kind, T, y1, norm_w, eps, mask, o, nth);
    if (fired >= 0)
        for (int64_t j = 0; j < T * D; j++) y2[j] = y1[j] + o[j];
    free(o);
    return fired;
}

int hc_attn_decode_rows(int64_t N, float *q, float *k, const float *v, float *const *kcs, float *const *vcs,
                        const int64_t *pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                        const float *sin, int neox, int64_t window, float *out, int nth);

/* ------------------------------------------------------------------------------------------------
 * The dense FFN's activations, and a dense decode layer's tail in one call.
 * ---------------------------------------------------------------------------------------------- */

/* e^a in float32 without fused multiply-adds, so the compiler's vectorized loop and its scalar
 * remainder give the same bits (-ffp-contract=off): Cephes' expf (round a / ln 2 to n, subtract n ln 2
 * in two parts, a degree-6 polynomial, scale by 2^n), within about 1 ulp. Above 88.376 (where 2^n
 * would pass 2^127) +inf; below -87.34 the result is that of -87.34 (~1.2e-38: added to 1 in the SiLU
 * below it vanishes as e^a itself would). NaN stays NaN. */
HC_INLINE float exp_nofma(float a) {
    const float hi = 88.3762626647949f, lo = -87.3365447505531f;
    const int over = a > hi;
    a = a > hi ? hi : a < lo ? lo : a; /* comparisons with NaN are false: NaN passes */
    const float shift = 12582912.0f;      /* 1.5 * 2^23: adding it rounds to an integer (ties to even) */
    const float n = (a * 1.44269504088896341f + shift) - shift;
    float r = a - n * 0.693359375f; /* exact: 0.693359375 has 9 significant bits, |n| <= 128 */
    r = r - n * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, 4);
    return over ? INFINITY : y * scale;
}

/* SiLU as torch writes it, x / (1 + e^-x), with exp_nofma: torch's own exp differs between its SIMD
 * builds, so the CPU paths (this kernel, the decode tail, any batch) use this one function. */
HC_INLINE float silu1(float x) { return x / (1.0f + exp_nofma(-x)); }

/* GELU as torch's default (erf) form writes it, x * 0.5 * (1 + erf(x / sqrt(2))); the one GELU of every CPU path. */
HC_INLINE float gelu1(float x) { return x * 0.5f * (1.0f + erff(x * 0.70710678118654752f)); }

HC_INLINE float act1(int act, float v) { return act == 2 ? gelu1(v) : act ? silu1(v) : relu1(v); }

enum { ACT_RELU = 0, ACT_SILU = 1, ACT_GELU = 2 };

/* a [T, F] = the FFN activation of u [T, F] (plus up_bias [F] if given) and g [T, F] (NULL for plain):
 * gated act(g) * v, gated_both act(g) * act(v), plain act(v); act 0 relu, 1 silu, 2 gelu. torch's steps in its
 * order (bias add, activation, product), so with relu the bits of torch's ops. a may be u. */
void hc_ffn_combine(int kind, int act, const float *u, const float *g, const float *up_bias, int64_t T, int64_t F,
                    float *a, int nth) {
    const int64_t n = T * F;
    nth = n < (1 << 16) ? 1 : nth; /* one decode token: threads cost more than they save */
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *ut = u + t * F, *gt = g ? g + t * F : NULL;
        float *at = a + t * F;
        if (kind == KIND_PLAIN) {
            for (int64_t i = 0; i < F; i++) at[i] = act1(act, up_bias ? ut[i] + up_bias[i] : ut[i]);
        } else if (kind == KIND_GATED_BOTH) {
            for (int64_t i = 0; i < F; i++) at[i] = act1(act, gt[i]) * act1(act, up_bias ? ut[i] + up_bias[i] : ut[i]);
        } else {
            for (int64_t i = 0; i < F; i++) at[i] = act1(act, gt[i]) * (up_bias ? ut[i] + up_bias[i] : ut[i]);
        }
    }
}

/* The rest of a dense decode layer after attention, for T tokens: y1 = x + attn @ wo.T, h = rms_norm(y1),
 * u, g = h @ up.T, h @ gate.T (one pass of the threads where both are packed or neither is, as a
 * LinearGroup makes it), a = hc_ffn_combine, y2 = y1 + a @ down.T (down [D, F]) or the axpy of a over
 * down_t [F, D] (down_is_t). The same calls as the layer's ops one by one, so the same bits. Returns 0,
 * or -1 if memory ran out. */
/* A dense FFN of h [T, D] into out [T, D]: u, g = h @ up.T, h @ gate.T (one pass of the threads where both are
 * packed or neither is, as a LinearGroup makes it), a = hc_ffn_combine, out = a @ down.T (down [D, F]) or the axpy
 * of a over down_t [F, D] (down_is_t), without a down bias. Returns 0, or -1 if memory ran out. */
static int dense_ffn(const hc_weight *up, const hc_weight *gate, const hc_weight *down, int down_is_t,
                     const float *up_bias, int kind, int act, int64_t T, const float *h, float *out, int nth) {
    const int64_t D = up->cols, F = up->rows;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * T * F + 1));
    if (!buf) return -1;
    float *u = buf, *g = buf + T * F;
    int rc;
    if (gate && !up->packed == !gate->packed) {
        const int wts[2] = {up->wt, gate->wt};
        const int64_t Fs[2] = {F, gate->rows}, strides[2] = {up->stride, gate->stride};
        float *outs[2] = {u, g};
        if (up->packed) {
            const uint8_t *Ps[2] = {up->packed, gate->packed};
            rc = hc_packed_matvec_multi(2, wts, Ps, Fs, D, h, T, NULL, 0.0f, outs, nth);
        } else {
            const uint8_t *Ws[2] = {up->data, gate->data};
            rc = hc_matvec_multi(2, wts, Ws, strides, Fs, D, h, T, NULL, 0.0f, outs, nth);
        }
    } else {
        rc = weight_matvec(up, h, T, u, nth);
        if (rc == 0 && gate) rc = weight_matvec(gate, h, T, g, nth);
    }
    if (rc == 0) {
        hc_ffn_combine(kind, act, u, gate ? g : NULL, up_bias, T, F, u, nth);
        rc = down_is_t ? hc_sparse_axpy(down->wt, down->data, down->stride, F, D, u, T, NULL, out, nth)
                       : weight_matvec(down, u, T, out, nth);
    }
    free(buf);
    return rc == 0 ? 0 : -1;
}

/* The rest of a dense decode layer after attention, for T tokens: y1 = x + attn @ wo.T, h = rms_norm(y1), then
 * y2 = y1 + dense_ffn(h). The same calls as the layer's ops one by one, so the same bits. Returns 0, or -1 if
 * memory ran out. */
int hc_dense_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *up, const hc_weight *gate,
                  const hc_weight *down, int down_is_t, const float *up_bias, int kind, int act, int64_t T,
                  const float *norm_w, float eps, float *y1, float *y2, int nth) {
    const int64_t D = wo->rows;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * T * D + 1));
    if (!buf) return -1;
    float *o = buf, *h = buf + T * D;
    int rc = weight_matvec(wo, attn, T, o, nth);
    if (rc == 0) {
        for (int64_t j = 0; j < T * D; j++) y1[j] = x[j] + o[j];
        hc_rms_norm(y1, norm_w, eps, T, D, h);
        rc = dense_ffn(up, gate, down, down_is_t, up_bias, kind, act, T, h, o, nth);
    }
    if (rc == 0)
        for (int64_t j = 0; j < T * D; j++) y2[j] = y1[j] + o[j];
    free(buf);
    return rc == 0 ? 0 : -1;
}


/* ------------------------------------------------------------------------------------------------
 * The thresholded SwiGLU FFN of `hotcold sparsify` files (sparse/thresholded.py) in one call: the
 * score matvec, the per-token kept rows, their gate and up, the activation and the axpy, without the
 * interpreter between them. Built from the kernels above, so its results equal theirs bit for bit.
 * ---------------------------------------------------------------------------------------------- */

/* Input sparsity of one product (TEAL; WINA with scale): out [T, Fo] = x' @ W.T where x' is x with each
 * token's input channels i kept iff |x[t, i]| (times scale[i] if scale) > thr, all in float32 as torch
 * computes it, the others 0: the axpy over w_t [Din, Fo] (row i = input channel i's output direction) of
 * the kept channels. mask [T, Din] receives them. Returns 0, or -1 if memory ran out. */
int hc_input_sparse_matvec(const hc_weight *w_t, const float *scale, float thr, const float *x, int64_t T,
                           uint8_t *mask, float *out, int nth) {
    const int64_t Din = w_t->rows;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < Din; i++) {
            const float a = fabsf(x[t * Din + i]);
            mask[t * Din + i] = (scale ? a * scale[i] : a) > thr; /* NaN: not kept */
        }
    return hc_sparse_axpy(w_t->wt, w_t->data, w_t->stride, Din, w_t->cols, x, T, mask, out, nth);
}

/* The input rule of an input-sparse score (sparsify --gate-probe inputs): channel i of a token's FFN input
 * is kept iff |h_i| (times scale[i] if scale) > thr. */
typedef struct {
    const float *scale;
    float thr;
} hc_in_rule;

/* With norm_w the FFN input is h = hc_rms_norm(x), else x. s [T, F] = h @ score.T over every row (the
 * gate probe, or the gate itself when gate is NULL: weight_matvec, as the matmul of few tokens; with
 * score_in, score is gate_t [D, F] and s the gate of the kept input channels: hc_input_sparse_matvec); neuron i
 * of token t is kept (mask[t, i] = 1) iff |silu(s)| (times scale[i] if scale) > thr, all in float32 as
 * torch computes it. On the kept rows only: the exact gate (gate not NULL; else silu(s) is the activation)
 * and up (row gathers in one parallel pass, x quantized once for both), a = silu(gate) * up, 0 elsewhere,
 * and out [T, D] = the axpy of a over down_t. Returns the number of kept (token, neuron) pairs, or -1 if
 * memory ran out. */
int64_t hc_thresholded_ffn(const hc_weight *score, const hc_in_rule *score_in, const float *scale, float thr,
                           const hc_weight *up, const hc_weight *gate, const hc_weight *down_t, int64_t T,
                           const float *x, const float *norm_w, float eps, uint8_t *mask, float *out, int nth) {
    const int64_t F = up->rows, D = up->cols;
    const int pth = T * F < (1 << 16) ? 1 : nth; /* a prompt chunk's passes over [T, F] on the step's threads */
    (void)pth; /* unused without OpenMP */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * T * F + (norm_w ? T * D : 0) + 1));
    if (!buf) return -1;
    float *act = buf, *u = buf + T * F;
    if (norm_w) {
        float *xn = u + T * F;
        hc_rms_norm(x, norm_w, eps, T, D, xn);
        x = xn;
    }
    int rc;
    if (score_in) { /* the gate over each token's kept input channels: score is gate_t [D, F] */
        uint8_t *in_mask = (uint8_t *)malloc((size_t)(T * D));
        rc = in_mask ? hc_input_sparse_matvec(score, score_in->scale, score_in->thr, x, T, in_mask, act, nth) : -1;
        free(in_mask);
    } else {
        rc = weight_matvec(score, x, T, act, nth);
    }
    int64_t kept = 0;
    if (rc == 0) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static) reduction(+ : kept)
#endif
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < F; i++) {
                const int64_t j = t * F + i;
                act[j] = silu1(act[j]);
                const float a = fabsf(act[j]);
                mask[j] = (scale ? a * scale[i] : a) > thr; /* NaN: not kept, as torch's comparison */
                kept += mask[j];
            }
    }
    hc_xq_set xq = {NULL, NULL}; /* block gate / up: x quantized once for both */
    if (rc == 0 && (wt_is_block(up->wt) || (gate && wt_is_block(gate->wt))) && xq_make(x, T, D, &xq) != 0) rc = -1;
    if (rc == 0 && gate) { /* the exact gate of the kept rows replaces the probe's; up's rows in the same pass */
        const int wts[2] = {gate->wt, up->wt};
        const uint8_t *Ws[2] = {gate->data, up->data};
        const int64_t strides[2] = {gate->stride, up->stride};
        float *outs[2] = {act, u};
        rc = gather_masked_xq(2, wts, Ws, strides, F, D, x, T, mask, outs, nth, xq.tok);
        if (rc == 0) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static)
#endif
            for (int64_t j = 0; j < T * F; j++) act[j] = silu1(act[j]); /* silu(0) = 0 where not kept */
        }
    } else if (rc == 0) {
        rc = gather_matvec_xq(up->wt, up->data, up->stride, F, D, x, T, mask, u, nth, xq.tok);
    }
    xq_free(&xq);
    if (rc == 0) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(pth) schedule(static)
#endif
        for (int64_t j = 0; j < T * F; j++) u[j] = mask[j] ? act[j] * u[j] : 0.0f;
        rc = hc_sparse_axpy(down_t->wt, down_t->data, down_t->stride, F, D, u, T, mask, out, nth);
    }
    free(buf);
    return rc == 0 ? kept : -1;
}

/* The rest of a thresholded tail once y1 = x + o is made: y2 = y1 + hc_thresholded_ffn(y1, the RMS norm
 * folded), its output in o's buffer, which it frees. Returns the kept count, or -1 if memory ran out. */
static int64_t thresholded_after_o(float *o, const hc_weight *score, const hc_in_rule *score_in, const float *scale,
                                   float thr, const hc_weight *up, const hc_weight *gate, const hc_weight *down_t,
                                   int64_t T, const float *norm_w, float eps, uint8_t *mask, const float *y1,
                                   float *y2, int nth) {
    const int64_t D = up->cols;
    const int64_t kept =
        hc_thresholded_ffn(score, score_in, scale, thr, up, gate, down_t, T, y1, norm_w, eps, mask, o, nth);
    if (kept >= 0)
        for (int64_t j = 0; j < T * D; j++) y2[j] = y1[j] + o[j];
    free(o);
    return kept;
}

/* hc_decode_tail with the thresholded FFN: y1 = x + attn @ wo.T, y2 = y1 + hc_thresholded_ffn(y1, the RMS
 * norm folded). Returns its kept count, or -1 if memory ran out. */
int64_t hc_thresholded_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *score,
                            const hc_in_rule *score_in, const float *scale, float thr, const hc_weight *up,
                            const hc_weight *gate, const hc_weight *down_t, int64_t T, const float *norm_w,
                            float eps, uint8_t *mask, float *y1, float *y2, int nth) {
    float *o = o_residual(wo, attn, x, T, y1, nth);
    return o ? thresholded_after_o(o, score, score_in, scale, thr, up, gate, down_t, T, norm_w, eps, mask, y1, y2,
                                   nth)
             : -1;
}

/* hc_decode_head (below) for N rows x [N, D], one decode token of each of N sequences: the q/k/v group over the rows,
 * then RoPE attention over each row's own caches kcs[j] / vcs[j] at pos[j] (cos / sin [N, R/2]). */
static int decode_head_rows(int64_t N, const int *wts, const uint8_t *const *Ws, const int64_t *strides,
                            const int64_t *Fs, int packed, int64_t D, const float *x, const float *norm_w, float eps,
                            float *const *qkv, const float *const *bias, float *const *kcs, float *const *vcs,
                            const int64_t *pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                            const float *sin, int neox, int64_t window, float *out, int nth) {
    const int rc = packed ? hc_packed_matvec_multi(3, wts, Ws, Fs, D, x, N, norm_w, eps, qkv, nth)
                          : hc_matvec_multi(3, wts, Ws, strides, Fs, D, x, N, norm_w, eps, qkv, nth);
    if (rc != 0) return rc;
    for (int m = 0; m < 3 && bias; m++) /* q/k/v biases (opt), added as the layer's ops add them */
        if (bias[m])
            for (int64_t j = 0; j < N; j++)
                for (int64_t i = 0; i < Fs[m]; i++) qkv[m][j * Fs[m] + i] += bias[m][i];
    return hc_attn_decode_rows(N, qkv[0], qkv[1], qkv[2], kcs, vcs, pos, H, Hkv, Dh, R, cos, sin, neox, window, out,
                               nth);
}

/* The attention half of a decode layer for one token of one sequence: q, k, v = the group's matvecs of
 * the RMS-normed x (the packed or the row layout: the call LinearGroup makes), then hc_attn_decode_rows of
 * that one row; qkv [3] are the caller's buffers (q and k are left rotated, as op by op). The same calls,
 * so the same bits, without the interpreter between them. Returns 0, or -1 (memory, or no packed form). */
int hc_decode_head(int nmat, const int *wts, const uint8_t *const *Ws, const int64_t *strides, const int64_t *Fs,
                   int packed, int64_t D, const float *x, const float *norm_w, float eps, float *const *qkv,
                   float *kc, float *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                   const float *sin, int neox, int64_t window, float *out, int nth) {
    if (nmat != 3) return -1;
    float *kcs[1] = {kc}, *vcs[1] = {vc};
    return decode_head_rows(1, wts, Ws, strides, Fs, packed, D, x, norm_w, eps, qkv, NULL, kcs, vcs, &pos, H, Hkv, Dh,
                            R, cos, sin, neox, window, out, nth);
}

/* One layer of a llama-family decode token, for hc_decode_step: the arguments of its hc_decode_head
 * call (q/k/v group, attention norm, the sequence's KV cache of this layer, RoPE) and of its tail
 * (hc_decode_tail with a predictor, or hc_dense_tail). Keep in step with build.HCLayer. */
typedef struct {
    int wts[3];
    const uint8_t *Ws[3];
    int64_t strides[3], Fs[3];
    int packed;
    const float *attn_norm;
    float attn_eps;
    float *kc, *vc;
    int64_t H, Hkv, Dh, R;
    int neox;
    int64_t window;
    const hc_weight *wo, *fc1, *fc2, *up, *gate, *down;
    float thr;
    int sparse;    /* 1: hc_decode_tail (fc1, fc2, thr, down = down_t), 2: hc_thresholded_tail (score, scale,
                      thr, gate NULL or the exact gate, down = down_t), 0: hc_dense_tail */
    int down_is_t; /* dense tail: down is down_t [F, D] */
    const float *up_bias;
    int kind, act;
    const float *ffn_norm;
    float ffn_eps;
    const hc_weight *score; /* thresholded tail: the score matrix (probe or gate), per-neuron weights or NULL */
    const float *scale;
    /* thresholded layers with input-sparse attention (else NULL): q/k/v as hc_input_sparse_matvec over
     * qkv_t [D, q + k + v] of the normed x, o over wo_t [H * Dh, D] of the attention output */
    const hc_weight *qkv_t, *wo_t;
    const float *qkv_scale, *wo_scale;
    float qkv_thr, wo_thr;
    const hc_in_rule *score_in; /* thresholded tail: an input-sparse score (score is gate_t), or NULL */
    /* LayerNorm families, biases and a parallel residual (falcon, opt); 0 / NULL for llama layers */
    int attn_ln, ffn_ln;      /* the norm is a LayerNorm (bias attn_norm_b / ffn_norm_b, or NULL), not RMS */
    const float *attn_norm_b, *ffn_norm_b;
    const float *q_bias, *k_bias, *v_bias, *wo_bias, *down_bias; /* or NULL */
    int parallel;             /* the FFN reads the layer input x (x + attn + ffn), not the residual after attention */
    /* a mixture of experts (mixtral): the router [E, D] and each expert's FFN (kind, act, sparse and down_is_t as
     * above, up = expert 0's up); route_out [n_used]: this sequence's experts of its last decode token */
    const hc_weight *router;
    int64_t n_expert, n_used;
    const hc_weight *const *e_up, *const *e_gate, *const *e_down, *const *e_fc1, *const *e_fc2;
    const float *e_thr;
    int64_t *route_out;
} hc_layer;

/* Each of T rows of logits [T, E]: its K largest, largest first (ties: the lower expert first) -> ids [T, K], and
 * weights [T, K] = the softmax over those K logits (the C kernels' exp). The routing of every CPU path (MoEFFN.route
 * and the one-call decode), so a row's experts and weights never depend on its path. */
void hc_moe_route(const float *logits, int64_t T, int64_t E, int64_t K, int64_t *ids, float *weights) {
    for (int64_t t = 0; t < T; t++) {
        const float *lt = logits + t * E;
        int64_t *it = ids + t * K;
        float *wt = weights + t * K;
        for (int64_t s = 0; s < K; s++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t u = 0; u < s; u++) taken |= it[u] == e;
                if (!taken && (best < 0 || lt[e] > lt[best] || (isnan(lt[e]) && !isnan(lt[best])))) best = e;
            }
            it[s] = best;
        }
        const float m = lt[it[0]];
        float sum = 0.0f;
        for (int64_t s = 0; s < K; s++) sum += (wt[s] = exp_nofma(lt[it[s]] - m));
        for (int64_t s = 0; s < K; s++) wt[s] /= sum;
    }
}

/* The tail of a mixture-of-experts layer: y1 = x + attn @ wo.T, h = rms_norm(y1), the experts of each row
 * (hc_moe_route over h @ router.T); then expert by expert, in ascending order, its FFN of the rows routed to it (h's
 * rows; a sparse expert predicts from y1's), each row's output times its weight added to that row's sum (from 0);
 * y2 = y1 + sum: MoEFFN's ops one by one. fired_rows[j]: row j's computed neurons over its experts; route_out[j]:
 * row j's experts. Returns 0, or -1 if memory ran out. */
static int moe_tail(const hc_layer *a, const float *attn, const float *x, int64_t N, int64_t D,
                    int64_t *const *route_out, int64_t *fired_rows, uint8_t *mask, float *y1, float *y2, int nth) {
    const int64_t E = a->n_expert, K = a->n_used, F = a->e_up[0]->rows;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(5 * N * D + N * E + N * K + 1));
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * N * K + 1));
    if (!buf || !ids) {
        free(buf);
        free(ids);
        return -1;
    }
    float *o = buf, *h = o + N * D, *hs = h + N * D, *ps = hs + N * D, *ys = ps + N * D, *logits = ys + N * D,
          *wts = logits + N * E;
    int64_t *rows = ids + N * K, *slots = rows + N * K;
    int rc = weight_matvec(a->wo, attn, N, o, nth);
    if (rc == 0) {
        for (int64_t j = 0; j < N * D; j++) y1[j] = x[j] + o[j];
        hc_rms_norm(y1, a->ffn_norm, a->ffn_eps, N, D, h);
        rc = weight_matvec(a->router, h, N, logits, nth);
    }
    if (rc == 0) {
        hc_moe_route(logits, N, E, K, ids, wts);
        memset(o, 0, sizeof(float) * (size_t)(N * D));
        for (int64_t j = 0; j < N; j++) fired_rows[j] = 0;
    }
    for (int64_t e = 0; e < E && rc == 0; e++) {
        int64_t te = 0;
        for (int64_t r = 0; r < N; r++)
            for (int64_t s = 0; s < K; s++)
                if (ids[r * K + s] == e) rows[te] = r, slots[te++] = s;
        if (te == 0) continue;
        for (int64_t u = 0; u < te; u++) {
            memcpy(hs + u * D, h + rows[u] * D, sizeof(float) * (size_t)D);
            memcpy(ps + u * D, y1 + rows[u] * D, sizeof(float) * (size_t)D);
        }
        if (a->sparse) {
            const int64_t got = hc_sparse_ffn(a->e_fc1[e], a->e_fc2[e], a->e_thr[e], ps, a->e_up[e], a->e_gate[e],
                                              a->e_down[e], NULL, a->kind, te, hs, NULL, 0.0f, mask, ys, nth);
            rc = got < 0 ? -1 : 0;
            for (int64_t u = 0; u < te && rc == 0; u++) {
                int64_t c = 0;
                for (int64_t i = 0; i < F; i++) c += mask[u * F + i] != 0;
                fired_rows[rows[u]] += c;
            }
        } else {
            rc = dense_ffn(a->e_up[e], a->e_gate[e], a->e_down[e], a->down_is_t, NULL, a->kind, a->act, te, hs, ys, nth);
            for (int64_t u = 0; u < te; u++) fired_rows[rows[u]] += F;
        }
        for (int64_t u = 0; u < te && rc == 0; u++) {
            const float w = wts[rows[u] * K + slots[u]];
            float *orow = o + rows[u] * D;
            const float *yrow = ys + u * D;
            for (int64_t i = 0; i < D; i++) orow[i] += yrow[i] * w;
        }
    }
    if (rc == 0) {
        for (int64_t j = 0; j < N * D; j++) y2[j] = y1[j] + o[j];
        for (int64_t r = 0; r < N; r++)
            if (route_out[r]) memcpy(route_out[r], ids + r * K, sizeof(int64_t) * (size_t)K);
    }
    free(buf);
    free(ids);
    return rc;
}

/* The tail of a layer with a LayerNorm, biases or a parallel residual: o = attn @ wo.T (+ wo_bias), y1 = x + o,
 * u = x (parallel) or y1, h = the FFN norm of u, f = the FFN of h (sparse: predicted from u) (+ down_bias), y2 =
 * y1 + f. The ops the layers run one by one (the norms of hc_layer_norm / hc_rms_norm), so the same bits. Returns
 * the sparse FFN's firing count (dense: 0), or -1 if memory ran out. */
static int64_t general_tail(const hc_layer *a, const float *attn, const float *x, int64_t N, int64_t D,
                            uint8_t *mask, float *y1, float *y2, int nth) {
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * N * D + 1));
    if (!buf) return -1;
    float *o = buf, *h = buf + N * D;
    int64_t got = -1;
    if (weight_matvec(a->wo, attn, N, o, nth) == 0) {
        for (int64_t t = 0; t < N; t++)
            for (int64_t i = 0; i < D; i++) {
                const float v = a->wo_bias ? o[t * D + i] + a->wo_bias[i] : o[t * D + i];
                y1[t * D + i] = x[t * D + i] + v;
            }
        const float *u = a->parallel ? x : y1;
        if (a->ffn_ln) hc_layer_norm(u, a->ffn_norm, a->ffn_norm_b, a->ffn_eps, N, D, h);
        else hc_rms_norm(u, a->ffn_norm, a->ffn_eps, N, D, h);
        if (a->sparse)
            got = hc_sparse_ffn(a->fc1, a->fc2, a->thr, u, a->up, a->gate, a->down, a->up_bias, a->kind, N, h, NULL,
                                0.0f, mask, o, nth);
        else
            got = dense_ffn(a->up, a->gate, a->down, a->down_is_t, a->up_bias, a->kind, a->act, N, h, o, nth) == 0 ? 0 : -1;
        if (got >= 0)
            for (int64_t t = 0; t < N; t++)
                for (int64_t i = 0; i < D; i++) {
                    const float f = a->down_bias ? o[t * D + i] + a->down_bias[i] : o[t * D + i];
                    y2[t * D + i] = y1[t * D + i] + f;
                }
    }
    free(buf);
    return got;
}

/* q/k/v of an input-sparse layer (hc_layer.qkv_t) for one token, then attention over the caches kc / vc as
 * hc_decode_head. */
static int input_sparse_head(const hc_layer *a, int64_t D, const float *x, int64_t pos, float *kc, float *vc,
                             const float *cos, const float *sin, float *xn, float *qkv, uint8_t *smask, float *out,
                             int nth) {
    hc_rms_norm(x, a->attn_norm, a->attn_eps, 1, D, xn);
    if (hc_input_sparse_matvec(a->qkv_t, a->qkv_scale, a->qkv_thr, xn, 1, smask, qkv, nth) != 0) return -1;
    float *kcs[1] = {kc}, *vcs[1] = {vc};
    return hc_attn_decode_rows(1, qkv, qkv + a->Fs[0], qkv + a->Fs[0] + a->Fs[1], kcs, vcs, &pos, a->H, a->Hkv,
                               a->Dh, a->R, cos, sin, a->neox, a->window, out, nth);
}

/* The tail of an input-sparse thresholded layer for one token: y1 = x + o (o over wo_t), y2 = y1 +
 * hc_thresholded_ffn(y1, the RMS norm folded). Returns its kept count, or -1 if memory ran out. */
static int64_t input_sparse_tail(const hc_layer *a, const float *attn, const float *x, int64_t D, uint8_t *smask,
                                 uint8_t *mask, float *y1, float *y2, int nth) {
    float *o = (float *)malloc(sizeof(float) * (size_t)D);
    if (!o || hc_input_sparse_matvec(a->wo_t, a->wo_scale, a->wo_thr, attn, 1, smask, o, nth) != 0) {
        free(o);
        return -1;
    }
    for (int64_t j = 0; j < D; j++) y1[j] = x[j] + o[j];
    return thresholded_after_o(o, a->score, a->score_in, a->scale, a->thr, a->up, a->gate, a->down, 1, a->ffn_norm,
                               a->ffn_eps, mask, y1, y2, nth);
}

/* A decode step through n layers: one token of each of N sequences (rows of x [N, D], the embeddings in, the last
 * layer's residuals out, in place). Sequence j's layers are Ls[j] (its own KV caches; the weights are the same in
 * every one, taken from Ls[0]), its row at position pos[j], cos / sin [N, R/2] the rows' RoPE. Per layer the calls
 * the layers make one by one: the q/k/v group over the rows with the attention norm folded (hc_decode_head's, for
 * one row), hc_attn_decode_rows over each row's own caches, then the tail over the rows (hc_decode_tail,
 * hc_dense_tail, or for one token the thresholded and input-sparse tails), so the same bits, without the
 * interpreter between them. fired[j][l]: row j's firing neurons in layer l (dense: the layer's width). Returns 0,
 * -1 (memory, or a call that failed: x is then undefined), or -2 (nothing computed) for several rows over a layer
 * with a one-token tail (thresholded or input-sparse). */
int hc_decode_step(int n, int64_t N, const hc_layer *const *Ls, float *x, int64_t D, const int64_t *pos,
                   const float *cos, const float *sin, int64_t *const *fired, int nth) {
    const hc_layer *L = Ls[0];
    int64_t qmax = 1, kvmax = 1, fmax = 1;
    for (int l = 0; l < n; l++) {
        if (N > 1 && (L[l].sparse == 2 || L[l].qkv_t)) return -2;
        qmax = L[l].Fs[0] > qmax ? L[l].Fs[0] : qmax;
        kvmax = L[l].Fs[1] > kvmax ? L[l].Fs[1] : kvmax;
        fmax = L[l].up->rows > fmax ? L[l].up->rows : fmax;
    }
    const int64_t smax = qmax > D ? qmax : D; /* an input-sparse product's input channels */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(N * (2 * qmax + 2 * kvmax + 3 * D) + smax));
    uint8_t *mask = (uint8_t *)malloc((size_t)(N * fmax + smax));
    float **caches = (float **)malloc(sizeof(float *) * (size_t)(2 * N)); /* a layer's caches, row by row */
    int rc = buf && mask && caches ? 0 : -1;
    float *q = buf, *k = q + N * qmax, *v = k + N * kvmax, *attn = v + N * kvmax, *y1 = attn + N * qmax,
          *y2 = y1 + N * D, *xn = y2 + N * D;
    uint8_t *smask = mask ? mask + N * fmax : NULL;
    for (int l = 0; l < n && rc == 0; l++) {
        const hc_layer *a = &L[l];
        float **kcs = caches, **vcs = caches + N;
        for (int64_t j = 0; j < N; j++) kcs[j] = Ls[j][l].kc, vcs[j] = Ls[j][l].vc;
        if (a->qkv_t) { /* q, k, v side by side in q's and k's buffers: q + k + v <= qmax + 2 * kvmax */
            rc = input_sparse_head(a, D, x, pos[0], kcs[0], vcs[0], cos, sin, xn, q, smask, attn, nth);
        } else {
            float *const qkv[3] = {q, k, v};
            const float *const bias[3] = {a->q_bias, a->k_bias, a->v_bias};
            const float *xin = x, *norm_w = a->attn_norm; /* RMS: folded into the q/k/v call */
            if (a->attn_ln) { /* a LayerNorm first, as the layers norm before their q/k/v group */
                hc_layer_norm(x, a->attn_norm, a->attn_norm_b, a->attn_eps, N, D, xn);
                xin = xn, norm_w = NULL;
            }
            rc = decode_head_rows(N, a->wts, a->Ws, a->strides, a->Fs, a->packed, D, xin, norm_w, a->attn_eps, qkv,
                                  bias, kcs, vcs, pos, a->H, a->Hkv, a->Dh, a->R, cos, sin, a->neox, a->window, attn,
                                  nth);
        }
        if (rc != 0) break;
        const int64_t F = a->up->rows;
        int64_t got = 0;
        if (a->sparse == 2 && a->wo_t) {
            got = fired[0][l] = input_sparse_tail(a, attn, x, D, smask, mask, y1, y2, nth);
        } else if (a->sparse == 2) {
            got = fired[0][l] = hc_thresholded_tail(a->wo, attn, x, a->score, a->score_in, a->scale, a->thr, a->up,
                                                    a->gate, a->down, 1, a->ffn_norm, a->ffn_eps, mask, y1, y2, nth);
        } else if (a->router) {
            int64_t **routes = (int64_t **)caches; /* the row pointers are free again after attention */
            for (int64_t j = 0; j < N; j++) routes[j] = Ls[j][l].route_out;
            int64_t *rowfired = (int64_t *)(void *)q; /* q's buffer (N * qmax floats >= N int64 counts) is free too */
            got = moe_tail(a, attn, x, N, D, routes, rowfired, mask, y1, y2, nth);
            for (int64_t j = 0; j < N && got >= 0; j++) fired[j][l] = rowfired[j];
        } else if (a->attn_ln || a->ffn_ln || a->parallel || a->wo_bias || a->down_bias) {
            got = general_tail(a, attn, x, N, D, mask, y1, y2, nth);
            for (int64_t j = 0; j < N && got >= 0; j++) { /* each row its own count (dense: the layer's width) */
                int64_t c = a->sparse ? 0 : F;
                if (a->sparse && N == 1) c = got;
                else if (a->sparse)
                    for (int64_t i = 0; i < F; i++) c += mask[j * F + i] != 0;
                fired[j][l] = c;
            }
        } else if (a->sparse) {
            got = hc_decode_tail(a->wo, attn, x, a->fc1, a->fc2, a->thr, a->up, a->gate, a->down, a->up_bias, a->kind,
                                 N, a->ffn_norm, a->ffn_eps, mask, y1, y2, nth);
            for (int64_t j = 0; j < N && got >= 0; j++) { /* the kernel counts the batch; each row its own */
                int64_t c = 0;
                if (N == 1) c = got;
                else
                    for (int64_t i = 0; i < F; i++) c += mask[j * F + i] != 0;
                fired[j][l] = c;
            }
        } else {
            got = hc_dense_tail(a->wo, attn, x, a->up, a->gate, a->down, a->down_is_t, a->up_bias, a->kind, a->act, N,
                                a->ffn_norm, a->ffn_eps, y1, y2, nth) == 0 ? 0 : -1;
            for (int64_t j = 0; j < N; j++) fired[j][l] = F;
        }
        rc = got < 0 ? -1 : 0;
        if (rc == 0) memcpy(x, y2, sizeof(float) * (size_t)(N * D));
    }
    free(buf);
    free(mask);
    free(caches);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Decode-step glue on the CPU (one token, or one token of each sequence of a batch): RMS norm and
 * attention (RoPE, KV cache write, GQA softmax attention). One call each instead of a dozen small tensor ops that run cache-cold after
 * the weight streams.
 * ---------------------------------------------------------------------------------------------- */

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of D (double accumulation). */
void hc_rms_norm(const float *x, const float *w, float eps, int64_t T, int64_t D, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D;
        double ss = 0.0;
        for (int64_t j = 0; j < D; j++) ss += (double)xt[j] * xt[j];
        const float r = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
        for (int64_t j = 0; j < D; j++) out[t * D + j] = xt[j] * r * w[j];
    }
}

/* out[t] = (x[t] - mean) / sqrt(var + eps) * w (+ b), for T rows of D (double accumulation, biased variance):
 * a LayerNorm, the one of every CPU path for a few rows (ops.layer_norm). */
void hc_layer_norm(const float *x, const float *w, const float *b, float eps, int64_t T, int64_t D, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D;
        double s = 0.0, ss = 0.0;
        for (int64_t j = 0; j < D; j++) s += xt[j];
        const double mean = s / (double)D;
        for (int64_t j = 0; j < D; j++) ss += ((double)xt[j] - mean) * ((double)xt[j] - mean);
        const float r = (float)(1.0 / sqrt(ss / (double)D + (double)eps)), m = (float)mean;
        for (int64_t j = 0; j < D; j++) out[t * D + j] = b ? (xt[j] - m) * r * w[j] + b[j] : (xt[j] - m) * r * w[j];
    }
}

HC_INLINE float dot_f32(const float *a, const float *b, int64_t n) {
    vf acc0 = vzero(), acc1 = vzero();
    int64_t e = 0;
    for (; e + 2 * VL <= n; e += 2 * VL) {
        acc0 = vfma(vloadu(a + e), vloadu(b + e), acc0);
        acc1 = vfma(vloadu(a + e + VL), vloadu(b + e + VL), acc1);
    }
    for (; e + VL <= n; e += VL) acc0 = vfma(vloadu(a + e), vloadu(b + e), acc0);
    float d = vhsum(vadd(acc0, acc1));
    for (; e < n; e++) d = fmaf(a[e], b[e], d);
    return d;
}

/* RoPE on one head vector of Dh floats: the first R dims rotate, the rest pass through. Normal mode
 * rotates pairs (2j, 2j + 1) (GGUF llama, q/k permuted by the converter), neox pairs (j, j + R/2). */
HC_INLINE void rope_head(float *h, int64_t R, const float *cos, const float *sin, int neox) {
    for (int64_t j = 0; j < R / 2; j++) {
        const int64_t a = neox ? j : 2 * j, b = neox ? j + R / 2 : 2 * j + 1;
        const float x0 = h[a], x1 = h[b];
        h[a] = x0 * cos[j] - x1 * sin[j];
        h[b] = x0 * sin[j] + x1 * cos[j];
    }
}

/* Query head qh (rotated here) of one token over cache rows lo..lo+S-1 of its kv head: out oh [Dh] =
 * softmax(q k^T / sqrt(Dh)) v; s: S floats of scratch. */
#define ATTN_MAXV 8 /* head sizes up to 8 vectors (128 floats with AVX-512, 64 with AVX2) take the vector path */
#define ATTN_GROUP 8 /* query heads sharing a pass over their kv head's cache */
#define ATTN_VBLOCK 32 /* v rows a block (even) */
#if HC_ATTN_VEC
/* q . k in vector lanes (nv vectors), not yet summed across them. */
HC_INLINE vf attn_dot_lanes(const int nv, const vf *q, const float *kr) {
    vf a = vmul(q[0], vloadu(kr));
    for (int i = 1; i < nv; i++) a = vfma(q[i], vloadu(kr + i * VL), a);
    return a;
}

/* G query heads (G <= ATTN_GROUP) that read the same kv head, for Dh = nv * VL: each head's scores VL
 * positions at a time (each position's dot in vector lanes, VL dots summed across lanes together by
 * vsum_rows), its exponentials VL at a time (vexp), its weighted sum of v rows in two sets of vector
 * accumulators (even and odd positions). The heads share each block of k and v rows while it is in L1,
 * so the cache is read once for the group, not once a query head (GQA: 4-8 query heads a kv head).
 * Each head's arithmetic is its own: the same for any G. s: G * S floats, acc: G * 2 * Dh floats. */
HC_INLINE void attn_group_vec(const int nv, const int G, float *const *qs, const float *kc, const float *vc,
                              int64_t lo, int64_t S, int64_t Hkv, int64_t kvh, int64_t Dh, float scale, float *s,
                              float *acc, float *const *ohs) {
    const int64_t ks = Hkv * Dh;
    const float *k0 = kc + (lo * Hkv + kvh) * Dh, *v0 = vc + (lo * Hkv + kvh) * Dh;
    vf vmx[ATTN_GROUP];
    float inv[ATTN_GROUP];
    for (int g = 0; g < G; g++) vmx[g] = vset1(-INFINITY);
    int64_t j = 0;
    for (; j + VL <= S; j += VL)
        for (int g = 0; g < G; g++) {
            vf q[ATTN_MAXV], a[VL];
            for (int i = 0; i < nv; i++) q[i] = vloadu(qs[g] + i * VL);
            for (int p = 0; p < VL; p++) a[p] = attn_dot_lanes(nv, q, k0 + (j + p) * ks);
            const vf sc = vmul(vsum_rows(a), vset1(scale));
            vstoreu(s + g * S + j, sc);
            vmx[g] = vmaxv(sc, vmx[g]); /* a NaN score stays out of the max, as in the scalar comparisons */
        }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * S;
        vf q[ATTN_MAXV];
        for (int i = 0; i < nv; i++) q[i] = vloadu(qs[g] + i * VL);
        float mx = vhmax(vmx[g]);
        for (int64_t t = j; t < S; t++) {
            sg[t] = vhsum(attn_dot_lanes(nv, q, k0 + t * ks)) * scale;
            mx = sg[t] > mx ? sg[t] : mx;
        }
        const vf vm = vset1(mx);
        vf vs = vzero();
        int64_t t = 0;
        for (; t + VL <= S; t += VL) {
            const vf e = vexp(vsub(vloadu(sg + t), vm));
            vstoreu(sg + t, e);
            vs = vadd(vs, e);
        }
        float sum = vhsum(vs);
        for (; t < S; t++) {
            sg[t] = expf(sg[t] - mx);
            sum += sg[t];
        }
        inv[g] = 1.0f / sum;
    }
    for (int64_t i = 0; i < G * 2 * Dh; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < S; b += ATTN_VBLOCK) { /* a block of v rows, in L1 for every head of the group */
        const int64_t e = b + ATTN_VBLOCK < S ? b + ATTN_VBLOCK : S;
        for (int g = 0; g < G; g++) {
            const float *sg = s + g * S;
            float *a0 = acc + g * 2 * Dh, *a1 = a0 + Dh;
            vf o0[ATTN_MAXV], o1[ATTN_MAXV];
            for (int i = 0; i < nv; i++) o0[i] = vloadu(a0 + i * VL), o1[i] = vloadu(a1 + i * VL);
            int64_t t = b;
            for (; t + 2 <= e; t += 2) {
                const vf p0 = vset1(sg[t]), p1 = vset1(sg[t + 1]);
                const float *va = v0 + t * ks, *vb = va + ks;
                for (int i = 0; i < nv; i++) {
                    o0[i] = vfma(p0, vloadu(va + i * VL), o0[i]);
                    o1[i] = vfma(p1, vloadu(vb + i * VL), o1[i]);
                }
            }
            if (t < e) { /* only in the last block: ATTN_VBLOCK is even */
                const vf p0 = vset1(sg[t]);
                for (int i = 0; i < nv; i++) o0[i] = vfma(p0, vloadu(v0 + t * ks + i * VL), o0[i]);
            }
            for (int i = 0; i < nv; i++) vstoreu(a0 + i * VL, o0[i]), vstoreu(a1 + i * VL, o1[i]);
        }
    }
    for (int g = 0; g < G; g++) {
        const vf iv = vset1(inv[g]);
        const float *a0 = acc + g * 2 * Dh, *a1 = a0 + Dh;
        for (int i = 0; i < nv; i++) vstoreu(ohs[g] + i * VL, vmul(vadd(vloadu(a0 + i * VL), vloadu(a1 + i * VL)), iv));
    }
}
#endif

HC_INLINE void attn_head(float *qh, const float *kc, const float *vc, int64_t lo, int64_t S, int64_t Hkv, int64_t kvh,
                         int64_t Dh, int64_t R, const float *cos, const float *sin, int neox, float *s, float *oh) {
    const float scale = 1.0f / sqrtf((float)Dh);
    rope_head(qh, R, cos, sin, neox);
    float mx = -INFINITY;
    for (int64_t j = 0; j < S; j++) {
        const float *kr = kc + ((lo + j) * Hkv + kvh) * Dh;
        s[j] = dot_f32(qh, kr, Dh) * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < Dh; e++) oh[e] = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        const float *vr = vc + ((lo + j) * Hkv + kvh) * Dh;
        const float p = s[j] * inv;
        for (int64_t e = 0; e < Dh; e++) oh[e] += p * vr[e];
    }
}

/* N decode tokens, token n of its own sequence at position pos[n] (the rows of a batched decode step):
 * rotates q [N, H, Dh] and k [N, Hkv, Dh] in place, stores row n's k and v at row pos[n] of the float32
 * caches kcs[n] / vcs[n] ([n_ctx, Hkv, Dh] each), and writes out [N, H, Dh] = softmax(q k^T / sqrt(Dh)) v
 * over cache rows lo..pos[n] (lo = pos - window + 1 with a sliding window, else 0); query head h reads kv
 * head h / (H / Hkv); cos/sin [N, R/2]. (token, head) pairs are split among threads; each is computed as
 * for the token alone. Returns 0, or -1 if memory ran out. */
int hc_attn_decode_rows(int64_t N, float *q, float *k, const float *v, float *const *kcs, float *const *vcs,
                        const int64_t *pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                        const float *sin, int neox, int64_t window, float *out, int nth) {
    int64_t smax = 1, work = 0;
    for (int64_t n = 0; n < N; n++) {
        const int64_t R2 = R / 2;
        for (int64_t h = 0; h < Hkv; h++) rope_head(k + (n * Hkv + h) * Dh, R, cos + n * R2, sin + n * R2, neox);
        memcpy(kcs[n] + pos[n] * Hkv * Dh, k + n * Hkv * Dh, sizeof(float) * (size_t)(Hkv * Dh));
        memcpy(vcs[n] + pos[n] * Hkv * Dh, v + n * Hkv * Dh, sizeof(float) * (size_t)(Hkv * Dh));
        const int64_t lo = (window > 0 && pos[n] - window + 1 > 0) ? pos[n] - window + 1 : 0, S = pos[n] + 1 - lo;
        smax = S > smax ? S : smax;
        work += H * S * Dh;
    }
    const int64_t group = H / Hkv;
#if HC_ATTN_VEC
    /* work items: a token's query heads that share a kv head, ATTN_GROUP at most (the vector path), or
     * one query head (the scalar path); a head's result is the same in any item */
    const int vec = Dh % VL == 0 && Dh / VL <= ATTN_MAXV;
#else
    const int vec = 0;
#endif
    const int64_t per = vec ? (group < ATTN_GROUP ? group : ATTN_GROUP) : 1; /* heads an item */
    const int64_t subs = (group + per - 1) / per, items = N * Hkv * subs;
    nth = clamp_threads(nth, items);
    if (work < (1 << 15)) nth = 1; /* not worth waking a thread */
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(smax * per + 2 * per * Dh));
        failed = s == NULL;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            /* kv-head-major: the tokens of a head group in a row, so a prompt chunk's rows (one cache) find that
             * head's keys and values in cache from the previous row (token-major, a 32-head 7B chunk of 95 rows
             * at position 3000 read its 100 MB of keys and values from memory for every row: 3.2x SDPA's time) */
            const int64_t n = it % N, kvh = it / N / subs, h0 = kvh * group + it / N % subs * per;
            const int64_t lo = (window > 0 && pos[n] - window + 1 > 0) ? pos[n] - window + 1 : 0, S = pos[n] + 1 - lo;
            const float *cs = cos + n * (R / 2), *sn = sin + n * (R / 2);
            if (!vec) { /* one head */
                attn_head(q + (n * H + h0) * Dh, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, R, cs, sn, neox, s,
                          out + (n * H + h0) * Dh);
                continue;
            }
#if HC_ATTN_VEC
            const int64_t G = h0 + per <= (kvh + 1) * group ? per : (kvh + 1) * group - h0; /* the group's last item may be short */
            float *qs[ATTN_GROUP], *ohs[ATTN_GROUP];
            for (int64_t g = 0; g < G; g++) {
                qs[g] = q + (n * H + h0 + g) * Dh;
                ohs[g] = out + (n * H + h0 + g) * Dh;
                rope_head(qs[g], R, cs, sn, neox);
            }
            const float scale = 1.0f / sqrtf((float)Dh);
            float *acc = s + smax * per;
            switch (Dh / VL) { /* a constant vector count: q and the accumulators stay in registers */
            case 1: attn_group_vec(1, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, s, acc, ohs); break;
            case 2: attn_group_vec(2, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, s, acc, ohs); break;
            case 4: attn_group_vec(4, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, s, acc, ohs); break;
            case 8: attn_group_vec(8, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, s, acc, ohs); break;
            default: attn_group_vec((int)(Dh / VL), (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, s, acc, ohs);
            }
#endif
        }
        free(s);
    }
    return failed ? -1 : 0;
}

