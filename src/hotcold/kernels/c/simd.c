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
/* MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4): the block scale is then half the E8M0 power of two. */
static const int8_t MXFP4_KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Half the E8M0 scale byte's power of two, 2^(e - 128), as ggml's GGML_E8M0_TO_FP32_HALF: e < 2 gives
 * a subnormal float, the rest a normal one with exponent field e - 1 (exact either way). */
HC_INLINE float e8m0_half(const uint8_t e) { return f32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

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

/* MXFP4, 17 bytes: e (E8M0), qs[16] as Q4_0, each nibble an index into MXFP4's table. */
HC_INLINE void dec_mxfp4(const uint8_t *b, chunk_ints *ci) {
    both_halves(ci, e8m0_half(b[0]), 0.0f);
    for (int l = 0; l < 16; l++) {
        ci->q[l] = MXFP4_KVALUES[b[1 + l] & 15];
        ci->q[l + 16] = MXFP4_KVALUES[b[1 + l] >> 4];
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
        case WT_MXFP4: dec_mxfp4(row + c * 17, &ci); break;
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

