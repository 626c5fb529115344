/* What the layers do to q, k and v [N, Fs[m]] between their product and RoPE: the biases (opt, qwen2) added, then
 * the per-head RMS norms of q and k (qwen3), each head a row of Dh, then q times q_scale where it is not 0. */
static void qkv_bias_norms(int64_t N, float *const *qkv, const int64_t *Fs, const float *const *bias,
                           const float *q_norm, const float *k_norm, float qk_eps, float q_scale, int64_t H, int64_t Hkv,
                           int64_t Dh) {
    for (int m = 0; m < 3 && bias; m++)
        if (bias[m])
            for (int64_t j = 0; j < N; j++)
                for (int64_t i = 0; i < Fs[m]; i++) qkv[m][j * Fs[m] + i] += bias[m][i];
    if (q_norm) hc_rms_norm(qkv[0], q_norm, qk_eps, N * H, Dh, qkv[0]);
    if (k_norm) hc_rms_norm(qkv[1], k_norm, qk_eps, N * Hkv, Dh, qkv[1]);
    if (q_scale != 0.0f) /* a q.k scale of its own (Gemma's query_pre_attn_scalar): q carries it, as the layers do */
        for (int64_t i = 0; i < N * H * Dh; i++) qkv[0][i] *= q_scale;
}

/* hc_decode_head (below) for N rows x [N, D], one decode token of each of N sequences: the q/k/v group over the rows,
 * then RoPE attention over each row's own caches kcs[j] / vcs[j] at pos[j] (cos / sin [N, R/2]). */
static int decode_head_rows(int64_t N, const int *wts, const uint8_t *const *Ws, const int64_t *strides,
                            const int64_t *Fs, int packed, int64_t D, const float *x, const float *norm_w, float eps,
                            float *const *qkv, const float *const *bias, const float *q_norm, const float *k_norm,
                            float qk_eps, float q_scale, float *const *kcs, float *const *vcs, const int64_t *pos,
                            int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos, const float *sin, int neox,
                            int64_t window, float softcap, const float *sinks, float *out, int nth) {
    const int rc = packed ? hc_packed_matvec_multi(3, wts, Ws, Fs, D, x, N, norm_w, eps, qkv, nth)
                          : hc_matvec_multi(3, wts, Ws, strides, Fs, D, x, N, norm_w, eps, qkv, nth);
    if (rc != 0) return rc;
    qkv_bias_norms(N, qkv, Fs, bias, q_norm, k_norm, qk_eps, q_scale, H, Hkv, Dh);
    return hc_attn_decode_rows(N, qkv[0], qkv[1], qkv[2], kcs, vcs, pos, H, Hkv, Dh, R, cos, sin, neox, window, softcap,
                               sinks, out, nth);
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
    return decode_head_rows(1, wts, Ws, strides, Fs, packed, D, x, norm_w, eps, qkv, NULL, NULL, NULL, 0.0f, 0.0f, kcs, vcs,
                            &pos, H, Hkv, Dh, R, cos, sin, neox, window, 0.0f, NULL, out, nth);
}

#define HC_SIGMOID_SUM_MIN 6.103515625e-5f /* upstream clamps the sum of the chosen sigmoids below at F16's min */

/* Each of T rows of logits [T, E]: its K largest, largest first (ties: the lower expert first) -> ids [T, K], and
 * weights [T, K] = the softmax over those K logits (gating 0), or their sigmoids over the sum of them, the sum at
 * least HC_SIGMOID_SUM_MIN (gating 1: SmallThinker), with the C kernels' exp. The routing of every CPU path
 * (MoEFFN.route and the one-call decode), so a row's experts and weights never depend on its path. */
void hc_moe_route(const float *logits, int64_t T, int64_t E, int64_t K, int gating, int64_t *ids, float *weights) {
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
        float sum = 0.0f;
        if (gating == 1) {
            for (int64_t s = 0; s < K; s++) sum += (wt[s] = 1.0f / (1.0f + exp_nofma(-lt[it[s]])));
            sum = sum < HC_SIGMOID_SUM_MIN ? HC_SIGMOID_SUM_MIN : sum;
        } else {
            const float m = lt[it[0]];
            for (int64_t s = 0; s < K; s++) sum += (wt[s] = exp_nofma(lt[it[s]] - m));
        }
        for (int64_t s = 0; s < K; s++) wt[s] /= sum;
    }
}

/* A ReLU-gated expert over its live rows (sparse/moe.py relu_rows_apply, the same calls so the same bits) for T rows
 * of h [T, D]: every gate row, the up rows where relu(gate) != 0, a = act(gate) * up (hc_ffn_combine), then down over
 * the rows where a != 0 (the axpy over down_t) or the whole product of a (down [D, F], its zeros included). mask
 * [T, F] is left holding the live rows. Returns their count, or -1 if memory ran out. */
static int64_t relu_rows_ffn(const hc_weight *up, const hc_weight *gate, const hc_weight *down, int down_is_t, int kind,
                             int act, int64_t T, const float *h, uint8_t *mask, float *out, int nth) {
    const int64_t D = up->cols, F = up->rows;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * T * F + 1));
    if (!buf) return -1;
    float *u = buf, *g = buf + T * F;
    int rc = weight_matvec(gate, h, T, g, nth); /* every row: the packed copy where the gate has one */
    for (int64_t j = 0; j < T * F && rc == 0; j++) mask[j] = !(g[j] <= 0.0f); /* torch.relu(g) != 0; NaN stays */
    if (rc == 0) rc = hc_gather_matvec(up->wt, up->data, up->stride, F, D, h, T, mask, u, nth);
    int64_t live = 0;
    if (rc == 0) {
        hc_ffn_combine(kind, act, u, g, NULL, NULL, T, F, u, nth);
        for (int64_t j = 0; j < T * F; j++) live += (mask[j] = u[j] != 0.0f);
        rc = down_is_t ? hc_sparse_axpy(down->wt, down->data, down->stride, F, D, u, T, mask, out, nth)
                       : weight_matvec(down, u, T, out, nth);
    }
    free(buf);
    return rc == 0 ? live : -1;
}

/* The tail of a mixture-of-experts layer: y1 = x + attn @ wo.T, h = rms_norm(y1), the experts of each row
 * (hc_moe_route over h @ router.T); then expert by expert, in ascending order, its FFN of the rows routed to it (h's
 * rows; a sparse expert predicts from y1's), each row's output times its weight added to that row's sum (from 0);
 * y2 = y1 + sum: MoEFFN's ops one by one. fired_rows[j]: row j's computed neurons over its experts; route_out[j]:
 * row j's experts. Returns 0, or -1 if memory ran out. */
static int moe_tail(const hc_layer *a, const float *attn, const float *x, const float *early_logits, int64_t N,
                    int64_t D, int64_t *const *route_out, int64_t *fired_rows, uint8_t *mask, float *y1, float *y2,
                    int nth) {
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
        if (a->wo_bias) /* gpt-oss: o's bias, as linear() adds it */
            for (int64_t j = 0; j < N * D; j++) o[j] += a->wo_bias[j % D];
        for (int64_t j = 0; j < N * D; j++) y1[j] = x[j] + o[j];
        hc_rms_norm(y1, a->ffn_norm, a->ffn_eps, N, D, h);
        if (!early_logits) rc = weight_matvec(a->router, h, N, logits, nth); /* smallthinker's: before attention */
        if (rc == 0 && !early_logits && a->router_bias) /* gpt-oss */
            for (int64_t j = 0; j < N; j++)
                for (int64_t e = 0; e < E; e++) logits[j * E + e] += a->router_bias[e];
    }
    if (rc == 0) {
        hc_moe_route(early_logits ? early_logits : logits, N, E, K, a->gating, ids, wts);
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
        if (a->relu_rows || a->sparse) { /* ReLU experts' live rows, or a sparse expert's predicted ones */
            const int64_t got =
                a->relu_rows ? relu_rows_ffn(a->e_up[e], a->e_gate[e], a->e_down[e], a->down_is_t, a->kind, a->act, te,
                                             hs, mask, ys, nth)
                             : hc_sparse_ffn(a->e_fc1[e], a->e_fc2[e], a->e_thr[e], ps, a->e_up[e], a->e_gate[e],
                                             a->e_down[e], NULL, a->kind, te, hs, NULL, 0.0f, mask, ys, nth);
            rc = got < 0 ? -1 : 0;
            for (int64_t u = 0; u < te && rc == 0; u++) {
                int64_t c = 0;
                for (int64_t i = 0; i < F; i++) c += mask[u * F + i] != 0;
                fired_rows[rows[u]] += c;
            }
        } else {
            rc = dense_ffn(a->e_up[e], a->e_gate[e], a->e_down[e], a->down_is_t, a->e_up_bias ? a->e_up_bias[e] : NULL,
                           a->e_gate_bias ? a->e_gate_bias[e] : NULL, a->kind, a->act, te, hs, ys, nth);
            for (int64_t u = 0; u < te; u++) fired_rows[rows[u]] += F;
            if (rc == 0 && a->e_down_bias) /* gpt-oss: each expert's down bias, before its weight (add_down_bias) */
                for (int64_t u = 0; u < te; u++)
                    for (int64_t i = 0; i < D; i++) ys[u * D + i] += a->e_down_bias[e][i];
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
        if (a->attn_post_norm) hc_rms_norm(o, a->attn_post_norm, a->post_eps, N, D, o); /* gemma3 */
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
            got = dense_ffn(a->up, a->gate, a->down, a->down_is_t, a->up_bias, NULL, a->kind, a->act, N, h, o, nth) == 0 ? 0
                                                                                                                   : -1;
        if (got >= 0 && a->ffn_post_norm) hc_rms_norm(o, a->ffn_post_norm, a->post_eps, N, D, o); /* gemma3 */
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

/* q/k/v of an input-sparse layer (hc_layer.qkv_t) for one token, with its biases (qwen2) and per-head q/k
 * norms (qwen3) as decode_head_rows applies them, then attention over the caches kc / vc as hc_decode_head. */
static int input_sparse_head(const hc_layer *a, int64_t D, const float *x, int64_t pos, float *kc, float *vc,
                             const float *cos, const float *sin, float *xn, float *qkv, uint8_t *smask, float *out,
                             int nth) {
    hc_rms_norm(x, a->attn_norm, a->attn_eps, 1, D, xn);
    if (hc_input_sparse_matvec(a->qkv_t, a->qkv_scale, a->qkv_thr, xn, 1, smask, qkv, nth) != 0) return -1;
    const float *const bias[3] = {a->q_bias, a->k_bias, a->v_bias};
    float *const parts[3] = {qkv, qkv + a->Fs[0], qkv + a->Fs[0] + a->Fs[1]};
    qkv_bias_norms(1, parts, a->Fs, bias, a->q_norm, a->k_norm, a->qk_eps, a->q_scale, a->H, a->Hkv, a->Dh);
    float *kcs[1] = {kc}, *vcs[1] = {vc};
    return hc_attn_decode_rows(1, qkv, qkv + a->Fs[0], qkv + a->Fs[0] + a->Fs[1], kcs, vcs, &pos, a->H, a->Hkv,
                               a->Dh, a->R, cos, sin, a->neox, a->window, a->attn_softcap, a->sinks, out, nth);
}

/* The tail of a thresholded layer for one token with what hc_thresholded_tail does not take: o over wo_t
 * (input-sparse attention) or wo, and Gemma's sandwich norms (attn_post_norm on o, ffn_post_norm on the FFN's
 * output, each before its add): y1 = x + norm(o), y2 = y1 + norm(hc_thresholded_ffn(y1, the RMS norm folded)). The
 * ops the normed tail runs one by one (models/llama.py), so the same bits. Returns its kept count, or -1 if memory
 * ran out. */
static int64_t thresholded_tail_one(const hc_layer *a, const float *attn, const float *x, int64_t D, uint8_t *smask,
                                    uint8_t *mask, float *y1, float *y2, int nth) {
    float *o = (float *)malloc(sizeof(float) * (size_t)(2 * D));
    if (!o) return -1;
    float *f = o + D;
    const int rc = a->wo_t ? hc_input_sparse_matvec(a->wo_t, a->wo_scale, a->wo_thr, attn, 1, smask, o, nth)
                           : weight_matvec(a->wo, attn, 1, o, nth);
    int64_t kept = -1;
    if (rc == 0) {
        if (a->attn_post_norm) hc_rms_norm(o, a->attn_post_norm, a->post_eps, 1, D, o);
        for (int64_t j = 0; j < D; j++) y1[j] = x[j] + o[j];
        kept = hc_thresholded_ffn(a->score, a->score_in, a->scale, a->thr, a->act, a->up, a->gate, a->down, 1, y1,
                                  a->ffn_norm, a->ffn_eps, mask, f, nth);
    }
    if (kept >= 0) {
        if (a->ffn_post_norm) hc_rms_norm(f, a->ffn_post_norm, a->post_eps, 1, D, f);
        for (int64_t j = 0; j < D; j++) y2[j] = y1[j] + f[j];
    }
    free(o);
    return kept;
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
                   const float *cos, const float *sin, const float *cos_l, const float *sin_l, int64_t *const *fired,
                   int nth) {
    const hc_layer *L = Ls[0];
    int64_t qmax = 1, kvmax = 1, fmax = 1, emax = 1;
    for (int l = 0; l < n; l++) {
        if (N > 1 && (L[l].sparse == 2 || L[l].qkv_t)) return -2;
        emax = L[l].router && L[l].n_expert > emax ? L[l].n_expert : emax;
        qmax = L[l].Fs[0] > qmax ? L[l].Fs[0] : qmax;
        kvmax = L[l].Fs[1] > kvmax ? L[l].Fs[1] : kvmax;
        fmax = L[l].up->rows > fmax ? L[l].up->rows : fmax;
    }
    const int64_t smax = qmax > D ? qmax : D; /* an input-sparse product's input channels */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(N * (2 * qmax + 2 * kvmax + 3 * D + emax) + smax));
    uint8_t *mask = (uint8_t *)malloc((size_t)(N * fmax + smax));
    float **caches = (float **)malloc(sizeof(float *) * (size_t)(2 * N)); /* a layer's caches, row by row */
    int rc = buf && mask && caches ? 0 : -1;
    float *q = buf, *k = q + N * qmax, *v = k + N * kvmax, *attn = v + N * kvmax, *y1 = attn + N * qmax,
          *y2 = y1 + N * D, *xn = y2 + N * D, *elog = xn + N * D + smax;
    uint8_t *smask = mask ? mask + N * fmax : NULL;
    for (int l = 0; l < n && rc == 0; l++) {
        const hc_layer *a = &L[l];
        float **kcs = caches, **vcs = caches + N;
        for (int64_t j = 0; j < N; j++) kcs[j] = Ls[j][l].kc, vcs[j] = Ls[j][l].vc;
        const float *early = NULL; /* smallthinker: the router's logits of the layer's input, before attention */
        if (a->router && a->early_router) {
            rc = weight_matvec(a->router, x, N, elog, nth);
            if (rc != 0) break;
            early = elog;
        }
        if (a->qkv_t) { /* q, k, v side by side in q's and k's buffers: q + k + v <= qmax + 2 * kvmax */
            rc = input_sparse_head(a, D, x, pos[0], kcs[0], vcs[0], a->local_rope ? cos_l : cos,
                                   a->local_rope ? sin_l : sin, xn, q, smask, attn, nth);
        } else {
            float *const qkv[3] = {q, k, v};
            const float *const bias[3] = {a->q_bias, a->k_bias, a->v_bias};
            const float *xin = x, *norm_w = a->attn_norm; /* RMS: folded into the q/k/v call */
            if (a->attn_ln) { /* a LayerNorm first, as the layers norm before their q/k/v group */
                hc_layer_norm(x, a->attn_norm, a->attn_norm_b, a->attn_eps, N, D, xn);
                xin = xn, norm_w = NULL;
            }
            rc = decode_head_rows(N, a->wts, a->Ws, a->strides, a->Fs, a->packed, D, xin, norm_w, a->attn_eps, qkv,
                                  bias, a->q_norm, a->k_norm, a->qk_eps, a->q_scale, kcs, vcs, pos, a->H, a->Hkv, a->Dh,
                                  a->R, a->local_rope ? cos_l : cos, a->local_rope ? sin_l : sin, a->neox, a->window,
                                  a->attn_softcap, a->sinks, attn, nth);
        }
        if (rc != 0) break;
        const int64_t F = a->up->rows;
        int64_t got = 0;
        if (a->sparse == 2 && (a->wo_t || a->attn_post_norm || a->ffn_post_norm)) {
            got = fired[0][l] = thresholded_tail_one(a, attn, x, D, smask, mask, y1, y2, nth);
        } else if (a->sparse == 2) {
            got = fired[0][l] = hc_thresholded_tail(a->wo, attn, x, a->score, a->score_in, a->scale, a->thr, a->act, a->up,
                                                    a->gate, a->down, 1, a->ffn_norm, a->ffn_eps, mask, y1, y2, nth);
        } else if (a->router) {
            int64_t **routes = (int64_t **)caches; /* the row pointers are free again after attention */
            for (int64_t j = 0; j < N; j++) routes[j] = Ls[j][l].route_out;
            int64_t *rowfired = (int64_t *)(void *)q; /* q's buffer (N * qmax floats >= N int64 counts) is free too */
            got = moe_tail(a, attn, x, early, N, D, routes, rowfired, mask, y1, y2, nth);
            for (int64_t j = 0; j < N && got >= 0; j++) fired[j][l] = rowfired[j];
        } else if (a->attn_ln || a->ffn_ln || a->parallel || a->wo_bias || a->down_bias || a->attn_post_norm ||
                   a->ffn_post_norm) {
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

