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
HC_INLINE int q_signed(const int wt) { return wt == WT_Q8_0 || wt == WT_IQ4_NL || wt == WT_IQ4_XS || wt == WT_MXFP4; }
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
    case WT_MXFP4: dec_mxfp4(row + c * 17, ci); break;
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
HC_INLINE __m256i table_lookup(const int8_t *table, __m256i nib) {
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nib);
}
HC_INLINE __m256i iq4_lookup(__m256i nib) { return table_lookup(IQ4_KVALUES, nib); }

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
    case WT_MXFP4: {
        const uint8_t *b = row + c * 17;
        s[0] = s[1] = e8m0_half(b[0]);
        return table_lookup(MXFP4_KVALUES, nib16(b + 1));
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

/* load32 for the types without a float loader of their own (Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K..Q5_K, IQ4_XS):
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
#define HC_ROWS_VNNI512 1 /* qdot_rows1 takes Q4_0, MXFP4, Q4_K and Q6_K rows to the 512-bit kernels below */
/* qdot_rows1 for Q4_0 and MXFP4 rows on AVX512-VNNI machines: two chunks a step in 512-bit registers. Each
 * chunk gives the same 8 integer lane sums as qdot_chunk (lane g: the values of bytes 4g..4g+3 in nib16's order
 * times x's, exact in int32: Q4_0's nibbles minus 8 times their x sum; MXFP4's nibbles looked up in its table
 * plus 12, unsigned bytes for dpbusd, minus 12 times the x sum, as qdot_chunk's sign trick sums them), the same
 * scale (the block's scale times dx, one rounding) and the same fma into the row's 8-lane accumulator, chunk after
 * chunk, then qdot_finish: the same bits, with about two thirds of the instructions (one dpbusd for maddubs, madd
 * and the offset subtraction; the nibble unpack and the conversion once for two chunks). The sparse FFN's gate
 * and up rows are compute-bound on this kernel at decode (measured 22 G weights/s a core for Q4_0, rows in L3). */
HC_INLINE void nibble_rows1_vnni(const int wt, const int NR, const uint8_t *const *rows, const hc_xq *x, int64_t D,
                                 float *res, const uint8_t *const *pf, int pf_l2) {
    const int mx = wt == WT_MXFP4, bb = mx ? 17 : 18, q0 = mx ? 1 : 2; /* block bytes, where the nibbles start */
    const int64_t nchunk = D / 32;
    const __m512i m15 = _mm512_set1_epi8(15), shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_add_epi8(_mm_loadu_si128((const __m128i *)MXFP4_KVALUES), _mm_set1_epi8(12)));
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    int64_t c = 0, pfo = 0;
    for (; c + 2 <= nchunk; c += 2) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x->q + 32 * c));
        const __m512i ls = _mm512_loadu_si512((const void *)(x->ls + 8 * c));
        const __m512i ls8 = _mm512_slli_epi32(ls, 3); /* 8 x the lane sums; MXFP4's 12: plus 4 x */
        const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(), mx ? _mm512_add_epi32(ls8, _mm512_slli_epi32(ls, 2)) : ls8);
        const __m256 dx0 = _mm256_set1_ps(x->d[c]), dx1 = _mm256_set1_ps(x->d[c + 1]);
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = rows[r] + c * bb;
            const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + q0))),
                                                        _mm_loadu_si128((const __m128i *)(b + bb + q0)), 1);
            /* 128-bit lanes: chunk c's bytes twice, then chunk c + 1's twice; the second copy of each
             * shifted by 4 gives the high nibbles (values 16..31), as nib16 does */
            const __m512i v = _mm512_shuffle_i64x2(_mm512_castsi256_si512(two), _mm512_castsi256_si512(two), 0x50);
            __m512i u = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), m15);
            if (mx) u = _mm512_shuffle_epi8(table, u);
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, u, xv));
            /* the block's scale times dx (one rounding): Q4_0's fp16 d converted in the vector unit */
            const __m256 s0 = mx ? _mm256_set1_ps(e8m0_half(b[0]) * x->d[c])
                                 : _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b))), dx0);
            const __m256 s1 = mx ? _mm256_set1_ps(e8m0_half(b[bb]) * x->d[c + 1])
                                 : _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b + bb))), dx1);
            acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(p), s0, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)), s1, acc[r]);
        }
        prefetch_rows(pf, 4, &pfo, chunk_off(wt, c + 2), pf_l2);
    }
    for (; c < nchunk; c++) /* an odd last chunk: qdot_chunk itself */
        for (int r = 0; r < NR; r++) {
            float s[2], m[2], macc = 0.0f;
            qdot_chunk(wt, qchunk(wt, rows[r], c, s, m), s, m, x, c, &acc[r], &macc);
        }
    for (int r = 0; r < NR; r++) res[r] = qdot_finish(wt, acc[r], 0.0f);
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
    if (wt == WT_Q4_0) { /* two calls, each with a constant type: the compiler makes two kernels of it */
        nibble_rows1_vnni(WT_Q4_0, NR, rows, x, D, res, pf, pf_l2);
        return;
    }
    if (wt == WT_MXFP4) {
        nibble_rows1_vnni(WT_MXFP4, NR, rows, x, D, res, pf, pf_l2);
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

