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

int64_t hc_struct_size(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(hc_weight);
    case 1: return (int64_t)sizeof(hc_in_rule);
    case 2: return (int64_t)sizeof(hc_layer);
    default: return -1;
    }
}

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

