/* ------------------------------------------------------------------------------------------------
 * One sparse FFN step of a ReLU model, for a few tokens: the predictor, the row gathers, the
 * activation and the axpy in one call, so no interpreter work (and no cache-cold glue) runs in
 * between. It is built from the kernels above, so its results equal theirs bit for bit.
 * ---------------------------------------------------------------------------------------------- */
/* out [T, rows] = x @ W.T over every row: the packed GEMV where W has a packed copy (the predictor's
 * matrices, always multiplied whole), else the row kernel; each as a matmul call would choose. */
static int weight_matvec(const hc_weight *w, const float *x, int64_t T, float *out, int nth) {
    if (w->packed) return hc_packed_matvec(w->wt, w->packed, w->rows, w->cols, x, T, out, nth);
    return hc_gather_matvec(w->wt, w->data, w->stride, w->rows, w->cols, x, T, NULL, out, nth);
}

enum { KIND_GATED = 0, KIND_GATED_BOTH = 1, KIND_PLAIN = 2, KIND_SWIGLU_OAI = 3 };
#define SWIGLU_OAI_ALPHA 1.702f /* gpt-oss's clamped SwiGLU (ggml_swiglu_oai, sparse/ffn_weights.swiglu_oai) */
#define SWIGLU_OAI_LIMIT 7.0f

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

/* GELU's tanh approximation as torch writes it (approximate="tanh"; Gemma's), with tanhf. */
HC_INLINE float gelu_tanh1(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

HC_INLINE float act1(int act, float v) {
    return act == 3 ? gelu_tanh1(v) : act == 2 ? gelu1(v) : act ? silu1(v) : relu1(v);
}

enum { ACT_RELU = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3 };

/* a [T, F] = the FFN activation of u [T, F] (plus up_bias [F] if given) and g [T, F] (NULL for plain):
 * gated act(g) * v, gated_both act(g) * act(v), plain act(v); act 0 relu, 1 silu, 2 gelu, 3 gelu (tanh). torch's steps in its
 * order (bias add, activation, product), so with relu the bits of torch's ops. a may be u. */
void hc_ffn_combine(int kind, int act, const float *u, const float *g, const float *up_bias, const float *gate_bias,
                    int64_t T, int64_t F, float *a, int nth) {
    const int64_t n = T * F;
    nth = n < (1 << 16) ? 1 : nth; /* one decode token: threads cost more than they save */
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *ut = u + t * F, *gt = g ? g + t * F : NULL;
        float *at = a + t * F;
        if (kind == KIND_SWIGLU_OAI) { /* g = min(gate, L), u = clamp(up, -L, L): g / (1 + exp(-alpha g)) * (u + 1) */
            for (int64_t i = 0; i < F; i++) {
                float gi = gate_bias ? gt[i] + gate_bias[i] : gt[i], ui = up_bias ? ut[i] + up_bias[i] : ut[i];
                gi = gi > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : gi; /* NaN stays NaN, as torch's clamp */
                ui = ui > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : (ui < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : ui);
                at[i] = gi / (1.0f + expf(-SWIGLU_OAI_ALPHA * gi)) * (ui + 1.0f);
            }
        } else if (kind == KIND_PLAIN) {
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
                     const float *up_bias, const float *gate_bias, int kind, int act, int64_t T, const float *h,
                     float *out, int nth) {
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
        hc_ffn_combine(kind, act, u, gate ? g : NULL, up_bias, gate_bias, T, F, u, nth);
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
        rc = dense_ffn(up, gate, down, down_is_t, up_bias, NULL, kind, act, T, h, o, nth);
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
static int hc_input_sparse_matvec(const hc_weight *w_t, const float *scale, float thr, const float *x,
                                  int64_t T, uint8_t *mask, float *out, int nth) {
    const int64_t Din = w_t->rows;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < Din; i++) {
            const float a = fabsf(x[t * Din + i]);
            mask[t * Din + i] = (scale ? a * scale[i] : a) > thr; /* NaN: not kept */
        }
    return hc_sparse_axpy(w_t->wt, w_t->data, w_t->stride, Din, w_t->cols, x, T, mask, out, nth);
}

/* With norm_w the FFN input is h = hc_rms_norm(x), else x. s [T, F] = h @ score.T over every row (the
 * gate probe, or the gate itself when gate is NULL: weight_matvec, as the matmul of few tokens; with
 * score_in, score is gate_t [D, F] and s the gate of the kept input channels: hc_input_sparse_matvec); neuron i
 * of token t is kept (mask[t, i] = 1) iff |act(s)| (times scale[i] if scale) > thr, all in float32 as
 * torch computes it (act: ACT_SILU, or ACT_GELU_TANH for Gemma's GeGLU; act1). On the kept rows only: the exact
 * gate (gate not NULL; else act(s) is the activation) and up (row gathers in one parallel pass, x quantized once
 * for both), a = act(gate) * up, 0 elsewhere,
 * and out [T, D] = the axpy of a over down_t. Returns the number of kept (token, neuron) pairs, or -1 if
 * memory ran out. */
int64_t hc_thresholded_ffn(const hc_weight *score, const hc_in_rule *score_in, const float *scale, float thr,
                           int act_fn, const hc_weight *up, const hc_weight *gate, const hc_weight *down_t, int64_t T,
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
                act[j] = act1(act_fn, act[j]);
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
            for (int64_t j = 0; j < T * F; j++) act[j] = act1(act_fn, act[j]); /* act(0) = 0 where not kept */
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
                                   float thr, int act_fn, const hc_weight *up, const hc_weight *gate, const hc_weight *down_t,
                                   int64_t T, const float *norm_w, float eps, uint8_t *mask, const float *y1,
                                   float *y2, int nth) {
    const int64_t D = up->cols;
    const int64_t kept =
        hc_thresholded_ffn(score, score_in, scale, thr, act_fn, up, gate, down_t, T, y1, norm_w, eps, mask, o, nth);
    if (kept >= 0)
        for (int64_t j = 0; j < T * D; j++) y2[j] = y1[j] + o[j];
    free(o);
    return kept;
}

/* hc_decode_tail with the thresholded FFN: y1 = x + attn @ wo.T, y2 = y1 + hc_thresholded_ffn(y1, the RMS
 * norm folded). Returns its kept count, or -1 if memory ran out. */
int64_t hc_thresholded_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *score,
                            const hc_in_rule *score_in, const float *scale, float thr, int act_fn, const hc_weight *up,
                            const hc_weight *gate, const hc_weight *down_t, int64_t T, const float *norm_w,
                            float eps, uint8_t *mask, float *y1, float *y2, int nth) {
    float *o = o_residual(wo, attn, x, T, y1, nth);
    return o ? thresholded_after_o(o, score, score_in, scale, thr, act_fn, up, gate, down_t, T, norm_w, eps, mask, y1, y2,
                                   nth)
             : -1;
}

