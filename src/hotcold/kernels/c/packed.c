/* ------------------------------------------------------------------------------------------------
 * Dense GEMV over a repacked copy (Q4_0, Q4_K, Q6_K): rows in groups of 8, each 32-value chunk stored as the 8
 * rows' fp16 scales (16 bytes) and 4 x 32 bytes where byte 4r + j of part k holds value 4k + j of row
 * r in its low nibble and value 4k + 16 + j in its high one. One 32-bit broadcast of 4 activations
 * then multiplies 4 values of all 8 rows (maddubs), a chunk's products add up in 16-bit lanes (at
 * most 8 * 2 * 15 * 127 = 30480) and one multiply-add per chunk applies the 8 rows' scales: about a
 * third of the row kernel's instructions per weight, with no horizontal sums (each lane is a row).
 * The packed copy is made at load for matrices that are only ever multiplied whole (attention, the
 * head, a dense file's FFN); sparse gathers keep the file's rows. A row's arithmetic (integer chunk
 * sum, then fma of (float)sum * (d * dx) in chunk order) is fixed: any thread count, any batch.
 * ---------------------------------------------------------------------------------------------- */
#define PK_ROWS 8
#define PK_Q4_0_CHUNK (16 + 128) /* bytes of one chunk of a group */
/* Q4_K: per super-block of a group the 8 rows' d and dmin (fp16), then per chunk their 6-bit scale and
 * min (one byte each) and the nibbles as Q4_0's: 32 + 8 * (16 + 128) bytes, the file's 8 * 144 + 32. */
#define PK_Q4_K_SUPER (32 + 8 * (16 + 128))
/* Q6_K: per super-block the 8 rows' d, then per chunk their two int8 scales (first halves, then second
 * halves), the low nibbles in Q4_0's order (128 bytes) and the 2 high bits (64 bytes: byte 4r + j of
 * pair kk holds those of values 4kk + j, 4kk + 16 + j, 4kk + 8 + j, 4kk + 24 + j, two bits each):
 * exactly the file's 8 * 210 bytes. */
#define PK_Q6_K_CHUNK (16 + 128 + 64)
#define PK_Q6_K_SUPER (16 + 8 * PK_Q6_K_CHUNK)
/* Q8_0: per chunk the 8 rows' scales (fp16), then the values in groups of 4: byte 32k + 4r + j is value
 * 4k + j of row r (k = 0..7): exactly the file's 8 * 34 bytes. */
#define PK_Q8_0_CHUNK (16 + 256)
/* MXFP4: per chunk the 8 rows' E8M0 scale bytes, then their table indices in Q4_0's nibble order: exactly the
 * file's 8 * 17 bytes. */
#define PK_MXFP4_CHUNK (8 + 128)

HC_INLINE int packable(int wt, int64_t D) {
    return ((wt == WT_Q4_0 || wt == WT_Q8_0 || wt == WT_MXFP4) && D % 32 == 0) || ((wt == WT_Q4_K || wt == WT_Q6_K) && D % 256 == 0) ||
           ((wt == WT_F16 || wt == WT_BF16) && D > 0);
}

/* Packed 16-bit float rows (F16, BF16): blocks of PKF_ROWS rows, column by column ([k][PKF_ROWS] halves, the last block
 * padded with zero rows), so a product broadcasts x[t, k] against PKF_V vectors of rows: one fma chain per
 * (row, token) over the columns in order, whatever the token count or the tile, so a token's bits never depend
 * on the batch (and do not on the vector width either). PKF_T tokens a tile. */
#if VL == 16
#define PKF_V 4
#define PKF_T 6
#else
#define PKF_V 2
#define PKF_T 4
#endif
#define PKF_ROWS (PKF_V * VL)
#define PKF_KSEG 256 /* columns a pass: PKF_ROWS x 256 halves (32 KB with 512-bit vectors) stay in L1 for the tokens */
#define PKF_KSEG2 64 /* columns a pass with two token tiles (pkf_block) */
#define PKF_PF (32 * PKF_ROWS) /* prefetch distance in halves: 32 columns (4 KB with 512-bit vectors) */

int64_t hc_packed_nbytes(int wt, int64_t F, int64_t D) {
    if (!packable(wt, D)) return -1;
    if (wt == WT_F16 || wt == WT_BF16) return (F + PKF_ROWS - 1) / PKF_ROWS * PKF_ROWS * D * 2;
    const int64_t ng = (F + PK_ROWS - 1) / PK_ROWS;
    return wt == WT_Q4_0   ? ng * (D / 32) * PK_Q4_0_CHUNK
           : wt == WT_Q8_0 ? ng * (D / 32) * PK_Q8_0_CHUNK
           : wt == WT_MXFP4 ? ng * (D / 32) * PK_MXFP4_CHUNK
           : wt == WT_Q4_K ? ng * (D / 256) * PK_Q4_K_SUPER
                           : ng * (D / 256) * PK_Q6_K_SUPER;
}

/* The nibbles of 8 rows' chunks (u[r]: 32 values 0..15 each) in the packed order. */
static void pack_nibbles(const uint8_t u[PK_ROWS][32], uint8_t *dst) {
    for (int r = 0; r < PK_ROWS; r++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++)
                dst[32 * k + 4 * r + j] = (uint8_t)(u[r][4 * k + j] | (u[r][4 * k + 16 + j] << 4));
}

/* W (rows stride bytes apart) -> P (hc_packed_nbytes bytes); the last group is padded with zero rows
 * (scales 0). Returns 0, or -1 for a type that has no packed form. */
int hc_pack(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, uint8_t *P) {
    if (!packable(wt, D)) return -1;
    if (wt == WT_F16 || wt == WT_BF16) { /* 16-bit values moved as they are */
        const int64_t nb = (F + PKF_ROWS - 1) / PKF_ROWS;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t b = 0; b < nb; b++) {
            uint16_t *dst = (uint16_t *)P + b * PKF_ROWS * D;
            const uint16_t *rows[PKF_ROWS];
            for (int64_t i = 0; i < PKF_ROWS; i++) {
                const int64_t r = b * PKF_ROWS + i;
                rows[i] = r < F ? (const uint16_t *)(W + r * stride) : NULL;
            }
            int64_t k = 0;
            for (; k + 4 <= D; k += 4) /* four columns of a row in one (little-endian) read, four lines written */
                for (int64_t i = 0; i < PKF_ROWS; i++) {
                    uint64_t v = 0;
                    if (rows[i]) memcpy(&v, rows[i] + k, 8);
                    for (int j = 0; j < 4; j++) dst[(k + j) * PKF_ROWS + i] = (uint16_t)(v >> (16 * j));
                }
            for (; k < D; k++)
                for (int64_t i = 0; i < PKF_ROWS; i++) dst[k * PKF_ROWS + i] = rows[i] ? rows[i][k] : 0;
        }
        return 0;
    }
    const int64_t nc = D / 32, ng = (F + PK_ROWS - 1) / PK_ROWS;
    memset(P, 0, (size_t)hc_packed_nbytes(wt, F, D));
#ifdef _OPENMP
#pragma omp parallel for schedule(static) /* groups are independent: at load, every core */
#endif
    for (int64_t g = 0; g < ng; g++) {
        const int nr = F - g * PK_ROWS < PK_ROWS ? (int)(F - g * PK_ROWS) : PK_ROWS;
        for (int64_t c = 0; c < nc; c++) {
            if (wt == WT_Q8_0) {
                uint8_t *dst = P + (g * nc + c) * PK_Q8_0_CHUNK;
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + c * 34;
                    memcpy(dst + 2 * r, b, 2);
                    for (int k = 0; k < 8; k++) memcpy(dst + 16 + 32 * k + 4 * r, b + 2 + 4 * k, 4);
                }
                continue;
            }
            uint8_t u[PK_ROWS][32] = {{0}};
            uint8_t *dst;
            if (wt == WT_Q4_0) {
                dst = P + (g * nc + c) * PK_Q4_0_CHUNK;
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + c * 18;
                    memcpy(dst + 2 * r, b, 2);
                    for (int l = 0; l < 16; l++) u[r][l] = b[2 + l] & 15, u[r][l + 16] = b[2 + l] >> 4;
                }
                dst += 16;
            } else if (wt == WT_MXFP4) {
                dst = P + (g * nc + c) * PK_MXFP4_CHUNK;
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + c * 17;
                    dst[r] = b[0];
                    for (int l = 0; l < 16; l++) u[r][l] = b[1 + l] & 15, u[r][l + 16] = b[1 + l] >> 4;
                }
                dst += 8;
            } else if (wt == WT_Q6_K) {
                const int j = (int)(c & 7);
                uint8_t *sb = P + (g * (nc / 8) + c / 8) * PK_Q6_K_SUPER;
                dst = sb + 16 + j * PK_Q6_K_CHUNK;
                uint8_t hb[PK_ROWS][32] = {{0}};
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + (c / 8) * 210;
                    if (j == 0) memcpy(sb + 2 * r, b + 208, 2);
                    chunk_ints ci;
                    dec_q6_k(b, j, &ci);
                    const int h = j >> 2, qq = j & 3;
                    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * qq;
                    dst[r] = (uint8_t)sc[0], dst[8 + r] = (uint8_t)sc[1];
                    for (int l = 0; l < 32; l++) {
                        const int v = ci.q[l] + 32; /* 0..63 */
                        u[r][l] = (uint8_t)(v & 15), hb[r][l] = (uint8_t)(v >> 4);
                    }
                }
                uint8_t *hi = dst + 16 + 128;
                for (int r = 0; r < PK_ROWS; r++)
                    for (int kk = 0; kk < 2; kk++)
                        for (int jj = 0; jj < 4; jj++) {
                            const int v0 = 4 * kk + jj;
                            hi[32 * kk + 4 * r + jj] = (uint8_t)(hb[r][v0] | (hb[r][v0 + 16] << 2) | (hb[r][v0 + 8] << 4) |
                                                                 (hb[r][v0 + 24] << 6));
                        }
                dst += 16;
            } else { /* Q4_K */
                const int j = (int)(c & 7);
                uint8_t *sb = P + (g * (nc / 8) + c / 8) * PK_Q4_K_SUPER;
                dst = sb + 32 + j * (16 + 128);
                for (int r = 0; r < nr; r++) {
                    const uint8_t *b = W + (g * PK_ROWS + r) * stride + (c / 8) * 144;
                    if (j == 0) memcpy(sb + 2 * r, b, 2), memcpy(sb + 16 + 2 * r, b + 2, 2);
                    int sc, mn;
                    scale_min_k4(b + 4, j, &sc, &mn);
                    dst[r] = (uint8_t)sc, dst[8 + r] = (uint8_t)mn;
                    const uint8_t *qs = b + 16 + (j >> 1) * 32;
                    for (int l = 0; l < 32; l++) u[r][l] = (qs[l] >> (4 * (j & 1))) & 15;
                }
                dst += 16;
            }
            pack_nibbles((const uint8_t(*)[32])u, dst);
        }
    }
    return 0;
}

#if HC_QSIMD
/* The 8 rows' sums over one chunk of sum_i u_r[i] x[i] (nib: the chunk's 4 x 32 packed bytes): u the nibbles, or
 * with `mx` (MXFP4: the nibbles are table indices) their values in MXFP4's table plus 12 (one shuffle: unsigned
 * bytes 0..24, as dpbusd and maddubs take them); Q4_0's and MXFP4's callers subtract 8 (12) times the x sum. */
HC_INLINE __m256i packed_chunk_sums(const uint8_t *nib, const int8_t *xc, const int mx) {
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_add_epi8(_mm_loadu_si128((const __m128i *)MXFP4_KVALUES), _mm_set1_epi8(12)));
    if (HC_VNNI || mx) { /* 32-bit lanes each step (MXFP4's 8 x 2 x 24 x 127 would overflow 16-bit ones) */
        __m256i s32 = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256i p = ld256(nib + 32 * k);
            int32_t x0, x1;
            memcpy(&x0, xc + 4 * k, 4);
            memcpy(&x1, xc + 4 * k + 16, 4);
            __m256i lo = _mm256_and_si256(p, m15), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m15);
            if (mx) lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
            s32 = dot4_acc(s32, lo, _mm256_set1_epi32(x0));
            s32 = dot4_acc(s32, hi, _mm256_set1_epi32(x1));
        }
        return s32;
    }
    __m256i s16 = _mm256_setzero_si256(); /* Q4_0 without VNNI: 16-bit lanes, at most 8 * 2 * 15 * 127 = 30480 */
    for (int k = 0; k < 4; k++) {
        const __m256i p = ld256(nib + 32 * k);
        int32_t x0, x1;
        memcpy(&x0, xc + 4 * k, 4);
        memcpy(&x1, xc + 4 * k + 16, 4);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(p, m15), _mm256_set1_epi32(x0)));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 4), m15),
                                                          _mm256_set1_epi32(x1)));
    }
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}
#endif

#if HC_QSIMD
/* The 8 rows' exact sums over one Q8_0 chunk (v: its 8 x 32 packed values): signed x signed through
 * maddubs, |w| (unsigned) times x with w's sign; |w x + w x| <= 2 * 128 * 127 fits int16. */
HC_INLINE __m256i packed_q8_chunk_sums(const uint8_t *v, const int8_t *xc) {
    __m256i i32 = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i w = ld256(v + 32 * k);
        int32_t xk;
        memcpy(&xk, xc + 4 * k, 4);
        i32 = dot4_acc(i32, _mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(xk), w));
    }
    return i32;
}
#endif
#if HC_QSIMD
/* 8 E8M0 bytes as e8m0_half's floats. */
HC_INLINE __m256 e8m0_half8(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v)));
}
#endif

/* Row r's packed chunk sum, portable. */
HC_INLINE int32_t packed_chunk_sum1(const uint8_t *nib, const int8_t *xc, int r) {
    int32_t s = 0;
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) {
            const uint8_t v = nib[32 * k + 4 * r + j];
            s += (int32_t)(v & 15) * xc[4 * k + j] + (int32_t)(v >> 4) * xc[4 * k + 16 + j];
        }
    return s;
}

/* Row r's exact sum over one Q8_0 chunk, portable. */
HC_INLINE int32_t packed_q8_chunk_sum1(const uint8_t *v, const int8_t *xc, int r) {
    int32_t s = 0;
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 4; j++) s += (int32_t)(int8_t)v[32 * k + 4 * r + j] * xc[4 * k + j];
    return s;
}

/* out[8] = the 8 rows of a Q4_0 or Q8_0 group (Pg: its chunks, 8 fp16 scales then the values) with one
 * token: per chunk each row's exact integer sum (Q4_0: sum (u - 8) x = sum u x - 8 sum x), then
 * (float)sum * (d * dx) accumulated in chunk order. */
HC_INLINE void packed_group_block(const int wt, const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
    const int64_t cb = wt == WT_Q4_0 ? PK_Q4_0_CHUNK : PK_Q8_0_CHUNK;
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * cb;
        const int8_t *xc = x->q + 32 * c;
        const __m256i i32 = wt == WT_Q4_0
                                ? _mm256_sub_epi32(packed_chunk_sums(b + 16, xc, 0), _mm256_set1_epi32(8 * x->qsum[c]))
                                : packed_q8_chunk_sums(b + 16, xc);
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), _mm256_set1_ps(x->d[c]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), d, acc);
    }
    _mm256_storeu_ps(out8, acc);
#else
    float acc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * cb;
        const int8_t *xc = x->q + 32 * c;
        for (int r = 0; r < PK_ROWS; r++) {
            const int32_t s = wt == WT_Q4_0 ? packed_chunk_sum1(b + 16, xc, r) - 8 * x->qsum[c]
                                            : packed_q8_chunk_sum1(b + 16, xc, r);
            acc[r] = fmaf((float)s, h2f(rd16(b + 2 * r)) * x->d[c], acc[r]);
        }
    }
    memcpy(out8, acc, sizeof acc);
#endif
}
/* out[8] = the 8 rows of an MXFP4 group with one token: per chunk each row's exact integer sum, then
 * (float)sum * (e8m0_half(e) * dx) accumulated in chunk order (packed_group_block's arithmetic). */
HC_INLINE void packed_group_mxfp4(const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * PK_MXFP4_CHUNK;
        const __m256i i32 = _mm256_sub_epi32(packed_chunk_sums(b + 8, x->q + 32 * c, 1), _mm256_set1_epi32(12 * x->qsum[c]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_mul_ps(e8m0_half8(b), _mm256_set1_ps(x->d[c])), acc);
    }
    _mm256_storeu_ps(out8, acc);
#else
    float acc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *b = Pg + c * PK_MXFP4_CHUNK, *nib = b + 8;
        const int8_t *xc = x->q + 32 * c;
        for (int r = 0; r < PK_ROWS; r++) {
            int32_t s = 0;
            for (int k = 0; k < 4; k++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t v = nib[32 * k + 4 * r + j];
                    s += (int32_t)MXFP4_KVALUES[v & 15] * xc[4 * k + j] + (int32_t)MXFP4_KVALUES[v >> 4] * xc[4 * k + 16 + j];
                }
            acc[r] = fmaf((float)s, e8m0_half(b[r]) * x->d[c], acc[r]);
        }
    }
    memcpy(out8, acc, sizeof acc);
#endif
}
#if HC_QSIMD
HC_INLINE __m256 cvt8_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* out[8] = the 8 rows of a Q4_K group (Pg: its super-blocks) with one token: per chunk,
 * (float)sum * (d * sc * dx) accumulated, then minus the mins' terms (dmin * mn * dx * sum x). */
HC_INLINE void packed_group_q4_k(const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sb = Pg + sbi * PK_Q4_K_SUPER;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16)));
        for (int j = 0; j < 8; j++) {
            const int64_t c = sbi * 8 + j;
            const uint8_t *b = sb + 32 + j * (16 + 128);
            const __m256i i32 = packed_chunk_sums(b + 16, x->q + 32 * c, 0);
            const __m256 s = _mm256_mul_ps(_mm256_mul_ps(d, cvt8_u8(b)), _mm256_set1_ps(x->d[c]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), s, acc);
            macc = _mm256_fmadd_ps(_mm256_mul_ps(dmin, cvt8_u8(b + 8)), _mm256_set1_ps(x->hc[c]), macc);
        }
    }
    _mm256_storeu_ps(out8, _mm256_sub_ps(acc, macc));
#else
    float acc[PK_ROWS] = {0}, macc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *sb = Pg + (c / 8) * PK_Q4_K_SUPER, *b = sb + 32 + (c & 7) * (16 + 128);
        for (int r = 0; r < PK_ROWS; r++) {
            const float s = h2f(rd16(sb + 2 * r)) * (float)b[r], m = h2f(rd16(sb + 16 + 2 * r)) * (float)b[8 + r];
            acc[r] = fmaf((float)packed_chunk_sum1(b + 16, x->q + 32 * c, r), s * x->d[c], acc[r]);
            macc[r] = fmaf(m, x->hc[c], macc[r]);
        }
    }
    for (int r = 0; r < PK_ROWS; r++) out8[r] = acc[r] - macc[r];
#endif
}

/* Value l of row r in a packed Q6_K chunk (b: the chunk), 0..63. */
HC_INLINE int packed_q6_value(const uint8_t *b, int r, int l) {
    const int half = l >> 4, m = l & 15, k = m >> 2, j = m & 3; /* l = 4k + j + 16 half */
    const uint8_t nib = b[16 + 32 * k + 4 * r + j];
    const int lo = half ? nib >> 4 : nib & 15;
    const int kk = k & 1, which = (k >> 1) * 2 + half; /* value 4kk + j + 8 (k >> 1) + 16 half */
    return lo | (((b[16 + 128 + 32 * kk + 4 * r + j] >> (2 * which)) & 3) << 4);
}

/* out[8] = the 8 rows of a Q6_K group with one token: per half of each chunk, (float)(sum u x - 32 sum x)
 * * (d * scale * dx), accumulated in chunk and half order. */
HC_INLINE void packed_group_q6_k(const uint8_t *Pg, const hc_xq *x, int64_t nc, float *out8) {
#if HC_QSIMD
    __m256 acc = _mm256_setzero_ps();
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int64_t sbi = 0; sbi < nc / 8; sbi++) {
        const uint8_t *sb = Pg + sbi * PK_Q6_K_SUPER;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        for (int j = 0; j < 8; j++) {
            const int64_t c = sbi * 8 + j;
            const uint8_t *b = sb + 16 + j * PK_Q6_K_CHUNK;
            const int8_t *xc = x->q + 32 * c;
            const __m256i h0 = ld256(b + 16 + 128), h1 = ld256(b + 16 + 128 + 32);
            __m256i i32[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int k = 0; k < 4; k++) {
                const __m256i p = ld256(b + 16 + 32 * k), hb = (k & 1) ? h1 : h0;
                const int sh = (k >> 1) * 4;
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(p, m15),
                                                   _mm256_slli_epi16(_mm256_and_si256(srl16(hb, sh), m3), 4));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), m15),
                                                   _mm256_slli_epi16(_mm256_and_si256(srl16(hb, sh + 2), m3), 4));
                int32_t x0, x1;
                memcpy(&x0, xc + 4 * k, 4);
                memcpy(&x1, xc + 4 * k + 16, 4);
                i32[0] = dot4_acc(i32[0], lo, _mm256_set1_epi32(x0));
                i32[1] = dot4_acc(i32[1], hi, _mm256_set1_epi32(x1));
            }
            const __m256 dx = _mm256_set1_ps(x->d[c]);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_sub_epi32(i32[h], _mm256_set1_epi32(32 * x->qhs[2 * c + h]));
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h))));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(_mm256_mul_ps(d, sc), dx), acc);
            }
        }
    }
    _mm256_storeu_ps(out8, acc);
#else
    float acc[PK_ROWS] = {0};
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *sb = Pg + (c / 8) * PK_Q6_K_SUPER, *b = sb + 16 + (c & 7) * PK_Q6_K_CHUNK;
        const int8_t *xc = x->q + 32 * c;
        for (int r = 0; r < PK_ROWS; r++)
            for (int h = 0; h < 2; h++) {
                int32_t sum = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) sum += packed_q6_value(b, r, l) * xc[l];
                sum -= 32 * x->qhs[2 * c + h];
                const float s = h2f(rd16(sb + 2 * r)) * (float)(int8_t)b[8 * h + r];
                acc[r] = fmaf((float)sum, s * x->d[c], acc[r]);
            }
    }
    memcpy(out8, acc, sizeof acc);
#endif
}

/* outs[m] [T, Fs[m]] = x [T, D] @ W_m.T for nmat (1-8) matrices from their packed copies Ps[m] (a
 * layer's q, k, v or an FFN's up and gate): x quantized once, every matrix's groups in one parallel
 * region (work items of 32 rows, claimed in order), each group's result as in a call of its own. With
 * norm_w the matrices multiply hc_rms_norm(x). Returns 0, or -1 (memory, or a type or width with no
 * packed form). */
/* NT tokens (x rows at xt, D apart) against packed block Pb over columns [k0, k1): acc [PKF_V][NT] carried in.
 * The first token tile prefetches its pass's columns into L1 just ahead (up to pf_end); with several tiles, tile
 * `phase` of `every` also asks for every every-th column of the next pass into L2 (up to l2_end), so memory keeps
 * streaming while the later tiles work from L1 (every = 0: none); kseg: the columns of a pass. */
HC_INLINE void pkf_tile(const int BF, const int NT, const uint16_t *Pb, const float *xt, int64_t D, int64_t k0,
                        int64_t k1, vf (*acc)[PKF_T], const uint16_t *pf_end, int64_t every, int64_t phase,
                        const uint16_t *l2_end, int64_t kseg) {
    vf a[PKF_V][PKF_T];
    for (int v = 0; v < PKF_V; v++)
        for (int t = 0; t < NT; t++) a[v][t] = acc[v][t];
    const uint16_t *p = Pb + k0 * PKF_ROWS;
    for (int64_t k = k0; k < k1; k++, p += PKF_ROWS) {
        if (p + PKF_PF < pf_end) /* the block streams from memory once (the first token tile): ahead of it */
            for (int l = 0; l < PKF_ROWS * 2; l += 64) vprefetch((const uint8_t *)(p + PKF_PF) + l);
        if (every && (k - k0) % every == phase && p + kseg * PKF_ROWS < l2_end)
            for (int l = 0; l < PKF_ROWS * 2; l += 64) vprefetch_l2((const uint8_t *)(p + kseg * PKF_ROWS) + l);
        vf w[PKF_V];
        for (int v = 0; v < PKF_V; v++) w[v] = BF ? vload_bf16(p + v * VL) : vload_f16(p + v * VL);
        for (int t = 0; t < NT; t++) {
            const vf xb = vset1(xt[t * D + k]);
            for (int v = 0; v < PKF_V; v++) a[v][t] = vfma(w[v], xb, a[v][t]);
        }
    }
    for (int v = 0; v < PKF_V; v++)
        for (int t = 0; t < NT; t++) acc[v][t] = a[v][t];
}

/* out [T, F] rows [b * PKF_ROWS, +PKF_ROWS) of one packed F16 block: the columns in passes of PKF_KSEG or PKF_KSEG2 (the
 * block's pass stays in L1 for every token tile), each (row, token) one fma chain over the columns in order. */
HC_INLINE void pkf_block(const int BF, const uint16_t *Pb, const float *x, int64_t T, int64_t D, float *out,
                         int64_t F, int64_t b, vf *accs) {
    const int last = (b + 1) * PKF_ROWS >= F; /* the matrix's last block: nothing of its own after it */
    const int64_t ntile = (T + PKF_T - 1) / PKF_T;
    for (int64_t j = 0; j < ntile * PKF_V * PKF_T; j++) accs[j] = vzero();
    /* Two token tiles (T = 7-12 with 512-bit vectors: a batched decode step) take passes of PKF_KSEG2 columns:
     * the second tile re-reads a shorter stretch while the first's prefetches are still landing (measured, 2048 x
     * 2048 F16, 2 threads: T = 8 0.93x the time of 256-column passes, T = 16 0.99x; in the batch-8 step of the 1B
     * synthetic 1.053x the tokens/s). The passes change where the accumulators rest, not the fma chains: the
     * same bits. */
    const int64_t kseg = VL == 16 && ntile == 2 ? PKF_KSEG2 : PKF_KSEG;
    for (int64_t k0 = 0; k0 < D; k0 += kseg) {
        const int64_t k1 = k0 + kseg < D ? k0 + kseg : D;
        for (int64_t i = 0; i < ntile; i++) {
            const int64_t t0 = i * PKF_T, nt = T - t0 < PKF_T ? T - t0 : PKF_T;
            vf(*acc)[PKF_T] = (vf(*)[PKF_T])(accs + i * PKF_V * PKF_T);
            const float *xt = x + t0 * D;
            const uint16_t *pe = i == 0 ? Pb + D * PKF_ROWS : Pb; /* prefetch on the first tile only */
            /* the next pass: this block's next columns, or the next block's first (blocks lie back to back;
             * measured with 2-3 tiles: T=10-16 5-9% faster, a 52-token prompt 2%, T <= 6 has one tile) */
            const int64_t every = ntile > 1 ? ntile : 0;
            const uint16_t *le = Pb + (last ? D : D + kseg) * PKF_ROWS;
            switch (nt) { /* constant counts: registers */
            case 1: pkf_tile(BF, 1, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 2: pkf_tile(BF, 2, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 3: pkf_tile(BF, 3, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
#if PKF_T > 4
            case 4: pkf_tile(BF, 4, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            case 5: pkf_tile(BF, 5, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
#endif
            default: pkf_tile(BF, PKF_T, Pb, xt, D, k0, k1, acc, pe, every, i, le, kseg); break;
            }
        }
    }
    const int64_t r0 = b * PKF_ROWS, nr = F - r0 < PKF_ROWS ? F - r0 : PKF_ROWS;
    for (int64_t t = 0; t < T; t++) {
        vf(*acc)[PKF_T] = (vf(*)[PKF_T])(accs + (t / PKF_T) * PKF_V * PKF_T);
        float o[PKF_ROWS];
        for (int v = 0; v < PKF_V; v++) vstoreu(o + v * VL, acc[v][t % PKF_T]);
        memcpy(out + t * F + r0, o, sizeof(float) * (size_t)nr);
    }
}

/* The packed 16-bit float matrices (F16, BF16) of a hc_packed_matvec_multi call: blocks of all of them handed out
 * as work items. */
static int pkf_multi(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D, const float *x,
                     int64_t T, float *const *outs, int nth) {
    int64_t first[9] = {0};
    for (int m = 0; m < nmat; m++) first[m + 1] = first[m] + (Fs[m] + PKF_ROWS - 1) / PKF_ROWS;
    const int64_t items = first[nmat];
    nth = clamp_threads(nth, items);
    int64_t next = 0;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) reduction(| : failed)
#endif
    {
        /* a decode token's few rows use the stack: no allocation on the hottest path */
        vf local[4 * PKF_V * PKF_T];
        const size_t nacc = (size_t)(((T + PKF_T - 1) / PKF_T) * PKF_V * PKF_T), bytes = sizeof(vf) * nacc;
        vf *accs = nacc <= 4 * PKF_V * PKF_T ? local : (vf *)aligned_alloc(64, (bytes + 63) / 64 * 64);
        failed = accs == NULL;
        for (int64_t it = claim(&next); it < items && accs; it = claim(&next)) {
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int64_t b = it - first[m];
            const uint16_t *Pb = (const uint16_t *)Ps[m] + b * PKF_ROWS * D;
            if (wts[m] == WT_BF16) pkf_block(1, Pb, x, T, D, outs[m], Fs[m], b, accs);
            else pkf_block(0, Pb, x, T, D, outs[m], Fs[m], b, accs);
        }
        if (accs != local) free(accs);
    }
    return failed ? -1 : 0;
}

static int packed_gemm(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                       const float *x, int64_t T, float *const *outs, int nth); /* packed_gemm.c: same bits */

int hc_packed_matvec_multi(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                           const float *x, int64_t T, const float *norm_w, float eps, float *const *outs, int nth) {
    if (nmat < 1 || nmat > 8) return -1;
    int nf16 = 0;
    for (int m = 0; m < nmat; m++) {
        if (!packable(wts[m], D)) return -1;
        nf16 += wts[m] == WT_F16 || wts[m] == WT_BF16;
    }
    if (nf16) { /* the F16 matrices in their own pass (a group mixing them with block types: two passes) */
        const uint8_t *fP[8], *bP[8];
        int64_t fF[8], bF[8];
        float *fo[8], *bo[8];
        int bw[8], fw[8], nb = 0, nf = 0;
        for (int m = 0; m < nmat; m++) {
            if (wts[m] == WT_F16 || wts[m] == WT_BF16) fP[nf] = Ps[m], fF[nf] = Fs[m], fo[nf] = outs[m], fw[nf++] = wts[m];
            else bP[nb] = Ps[m], bF[nb] = Fs[m], bo[nb] = outs[m], bw[nb++] = wts[m];
        }
        float *xn = NULL;
        if (with_norm(&x, norm_w, eps, T, D, &xn) != 0) return -1;
        int rc = pkf_multi(nf, fw, fP, fF, D, x, T, fo, nth);
        if (rc == 0 && nb) rc = hc_packed_matvec_multi(nb, bw, bP, bF, D, x, T, NULL, 0.0f, bo, nth);
        free(xn);
        return rc;
    }
    int64_t first[9] = {0}, gbytes[8], ngs[8], total = 0;
    for (int m = 0; m < nmat; m++) total += (Fs[m] + PK_ROWS - 1) / PK_ROWS;
    /* groups per work item: about HC_PK_ITEMS items a thread (at least 4 groups, 32 rows). Long runs of
     * contiguous rows per item keep the hardware prefetchers' streams going (measured +5-8% over items of
     * 32 rows, 2 threads, DRAM-bound); several items a thread still even out a preempted thread. */
    const int64_t nt = nth > 0 ? nth : 1, per = total / (HC_PK_ITEMS * nt) > 4 ? total / (HC_PK_ITEMS * nt) : 4;
    for (int m = 0; m < nmat; m++) {
        gbytes[m] = hc_packed_nbytes(wts[m], PK_ROWS, D); /* one group */
        ngs[m] = (Fs[m] + PK_ROWS - 1) / PK_ROWS;
        first[m + 1] = first[m] + (ngs[m] + per - 1) / per;
    }
    const int64_t items = first[nmat], nc = D / 32;
    float *xn = NULL;
    if (with_norm(&x, norm_w, eps, T, D, &xn) != 0) return -1;
    const int gemm = packed_gemm(nmat, wts, Ps, Fs, D, x, T, outs, nth); /* a prompt chunk: packed_gemm.c */
    if (gemm != 1) {
        free(xn);
        return gemm;
    }
    hc_xq_set xq = {NULL, NULL};
    if (xq_make(x, T, D, &xq) != 0) {
        free(xn);
        return -1;
    }
    nth = clamp_threads(nth, items);
    int64_t next = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
    {
        for (int64_t it = claim(&next); it < items; it = claim(&next)) {
            int m = 0;
            while (it >= first[m + 1]) m++;
            const int wt = wts[m];
            const int64_t F = Fs[m], ng = ngs[m], g0 = (it - first[m]) * per;
            for (int64_t g = g0; g < ng && g < g0 + per; g++)
                for (int64_t t = 0; t < T; t++) { /* the group stays in L1 for the other tokens */
                    float o[PK_ROWS];
                    const uint8_t *Pg = Ps[m] + g * gbytes[m];
                    if (wt == WT_Q4_0 || wt == WT_Q8_0) packed_group_block(wt, Pg, xq.tok + t, nc, o);
                    else if (wt == WT_Q4_K) packed_group_q4_k(Pg, xq.tok + t, nc, o);
                    else if (wt == WT_MXFP4) packed_group_mxfp4(Pg, xq.tok + t, nc, o);
                    else packed_group_q6_k(Pg, xq.tok + t, nc, o);
                    const int64_t n = F - g * PK_ROWS < PK_ROWS ? F - g * PK_ROWS : PK_ROWS;
                    memcpy(outs[m] + t * F + g * PK_ROWS, o, sizeof(float) * (size_t)n);
                }
        }
    }
    xq_free(&xq);
    free(xn);
    return 0;
}

/* out [T, F] = x [T, D] @ W.T from W's packed copy P: hc_packed_matvec_multi of one matrix. */
int hc_packed_matvec(int wt, const uint8_t *P, int64_t F, int64_t D, const float *x, int64_t T, float *out,
                     int nth) {
    const uint8_t *Ps[1] = {P};
    float *outs[1] = {out};
    return hc_packed_matvec_multi(1, &wt, Ps, &F, D, x, T, NULL, 0.0f, outs, nth);
}

