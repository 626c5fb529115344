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
