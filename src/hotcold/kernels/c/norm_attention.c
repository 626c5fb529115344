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

/* A score s soft-capped at cap (Gemma 2): cap * tanh(s / cap), the order torch's attention computes it in. */
HC_INLINE float softcap1(float s, float cap) { return tanhf(s / cap) * cap; }

/* Query head qh (rotated here) of one token over cache rows lo..lo+S-1 of its kv head: out oh [Dh] =
 * softmax(cap(q k^T / sqrt(Dh))) v (cap: the soft-cap, or 0 for none); s: S floats of scratch. */
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
                              int64_t lo, int64_t S, int64_t Hkv, int64_t kvh, int64_t Dh, float scale, float cap,
                              const float *sinks, float *s, float *acc, float *const *ohs) {
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
            vf sc = vmul(vsum_rows(a), vset1(scale));
            vstoreu(s + g * S + j, sc);
            if (cap != 0.0f) { /* Gemma 2's soft-cap, one score at a time as the scalar tail below */
                for (int p = 0; p < VL; p++) s[g * S + j + p] = softcap1(s[g * S + j + p], cap);
                sc = vloadu(s + g * S + j);
            }
            vmx[g] = vmaxv(sc, vmx[g]); /* a NaN score stays out of the max, as in the scalar comparisons */
        }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * S;
        vf q[ATTN_MAXV];
        for (int i = 0; i < nv; i++) q[i] = vloadu(qs[g] + i * VL);
        float mx = vhmax(vmx[g]);
        for (int64_t t = j; t < S; t++) {
            sg[t] = vhsum(attn_dot_lanes(nv, q, k0 + t * ks)) * scale;
            if (cap != 0.0f) sg[t] = softcap1(sg[t], cap);
            mx = sg[t] > mx ? sg[t] : mx;
        }
        if (sinks) mx = sinks[g] > mx ? sinks[g] : mx; /* gpt-oss: a learned logit in the denominator */
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
        if (sinks) sum += expf(sinks[g] - mx);
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
                         int64_t Dh, int64_t R, const float *cos, const float *sin, int neox, float cap,
                         const float *sink, float *s, float *oh) {
    const float scale = 1.0f / sqrtf((float)Dh);
    rope_head(qh, R, cos, sin, neox);
    float mx = -INFINITY;
    for (int64_t j = 0; j < S; j++) {
        const float *kr = kc + ((lo + j) * Hkv + kvh) * Dh;
        s[j] = dot_f32(qh, kr, Dh) * scale;
        if (cap != 0.0f) s[j] = softcap1(s[j], cap);
        mx = s[j] > mx ? s[j] : mx;
    }
    if (sink) mx = *sink > mx ? *sink : mx;
    float sum = 0.0f;
    for (int64_t j = 0; j < S; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    if (sink) sum += expf(*sink - mx);
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
 * over cache rows lo..pos[n] (lo = pos - window + 1 with a sliding window, else 0), each score soft-capped
 * (cap * tanh(score / cap)) where softcap is not 0 (Gemma 2), sinks [H] (or NULL) a logit per head that joins
 * each softmax's denominator and attends to nothing (gpt-oss); query head h reads kv
 * head h / (H / Hkv); cos/sin [N, R/2]. (token, head) pairs are split among threads; each is computed as
 * for the token alone. Returns 0, or -1 if memory ran out. */
int hc_attn_decode_rows(int64_t N, float *q, float *k, const float *v, float *const *kcs, float *const *vcs,
                        const int64_t *pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                        const float *sin, int neox, int64_t window, float softcap, const float *sinks, float *out,
                        int nth) {
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
                attn_head(q + (n * H + h0) * Dh, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, R, cs, sn, neox, softcap,
                          sinks ? sinks + h0 : NULL, s, out + (n * H + h0) * Dh);
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
            const float scale = 1.0f / sqrtf((float)Dh), *sg0 = sinks ? sinks + h0 : NULL;
            float *acc = s + smax * per;
            switch (Dh / VL) { /* a constant vector count: q and the accumulators stay in registers */
            case 1: attn_group_vec(1, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, softcap, sg0, s, acc, ohs); break;
            case 2: attn_group_vec(2, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, softcap, sg0, s, acc, ohs); break;
            case 4: attn_group_vec(4, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, softcap, sg0, s, acc, ohs); break;
            case 8: attn_group_vec(8, (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, softcap, sg0, s, acc, ohs); break;
            default: attn_group_vec((int)(Dh / VL), (int)G, qs, kcs[n], vcs[n], lo, S, Hkv, kvh, Dh, scale, softcap, sg0, s,
                                    acc, ohs);
            }
#endif
        }
        free(s);
    }
    return failed ? -1 : 0;
}

