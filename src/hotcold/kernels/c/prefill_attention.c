/* ------------------------------------------------------------------------------------------------
 * A prompt chunk's causal attention over a float32 cache, as small GEMMs: the decode attention reads one
 * query against every key with a horizontal sum per score; here each kv head's keys are first transposed
 * ([Dh][S]: a vector holds VL keys' values of one dimension), so PF_RB query rows x 2 VL keys of scores are one
 * broadcast-and-fma per dimension with no horizontal sums, and the weighted sum of values takes PF_RB rows
 * against each value row loaded once. Work items: a kv head x a block of PF_QB query positions (all the query
 * heads that read that kv head); keys only up to the block's last position (causal).
 *
 * A row's arithmetic is fixed by its own position and the chunk: each score one fma chain over the head's
 * dimensions, the softmax over its keys in order (vector max and sum, then one reciprocal), the value sum in
 * key order (keys past the row's position, up to its block's last, add exactly 0 * v). So its bits do not
 * depend on the thread count; they are not SDPA's (a different summation order: a tolerance, as the decode
 * attention already is).
 * ---------------------------------------------------------------------------------------------- */
#if HC_ATTN_VEC
/* keeps a loaded vector in a register: GCC would fold the load into every fma that uses it (a load per fma) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PF_IN_REG(v) __asm__("" : "+v"(v))
#else
#define PF_IN_REG(v) (void)0
#endif
#define PF_QB 16 /* query positions an item */
#define PF_RB 8  /* query rows sharing each key vector load in the scores */
#define PF_VB 2  /* query rows sharing each value row load in the weighted sum */
#define PF_GMAX 64 /* query heads a kv head, at most */
#define PF_KB 32   /* value rows a block */

/* s [NR][sstride], keys [j, j + 2 VL) = NR query rows (qr[r]: Dh floats) x those keys (Kt [Dh][Sp]). */
HC_INLINE void pf_scores(const int NR, const float *const *qr, const float *Kt, int64_t Sp, int64_t Dh, int64_t j,
                         float *s, int64_t sstride) {
    vf a[PF_RB][2];
    for (int r = 0; r < NR; r++) a[r][0] = vzero(), a[r][1] = vzero();
    const float *kt = Kt + j;
    for (int64_t d = 0; d < Dh; d++, kt += Sp) {
        vf k0 = vloadu(kt), k1 = vloadu(kt + VL);
        PF_IN_REG(k0);
        PF_IN_REG(k1);
        for (int r = 0; r < NR; r++) {
            const vf qb = vset1(qr[r][d]);
            a[r][0] = vfma(qb, k0, a[r][0]);
            a[r][1] = vfma(qb, k1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) vstoreu(s + r * sstride + j, a[r][0]), vstoreu(s + r * sstride + j + VL, a[r][1]);
}

/* o rows (NR of them, Dh floats: the running sums, carried from the previous key block) += p[r][j] * v_j for keys
 * [j0, j1) in order (v_j at vr + j * vstride). */
HC_INLINE void pf_values(const int NVEC, const int NR, const float *p, int64_t pstride, const float *vr,
                         int64_t vstride, int64_t j0, int64_t j1, float *const *o) {
    vf a[PF_VB][ATTN_MAXV];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NVEC; i++) a[r][i] = vloadu(o[r] + i * VL);
    for (int64_t j = j0; j < j1; j++) {
        const float *v = vr + j * vstride;
        for (int i = 0; i < NVEC; i++) {
            vf vv = vloadu(v + i * VL);
            PF_IN_REG(vv);
            for (int r = 0; r < NR; r++) a[r][i] = vfma(vset1(p[r * pstride + j]), vv, a[r][i]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NVEC; i++) vstoreu(o[r] + i * VL, a[r][i]);
}

/* One row's softmax over keys [0, n) of s (scaled), in place; keys [n, n1) set to 0. Returns 1 / sum. */
static float pf_softmax(float *s, int64_t n, int64_t n1, float scale) {
    const vf sc = vset1(scale);
    vf vm = vset1(-INFINITY);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
        const vf x = vmul(vloadu(s + j), sc);
        vstoreu(s + j, x);
        vm = vmaxv(vm, x);
    }
    float mx = vhmax(vm);
    for (; j < n; j++) s[j] *= scale, mx = s[j] > mx ? s[j] : mx;
    const vf m = vset1(mx);
    vf vs = vzero();
    for (j = 0; j + VL <= n; j += VL) {
        const vf e = vexp(vsub(vloadu(s + j), m));
        vstoreu(s + j, e);
        vs = vadd(vs, e);
    }
    float sum = vhsum(vs);
    for (; j < n; j++) s[j] = expf(s[j] - mx), sum += s[j];
    for (; j < n1; j++) s[j] = 0.0f;
    return 1.0f / sum;
}

/* out [T, H, Dh] = causal softmax(q k^T / sqrt(Dh)) v for a prompt chunk: q [T, H, Dh] (RoPE applied), query t at
 * position pos + t over cache rows 0..pos + t of kc / vc ([n_ctx, Hkv, Dh], rows up to pos + T - 1 written); query
 * head h reads kv head h / (H / Hkv). Returns 0, -1 (memory), or 1: not taken (a head size this path has no
 * registers for), the caller uses its own. */
int hc_attn_prefill(int64_t T, const float *q, const float *kc, const float *vc, int64_t pos, int64_t H, int64_t Hkv,
                    int64_t Dh, float *out, int nth) {
    if (Dh % VL != 0 || Dh / VL > ATTN_MAXV || H % Hkv != 0 || H / Hkv > PF_GMAX || T < 1) return 1;
    const int64_t S = pos + T, Sp = (S + 2 * VL - 1) / (2 * VL) * (2 * VL), G = H / Hkv;
    const int64_t nqb = (T + PF_QB - 1) / PF_QB, items = Hkv * nqb, rows = PF_QB * G;
    float *Kt = (float *)aligned_alloc(64, sizeof(float) * (size_t)(Hkv * Dh * Sp));
    if (!Kt) return -1;
    nth = clamp_threads(nth, items);
    const float scale = 1.0f / sqrtf((float)Dh);
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t hd = 0; hd < Hkv * Dh; hd++) { /* Kt [kvh][d][Sp]: keys in a row, zero past S */
            const int64_t h = hd / Dh, d = hd % Dh;
            float *dst = Kt + hd * Sp;
            for (int64_t j = 0; j < S; j++) dst[j] = kc[(j * Hkv + h) * Dh + d];
            for (int64_t j = S; j < Sp; j++) dst[j] = 0.0f;
        }
        float *s = (float *)aligned_alloc(64, sizeof(float) * (size_t)(rows * Sp + rows));
        failed = s == NULL;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = items - 1; it >= 0; it--) { /* the longest (last) blocks first */
            if (failed) continue;
            const int64_t kvh = it % Hkv, qb = it / Hkv, t0 = qb * PF_QB, t1 = t0 + PF_QB < T ? t0 + PF_QB : T;
            const int64_t nrow = (t1 - t0) * G, jend = pos + t1; /* keys [0, jend) */
            const int64_t j1 = (jend + 2 * VL - 1) / (2 * VL) * (2 * VL);
            float *inv = s + rows * Sp;
            const float *qr[PF_QB * PF_GMAX];
            float *orow[PF_QB * PF_GMAX];
            for (int64_t r = 0; r < nrow; r++) { /* row r: query t0 + r / G, head kvh * G + r % G */
                const int64_t t = t0 + r / G, h = kvh * G + r % G;
                qr[r] = q + (t * H + h) * Dh;
                orow[r] = out + (t * H + h) * Dh;
            }
            const float *Kh = Kt + kvh * Dh * Sp;
            for (int64_t j = 0; j < j1; j += 2 * VL) { /* a block of keys (Dh x 2 VL floats) in L1 for every row */
                int64_t r = 0;
                for (; r + PF_RB <= nrow; r += PF_RB) pf_scores(PF_RB, qr + r, Kh, Sp, Dh, j, s + r * Sp, Sp);
                for (; r < nrow; r++) pf_scores(1, qr + r, Kh, Sp, Dh, j, s + r * Sp, Sp);
            }
            for (int64_t r = 0; r < nrow; r++) {
                inv[r] = pf_softmax(s + r * Sp, pos + t0 + r / G + 1, jend, scale);
                memset(orow[r], 0, sizeof(float) * (size_t)Dh);
            }
            const float *vr = vc + kvh * Dh;
            const int64_t vs = Hkv * Dh;
            for (int64_t j = 0; j < jend; j += PF_KB) { /* a block of value rows in L1 for every row */
                const int64_t je = j + PF_KB < jend ? j + PF_KB : jend;
                int64_t r;
#define PF_V(NVEC)                                                                                                    \
    for (r = 0; r + PF_VB <= nrow; r += PF_VB) pf_values(NVEC, PF_VB, s + r * Sp, Sp, vr, vs, j, je, orow + r);    \
    for (; r < nrow; r++) pf_values(NVEC, 1, s + r * Sp, Sp, vr, vs, j, je, orow + r);
                switch (Dh / VL) { /* a constant vector count: the accumulators stay in registers */
                case 1: PF_V(1); break;
                case 2: PF_V(2); break;
                case 4: PF_V(4); break;
                case 8: PF_V(8); break;
                default: PF_V((int)(Dh / VL)); break;
                }
            }
            for (int64_t r = 0; r < nrow; r++) /* the sum of p v, times 1 / the sum of p */
                for (int64_t e = 0; e < Dh; e += VL) vstoreu(orow[r] + e, vmul(vloadu(orow[r] + e), vset1(inv[r])));
#undef PF_V
        }
        free(s);
    }
    free(Kt);
    return failed ? -1 : 0;
}
#else
int hc_attn_prefill(int64_t T, const float *q, const float *kc, const float *vc, int64_t pos, int64_t H, int64_t Hkv,
                    int64_t Dh, float *out, int nth) {
    (void)T, (void)q, (void)kc, (void)vc, (void)pos, (void)H, (void)Hkv, (void)Dh, (void)out, (void)nth;
    return 1; /* no vector exp here: torch's attention */
}
#endif
