/* ------------------------------------------------------------------------------------------------
 * Dense GEMM over the packed copy (Q4_0, Q8_0, Q4_K, Q6_K): a prompt chunk's products. The GEMV above
 * walks a group's 8 rows once per token, unpacking its nibbles again for every token; here the tokens'
 * activations are quantized once per call into tiles of GM_T tokens ([chunk][token][32 bytes], the chunk
 * scales beside them), and a tile of GM_ROWS rows (two packed groups side by side in one 512-bit vector with
 * AVX-512 VNNI, one group in 256 bits otherwise) is unpacked once per chunk and multiplied into all GM_T
 * tokens: each 4-byte activation broadcast feeds one dpbusd of 16 rows x 4 values, the GM_T tokens' integer
 * sums and float accumulators sit in registers, and a row tile's bytes stay in L1 while every token tile
 * passes (Q6_K's 6-bit values are assembled once per row tile into a buffer that every token tile reads). Threads
 * take row tiles; each (row, token) is computed once, whole.
 *
 * Bits: the integer chunk sums are exact (dpbusd, or maddubs where no pair can saturate), and each row's
 * float accumulation is the GEMV's, step for step: the same scale products in the same order, one fma per
 * chunk (or half) in chunk order, the mins' chain beside it. So every output equals hc_packed_matvec's for
 * that row and token, bit for bit, whatever the thread count, the token count or a token's tile slot.
 * ---------------------------------------------------------------------------------------------- */
#ifndef HC_GEMM_MIN_T
#define HC_GEMM_MIN_T 8 /* tokens from which a packed product takes the GEMM */
#endif
#if HC_QSIMD
#ifndef GM_T
#define GM_T 8 /* tokens a tile: 2 x 8 accumulators + the unpacked weights fit the 32 (16) vector registers */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GM_ROWS 16 /* two packed groups: group a in the low 256 bits, group b in the high */
typedef __m512i gi;
typedef __m512 gf;
HC_INLINE gi gi_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(ld256(a)), ld256(b), 1);
}
#define gi_zero() _mm512_setzero_si512()
#define gi_load(p) _mm512_load_si512((const void *)(p))
#define gi_store(p, v) _mm512_store_si512((void *)(p), v)
#define gi_and(a, b) _mm512_and_si512(a, b)
#define gi_or(a, b) _mm512_or_si512(a, b)
#define gi_xor(a, b) _mm512_xor_si512(a, b)
#define gi_srli16(v, n) _mm512_srli_epi16(v, n)
#define gi_slli16(v, n) _mm512_slli_epi16(v, n)
#define gi_set1_8(v) _mm512_set1_epi8(v)
#define gi_set1_32(v) _mm512_set1_epi32(v)
#define gi_sub32(a, b) _mm512_sub_epi32(a, b)
#define gi_dot(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define gf_zero() _mm512_setzero_ps()
#define gf_set1(v) _mm512_set1_ps(v)
#define gf_mul(a, b) _mm512_mul_ps(a, b)
#define gf_sub(a, b) _mm512_sub_ps(a, b)
#define gf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define gf_cvt(i) _mm512_cvtepi32_ps(i)
#define gf_store(p, v) _mm512_storeu_ps(p, v)
/* the two groups' 8 fp16 scales, or 8 bytes each (unsigned, signed), as 16 floats */
HC_INLINE gf gf_f16pair(const uint8_t *a, const uint8_t *b) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)a), hi = _mm_loadu_si128((const __m128i *)b);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
HC_INLINE __m128i ld2x64(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}
HC_INLINE gf gf_u8pair(const uint8_t *a, const uint8_t *b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld2x64(a, b))); }
HC_INLINE gf gf_i8pair(const uint8_t *a, const uint8_t *b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld2x64(a, b))); }
#define GM_VNNI 1
#else
#define GM_ROWS 8 /* one packed group in 256 bits (b is a) */
typedef __m256i gi;
typedef __m256 gf;
#define gi_pair(a, b) ((void)(b), ld256(a))
#define gi_zero() _mm256_setzero_si256()
#define gi_load(p) _mm256_load_si256((const __m256i *)(p))
#define gi_store(p, v) _mm256_store_si256((__m256i *)(p), v)
#define gi_and(a, b) _mm256_and_si256(a, b)
#define gi_or(a, b) _mm256_or_si256(a, b)
#define gi_xor(a, b) _mm256_xor_si256(a, b)
#define gi_srli16(v, n) _mm256_srli_epi16(v, n)
#define gi_slli16(v, n) _mm256_slli_epi16(v, n)
#define gi_set1_8(v) _mm256_set1_epi8(v)
#define gi_set1_32(v) _mm256_set1_epi32(v)
#define gi_sub32(a, b) _mm256_sub_epi32(a, b)
#define gi_dot(acc, u, s) dot4_acc(acc, u, s)
#define gf_zero() _mm256_setzero_ps()
#define gf_set1(v) _mm256_set1_ps(v)
#define gf_mul(a, b) _mm256_mul_ps(a, b)
#define gf_sub(a, b) _mm256_sub_ps(a, b)
#define gf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define gf_cvt(i) _mm256_cvtepi32_ps(i)
#define gf_store(p, v) _mm256_storeu_ps(p, v)
#define gf_f16pair(a, b) ((void)(b), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a))))
#define gf_u8pair(a, b) ((void)(b), cvt8_u8(a))
#define gf_i8pair(a, b) ((void)(b), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(a)))))
#define GM_VNNI HC_VNNI
#endif

HC_INLINE gi gi_bc32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return gi_set1_32(v);
}
/* Nibble products (u <= 15): a chunk's 8 maddubs pairs per 16-bit lane stay under 8 * 2 * 15 * 127 = 30480,
 * so without VNNI they add up in 16 bits and widen once a chunk (the GEMV's sums, as it makes them). */
#if GM_VNNI
#define dot_nib(acc, u, s) gi_dot(acc, u, s)
#define fin_nib(acc) (acc)
#else
#define dot_nib(acc, u, s) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
#define fin_nib(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#endif

/* A call's activations: token t in tile t / GM_T, slot t % GM_T; per tile and chunk the GM_T tokens' 32
 * quantized values, then per-token scale (d), d times the chunk's sum (hc), the chunk's sum (qs) and its
 * halves' sums (qh: [2][GM_T]). Padding slots are zero and never stored. */
typedef struct {
    int8_t *q;
    float *d, *hc;
    int32_t *qs, *qh;
    void *mem;
} gm_x;

static int gm_x_alloc(gm_x *g, int64_t ntile, int64_t nc) {
    const size_t n = (size_t)(ntile * nc * GM_T);
    g->mem = calloc(n * (32 + 4 * 5) + 64, 1);
    if (!g->mem) return -1;
    g->q = (int8_t *)g->mem; /* 32-byte slots first: n * 32 bytes keeps the 4-byte arrays aligned */
    g->d = (float *)(g->q + n * 32), g->hc = g->d + n;
    g->qs = (int32_t *)(g->hc + n), g->qh = g->qs + n;
    return 0;
}

/* Token t (xt: its D floats) quantized into its slot: xq_make's arithmetic, value for value. */
static void gm_x_token(const float *xt, int64_t nc, gm_x *g, int64_t t) {
    const int64_t tile = t / GM_T, s = t % GM_T;
    for (int64_t c = 0; c < nc; c++) {
        const int64_t i = (tile * nc + c) * GM_T + s;
        int32_t ls[8];
        int nan;
        const float amax = XQ_CHUNK(xt + 32 * c, g->q + 32 * i, ls, &nan);
        const float dc = nan ? NAN : amax / 127.0f;
        const int32_t h0 = ls[0] + ls[1] + ls[2] + ls[3], h1 = ls[4] + ls[5] + ls[6] + ls[7];
        g->d[i] = dc;
        g->hc[i] = dc * (float)(h0 + h1);
        g->qs[i] = h0 + h1;
        g->qh[(tile * nc + c) * 2 * GM_T + s] = h0;
        g->qh[(tile * nc + c) * 2 * GM_T + GM_T + s] = h1;
    }
}

#define GM_VB ((int64_t)sizeof(gi)) /* bytes a vector */

/* A Q6_K row tile's values as dpbusd takes them (0..63), unpacked once per work item for all its token tiles (its
 * 6-bit values take 6 operations a vector to assemble: measured 1.3x the speed of unpacking per token tile): per
 * chunk 8 vectors, the first half's 4 parts, then the second's. U: nc * 8 * GM_VB bytes, 64-byte aligned. */
static void gm_unpack_q6_k(const uint8_t *Pa, const uint8_t *Pb, int64_t nc, uint8_t *U) {
    const gi m15 = gi_set1_8(15), m3 = gi_set1_8(3);
    for (int64_t c = 0; c < nc; c++) {
        uint8_t *u = U + c * 8 * GM_VB;
        const int64_t off = (c / 8) * PK_Q6_K_SUPER + 16 + (c % 8) * PK_Q6_K_CHUNK + 16;
        const uint8_t *ba = Pa + off, *bb = Pb + off;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                const gi p = gi_pair(ba + 32 * k, bb + 32 * k);
                const gi hb = gi_pair(ba + 128 + 32 * (k & 1), bb + 128 + 32 * (k & 1));
                const int sh = (k >> 1) * 4 + 2 * h;
                const gi lo = h ? gi_and(gi_srli16(p, 4), m15) : gi_and(p, m15);
                gi_store(u + (4 * h + k) * GM_VB, gi_or(lo, gi_slli16(gi_and(gi_srli16(hb, sh), m3), 4)));
            }
    }
}

/* The integer sums of a chunk's nibbles (a, b: its 4 x 32 packed bytes in groups a and b) with GM_T tokens (xc),
 * unpacked in registers (measured: faster than reading them unpacked, as Q6_K does): part k's low nibbles meet
 * values 4k..4k+3, its high ones 4k+16..4k+19. */
#define GM_NIB_SUMS(s, a, b, xc)                                                                                       \
    for (int t = 0; t < GM_T; t++) s[t] = gi_zero();                                                                   \
    for (int k = 0; k < 4; k++) {                                                                                      \
        const gi w = gi_pair((a) + 32 * k, (b) + 32 * k);                                                              \
        const gi lo = gi_and(w, m15), hi = gi_and(gi_srli16(w, 4), m15);                                               \
        for (int t = 0; t < GM_T; t++) {                                                                               \
            s[t] = dot_nib(s[t], lo, gi_bc32((xc) + 32 * t + 4 * k));                                                  \
            s[t] = dot_nib(s[t], hi, gi_bc32((xc) + 32 * t + 4 * k + 16));                                             \
        }                                                                                                              \
    }

/* The kernels: row groups a and b (Pa, Pb: their packed bytes; b = a where there is one group) times tile
 * `tile` of g -> o [GM_T][GM_ROWS]. */
HC_INLINE void gm_q4_k(const uint8_t *Pa, const uint8_t *Pb, const gm_x *g, int64_t tile, int64_t nc, float *o) {
    const int64_t base = tile * nc * GM_T;
    const gi m15 = gi_set1_8(15);
    gf acc[GM_T], macc[GM_T];
    for (int t = 0; t < GM_T; t++) acc[t] = gf_zero(), macc[t] = gf_zero();
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sa = Pa + sbi * PK_Q4_K_SUPER, *sb = Pb + sbi * PK_Q4_K_SUPER;
        const gf d = gf_f16pair(sa, sb);
        for (int j = 0; j < 8; j++) {
            const int64_t ci = base + (sbi * 8 + j) * GM_T;
            const uint8_t *ba = sa + 32 + j * (16 + 128), *bb = sb + 32 + j * (16 + 128);
            const int8_t *xc = g->q + 32 * ci;
            gi s[GM_T];
            GM_NIB_SUMS(s, ba + 16, bb + 16, xc);
            const gf ds = gf_mul(d, gf_u8pair(ba, bb));
            for (int t = 0; t < GM_T; t++) acc[t] = gf_fma(gf_cvt(fin_nib(s[t])), gf_mul(ds, gf_set1(g->d[ci + t])), acc[t]);
        }
    }
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) { /* the mins' chain: one fma a chunk, after the sums' */
        const uint8_t *sa = Pa + sbi * PK_Q4_K_SUPER, *sb = Pb + sbi * PK_Q4_K_SUPER;
        const gf dmin = gf_f16pair(sa + 16, sb + 16);
        for (int j = 0; j < 8; j++) {
            const int64_t ci = base + (sbi * 8 + j) * GM_T;
            const gf m = gf_mul(dmin, gf_u8pair(sa + 32 + j * (16 + 128) + 8, sb + 32 + j * (16 + 128) + 8));
            for (int t = 0; t < GM_T; t++) macc[t] = gf_fma(m, gf_set1(g->hc[ci + t]), macc[t]);
        }
    }
    for (int t = 0; t < GM_T; t++) gf_store(o + t * GM_ROWS, gf_sub(acc[t], macc[t]));
}

HC_INLINE void gm_q6_k(const uint8_t *Pa, const uint8_t *Pb, const uint8_t *U, const gm_x *g, int64_t tile, int64_t nc,
                       float *o) {
    const int64_t base = tile * nc * GM_T;
    gf acc[GM_T];
    for (int t = 0; t < GM_T; t++) acc[t] = gf_zero();
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sa = Pa + sbi * PK_Q6_K_SUPER, *sb = Pb + sbi * PK_Q6_K_SUPER;
        const gf d = gf_f16pair(sa, sb);
        for (int j = 0; j < 8; j++) {
            const int64_t ci = base + (sbi * 8 + j) * GM_T;
            const uint8_t *ba = sa + 16 + j * PK_Q6_K_CHUNK, *bb = sb + 16 + j * PK_Q6_K_CHUNK;
            const int8_t *xc = g->q + 32 * ci;
            const int32_t *qh = g->qh + 2 * ci;
            for (int h = 0; h < 2; h++) { /* the chunk's halves: values 0..15 (low nibbles), 16..31 (high) */
                gi s[GM_T];
                for (int t = 0; t < GM_T; t++) s[t] = gi_zero();
                for (int k = 0; k < 4; k++) {
                    const gi v = gi_load(U + ((sbi * 8 + j) * 8 + 4 * h + k) * GM_VB); /* 0..63 */
                    for (int t = 0; t < GM_T; t++) s[t] = gi_dot(s[t], v, gi_bc32(xc + 32 * t + 4 * k + 16 * h));
                }
                const gf dsc = gf_mul(d, gf_i8pair(ba + 8 * h, bb + 8 * h));
                for (int t = 0; t < GM_T; t++) {
                    const gi v = gi_sub32(s[t], gi_set1_32(32 * qh[h * GM_T + t]));
                    acc[t] = gf_fma(gf_cvt(v), gf_mul(dsc, gf_set1(g->d[ci + t])), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < GM_T; t++) gf_store(o + t * GM_ROWS, acc[t]);
}

/* Q4_0 (u - 8: the sum of u x minus 8 sum x) and Q8_0 (VNNI: w + 128 as unsigned, minus 128 sum x; without it
 * |w| times x with w's sign, as the GEMV), chunk by chunk. */
HC_INLINE void gm_block(const int wt, const uint8_t *Pa, const uint8_t *Pb, const gm_x *g, int64_t tile, int64_t nc,
                        float *o) {
    const int64_t base = tile * nc * GM_T, cb = wt == WT_Q4_0 ? PK_Q4_0_CHUNK : PK_Q8_0_CHUNK;
    const gi m15 = gi_set1_8(15);
    gf acc[GM_T];
    for (int t = 0; t < GM_T; t++) acc[t] = gf_zero();
    for (int64_t c = 0; c < nc; c++) {
        const int64_t ci = base + c * GM_T;
        const uint8_t *ba = Pa + c * cb, *bb = Pb + c * cb;
        const int8_t *xc = g->q + 32 * ci;
        gi s[GM_T];
        int shift;
        if (wt == WT_Q4_0) {
            shift = 3;
            GM_NIB_SUMS(s, ba + 16, bb + 16, xc);
            for (int t = 0; t < GM_T; t++) s[t] = fin_nib(s[t]);
        } else {
#if GM_VNNI
            shift = 7;
            for (int t = 0; t < GM_T; t++) s[t] = gi_zero();
            const gi bias = gi_set1_8((char)0x80);
            for (int k = 0; k < 8; k++) {
                const gi u = gi_xor(gi_pair(ba + 16 + 32 * k, bb + 16 + 32 * k), bias);
                for (int t = 0; t < GM_T; t++) s[t] = gi_dot(s[t], u, gi_bc32(xc + 32 * t + 4 * k));
            }
#else
            shift = -1;
            for (int t = 0; t < GM_T; t++) s[t] = gi_zero();
            for (int k = 0; k < 8; k++) {
                const gi w = gi_pair(ba + 16 + 32 * k, bb + 16 + 32 * k), u = _mm256_sign_epi8(w, w);
                for (int t = 0; t < GM_T; t++) s[t] = gi_dot(s[t], u, _mm256_sign_epi8(gi_bc32(xc + 32 * t + 4 * k), w));
            }
#endif
        }
        const gf d = gf_f16pair(ba, bb);
        for (int t = 0; t < GM_T; t++) {
            const gi v = shift < 0 ? s[t] : gi_sub32(s[t], gi_set1_32(g->qs[ci + t] * (1 << shift)));
            acc[t] = gf_fma(gf_cvt(v), gf_mul(d, gf_set1(g->d[ci + t])), acc[t]);
        }
    }
    for (int t = 0; t < GM_T; t++) gf_store(o + t * GM_ROWS, acc[t]);
}

/* HOTCOLD_PACKED_GEMM=0 keeps prompt chunks on the GEMV (benchmarks/prefill.py's before-and-after; same bits). */
static int gm_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("HOTCOLD_PACKED_GEMM");
        on = !(e && e[0] == '0');
    }
    return on;
}

/* outs[m] [T, Fs[m]] = x @ W_m.T for block-type packed matrices: x quantized once into token tiles (threads
 * split the tokens), then row tiles of every matrix as work items. Returns 0, -1 (memory), or 1: not taken
 * (too few tokens, or switched off), the caller runs the GEMV. */
static int packed_gemm(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                       const float *x, int64_t T, float *const *outs, int nth) {
    if (T < HC_GEMM_MIN_T || !gm_enabled()) return 1;
    for (int m = 0; m < nmat; m++)
        if (wts[m] == WT_MXFP4) return 1; /* no GEMM tile for MXFP4: its packed GEMV */
    const int64_t nc = D / 32, ntile = (T + GM_T - 1) / GM_T, gpt = GM_ROWS / PK_ROWS; /* groups a row tile */
    int64_t first[9] = {0}, gbytes[8], ngs[8];
    for (int m = 0; m < nmat; m++) {
        gbytes[m] = hc_packed_nbytes(wts[m], PK_ROWS, D);
        ngs[m] = (Fs[m] + PK_ROWS - 1) / PK_ROWS;
        first[m + 1] = first[m] + (ngs[m] + gpt - 1) / gpt;
    }
    const int64_t items = first[nmat];
    gm_x g;
    if (gm_x_alloc(&g, ntile, nc) != 0) return -1;
    nth = clamp_threads(nth, items > T ? items : T);
    int64_t next = 0;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < T; t++) gm_x_token(x + t * D, nc, &g, t);
        float o[GM_T * GM_ROWS] __attribute__((aligned(64)));
        uint8_t *U = (uint8_t *)aligned_alloc(64, (size_t)(nc * 8 * GM_VB)); /* this thread's unpacked row tile */
        failed = U == NULL;
        for (int64_t it = claim(&next); it < items && U; it = claim(&next)) {
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int wt = wts[m];
            const int64_t F = Fs[m], g0 = (it - first[m]) * gpt, r0 = g0 * PK_ROWS;
            const uint8_t *Pa = Ps[m] + g0 * gbytes[m], *Pb = g0 + 1 < ngs[m] ? Pa + gbytes[m] : Pa;
            const int64_t nr = F - r0 < GM_ROWS ? F - r0 : GM_ROWS;
            if (wt == WT_Q6_K) gm_unpack_q6_k(Pa, Pb, nc, U);
            for (int64_t tile = 0; tile < ntile; tile++) {
                if (wt == WT_Q4_K) gm_q4_k(Pa, Pb, &g, tile, nc, o);
                else if (wt == WT_Q6_K) gm_q6_k(Pa, Pb, U, &g, tile, nc, o);
                else if (wt == WT_Q4_0) gm_block(WT_Q4_0, Pa, Pb, &g, tile, nc, o);
                else gm_block(WT_Q8_0, Pa, Pb, &g, tile, nc, o);
                for (int64_t s = 0; s < GM_T && tile * GM_T + s < T; s++)
                    memcpy(outs[m] + (tile * GM_T + s) * F + r0, o + s * GM_ROWS, sizeof(float) * (size_t)nr);
            }
        }
        free(U);
    }
    free(g.mem);
    return failed ? -1 : 0;
}
#else
static int packed_gemm(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                       const float *x, int64_t T, float *const *outs, int nth) {
    (void)nmat, (void)wts, (void)Ps, (void)Fs, (void)D, (void)x, (void)T, (void)outs, (void)nth;
    return 1; /* no SIMD: the GEMV's portable path */
}
#endif
