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
    case WT_MXFP4: CALL(WT_MXFP4); break;                                                                    \
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

