/* The output head's screen (head_screen.py): a Q8_0 copy of a float head with, per row, bounds on what the
 * copy changes, so a greedy step can prove which rows may hold the argmax before it reads any of the head.
 *
 * Row i of W (F32, F16 or BF16, D a multiple of 32) becomes ggml's Q8_0 blocks (d = amax / 127 stored as
 * fp16, q = round(w / d)), and err[i] >= |w_i - q_i|_2, qnorm[i] >= |q_i|_2 (the dequantized row), both
 * summed in double and rounded up to the next float: upper bounds, never estimates. */

HC_INLINE uint16_t screen_f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#elif defined(__aarch64__)
    __fp16 h = (__fp16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#else
    /* f is amax / 127 of finite values: non-negative and at most 65504 * 2^k for the heads this sees; the
     * rounding need not be ggml's, only the value h2f reads back is used (err and qnorm are computed from it) */
    uint32_t u;
    memcpy(&u, &f, 4);
    const int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    if (e >= 31) return 0x7bff;                       /* the largest finite half */
    if (e <= 0) return (uint16_t)(e < -10 ? 0 : ((u & 0x7fffff) | 0x800000) >> (14 - e));
    return (uint16_t)((e << 10) | ((u >> 13) & 0x3ff)); /* truncated: still a valid scale */
#endif
}

int hc_screen_q8_0(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, uint8_t *Q, float *err,
                   float *qnorm, int nthreads) {
    if ((wt != WT_F32 && wt != WT_F16 && wt != WT_BF16) || D % 32 || F < 0) return -1;
    const int64_t nc = D / 32, qstride = nc * 34;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t i = 0; i < F; i++) {
        const uint8_t *row = W + i * stride;
        uint8_t *qrow = Q + i * qstride;
        double e2 = 0.0, n2 = 0.0;
        for (int64_t c = 0; c < nc; c++) {
            float v[32], amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                v[j] = wscalar(wt, row, 32 * c + j);
                amax = fmaxf(amax, fabsf(v[j]));
            }
            const uint16_t h = screen_f2h(amax / 127.0f);
            const float d = h2f(h), id = d > 0.0f ? 1.0f / d : 0.0f;
            memcpy(qrow + 34 * c, &h, 2);
            int8_t *q = (int8_t *)(qrow + 34 * c + 2);
            for (int j = 0; j < 32; j++) {
                long r = lrintf(v[j] * id);
                r = r > 127 ? 127 : (r < -127 ? -127 : r);
                q[j] = (int8_t)r;
                const double dq = (double)d * (double)r;
                e2 += ((double)v[j] - dq) * ((double)v[j] - dq);
                n2 += dq * dq;
            }
        }
        err[i] = nextafterf((float)sqrt(e2), INFINITY);
        qnorm[i] = nextafterf((float)sqrt(n2), INFINITY);
    }
    return 0;
}

/* The screen's candidates for T tokens (head_screen.HeadScreen.candidates): with s [T, V] the screen's products and
 * b[t, r] = err[r] * a[t] + qnorm[r] * c[t] the bound on |w_r . x_t - s[t, r]| (float64; a[t] = |x_t|, c[t] = |x_t -
 * x'_t| + slack |x'_t|), lo[t] = the top-th largest s - b over the rows not kept, and mask[t, r] = 1 where row r is
 * kept (keep[koff[t]..koff[t+1]-1], row ids) or s + b >= lo[t], else 0. One pass for lo (a min-heap of the top
 * lower bounds), one for the mask, in the arithmetic the bound is proven in. Returns the number of candidate
 * (token, row) pairs, or -1 (top < 1, a row id out of range, or memory). A NaN product makes every row of its token
 * a candidate (the head then computes them and reports the NaN). */
static void screen_heap_down(double *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t m = i, l = 2 * i + 1, r = l + 1;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        const double t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

int64_t hc_screen_select(int64_t T, int64_t V, const float *s, const double *err, const double *qnorm,
                         const double *a, const double *c, int64_t top, const int64_t *keep, const int64_t *koff,
                         uint8_t *mask, int nth) {
    if (top < 1 || top > V) return -1;
    for (int64_t i = 0; keep && i < koff[T]; i++)
        if (keep[i] < 0 || keep[i] >= V) return -1;
    int64_t total = 0;
    int failed = 0;
    nth = clamp_threads(nth, T);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static) reduction(+ : total) reduction(| : failed)
#endif
    for (int64_t t = 0; t < T; t++) {
        double *heap = (double *)malloc(sizeof(double) * (size_t)top);
        if (!heap) {
            failed = 1;
            continue;
        }
        const float *st = s + t * V;
        uint8_t *mt = mask + t * V;
        memset(mt, 0, (size_t)V);
        for (int64_t i = keep ? koff[t] : 0; keep && i < koff[t + 1]; i++) mt[keep[i]] = 1;
        const double at = a[t], ct = c[t];
        int64_t n = 0;
        int bad = 0; /* a NaN product (x not finite): every row a candidate, so the head's finite check sees it */
        for (int64_t r = 0; r < V; r++) {
            if (mt[r]) continue;
            const double low = (double)st[r] - (err[r] * at + qnorm[r] * ct);
            if (low != low) {
                bad = 1;
                break;
            }
            if (n < top) { /* fill, then heapify once full */
                heap[n++] = low;
                if (n == top)
                    for (int64_t i = top / 2 - 1; i >= 0; i--) screen_heap_down(heap, top, i);
            } else if (low > heap[0]) {
                heap[0] = low;
                screen_heap_down(heap, top, 0);
            }
        }
        double lo = -INFINITY; /* fewer rows than top outside the kept: every row is a candidate */
        if (n == top && !bad) lo = heap[0];
        int64_t count = 0;
        for (int64_t r = 0; r < V; r++) {
            if (!mt[r]) mt[r] = bad || (double)st[r] + (err[r] * at + qnorm[r] * ct) >= lo;
            count += mt[r];
        }
        total += count;
        free(heap);
    }
    return failed ? -1 : total;
}
