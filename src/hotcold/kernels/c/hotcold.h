/* hotcold's C kernels: what Python calls. Every exported function and every struct it takes is declared here
 * and only here: kernels/cabi.py reads this file to bind them through ctypes (argument types, return types and
 * the structs' ctypes layouts), and the compiler checks each definition in the pieces against its prototype
 * (this header is included before them). The comments at the definitions say what each call computes.
 *
 * Kept to a form cabi.py parses: one declaration per statement, types from the list in cabi.py (int, int64_t,
 * int32_t, float, double, uint8_t, char, void, the structs below, pointers to them), fixed-size arrays in structs. */
#ifndef HOTCOLD_H
#define HOTCOLD_H
#include <stdint.h>

#define HC_ABI_VERSION 37 /* the library's calling convention; cabi.py reads it and refuses another library */

/* One [rows, cols] matrix as the kernels read it: weight type code (build.WT), rows at data + i * stride. */
typedef struct {
    int wt;
    const uint8_t *data; /* row i at data + i * stride */
    int64_t stride, rows, cols;
    const uint8_t *packed; /* the packed GEMV copy (hc_pack) or NULL */
} hc_weight;

/* The input rule of an input-sparse score (sparsify --gate-probe inputs): channel i of a token's FFN input
 * is kept iff |h_i| (times scale[i] if scale) > thr. */
typedef struct {
    const float *scale;
    float thr;
} hc_in_rule;

/* One layer of a llama-family decode token, for hc_decode_step: the arguments of its hc_decode_head
 * call (q/k/v group, attention norm, the sequence's KV cache of this layer, RoPE) and of its tail
 * (hc_decode_tail with a predictor, or hc_dense_tail). */
typedef struct hc_layer {
    int wts[3];
    const uint8_t *Ws[3];
    int64_t strides[3], Fs[3];
    int packed;
    const float *attn_norm;
    float attn_eps;
    float *kc, *vc;
    int64_t H, Hkv, Dh, R;
    int neox;
    int64_t window;
    const hc_weight *wo, *fc1, *fc2, *up, *gate, *down;
    float thr;
    int sparse;    /* 1: hc_decode_tail (fc1, fc2, thr, down = down_t), 2: hc_thresholded_tail (score, scale,
                      thr, gate NULL or the exact gate, down = down_t), 0: hc_dense_tail */
    int down_is_t; /* dense tail: down is down_t [F, D] */
    const float *up_bias;
    int kind, act;
    const float *ffn_norm;
    float ffn_eps;
    const hc_weight *score; /* thresholded tail: the score matrix (probe or gate), per-neuron weights or NULL */
    const float *scale;
    /* thresholded layers with input-sparse attention (else NULL): q/k/v as hc_input_sparse_matvec over
     * qkv_t [D, q + k + v] of the normed x, o over wo_t [H * Dh, D] of the attention output */
    const hc_weight *qkv_t, *wo_t;
    const float *qkv_scale, *wo_scale;
    float qkv_thr, wo_thr;
    const hc_in_rule *score_in; /* thresholded tail: an input-sparse score (score is gate_t), or NULL */
    /* LayerNorm families, biases and a parallel residual (falcon, opt); 0 / NULL for llama layers */
    int attn_ln, ffn_ln;      /* the norm is a LayerNorm (bias attn_norm_b / ffn_norm_b, or NULL), not RMS */
    const float *attn_norm_b, *ffn_norm_b;
    const float *q_bias, *k_bias, *v_bias, *wo_bias, *down_bias; /* or NULL */
    int parallel;             /* the FFN reads the layer input x (x + attn + ffn), not the residual after attention */
    /* a mixture of experts (mixtral): the router [E, D] and each expert's FFN (kind, act, sparse and down_is_t as
     * above, up = expert 0's up); route_out [n_used]: this sequence's experts of its last decode token */
    const hc_weight *router;
    int64_t n_expert, n_used;
    const hc_weight *const *e_up, *const *e_gate, *const *e_down, *const *e_fc1, *const *e_fc2;
    const float *e_thr;
    int64_t *route_out;
    /* per-head RMS norms of q and k [Dh] (qwen3), or NULL */
    const float *q_norm, *k_norm;
    float qk_eps;
    /* gemma3: RMS norms on attention's and the FFN's output before each add [D] (or NULL), RoPE from the local
     * tables (cos_l / sin_l of hc_decode_step) */
    const float *attn_post_norm, *ffn_post_norm;
    float post_eps;
    int local_rope;
    /* smallthinker: the router on the layer's raw input x before attention (early_router), sigmoid gating (1) or
     * softmax (0), and ReLU-gated experts computed over their live rows (relu_rows: relu_rows_ffn) */
    int early_router, gating, relu_rows;
    /* gemma: q times q_scale after its norms (query_pre_attn_scalar; 0: none), attention scores soft-capped at
     * attn_softcap (Gemma 2; 0: none) */
    float q_scale, attn_softcap;
    /* gpt-oss: attention sinks [H], the router's bias [E], each expert's up / gate [F] and down [D] biases (or NULL;
     * the experts' kind 3 is the clamped SwiGLU) */
    const float *sinks, *router_bias;
    const float *const *e_up_bias, *const *e_gate_bias, *const *e_down_bias;
} hc_layer;

/* the library */
int hc_abi_version(void);
const char *hc_simd(void);

/* products of weight rows with tokens (row_calls.c, packed.c) and dequantization */
int hc_gather_matvec(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, const float *x, int64_t T,
                     const uint8_t *mask, float *out, int nth);
int hc_matvec_multi(int nmat, const int *wts, const uint8_t *const *Ws, const int64_t *strides, const int64_t *Fs,
                    int64_t D, const float *x, int64_t T, const float *norm_w, float eps, float *const *outs, int nth);
int hc_sparse_axpy(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, const float *a, int64_t T,
                   const uint8_t *mask, float *out, int nth);
int hc_dequantize(int wt, const uint8_t *W, int64_t stride, const int32_t *rows, int64_t n, int64_t D, float *out,
                  int nth);
int64_t hc_packed_nbytes(int wt, int64_t F, int64_t D);
int hc_pack(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, uint8_t *P);
int hc_packed_matvec_multi(int nmat, const int *wts, const uint8_t *const *Ps, const int64_t *Fs, int64_t D,
                           const float *x, int64_t T, const float *norm_w, float eps, float *const *outs, int nth);
int hc_packed_matvec(int wt, const uint8_t *P, int64_t F, int64_t D, const float *x, int64_t T, float *out, int nth);

/* FFN steps and decode tails (ffn.c) */
int64_t hc_sparse_ffn(const hc_weight *fc1, const hc_weight *fc2, float thr, const float *p, const hc_weight *up,
                      const hc_weight *gate, const hc_weight *down_t, const float *up_bias, int kind, int64_t T,
                      const float *x, const float *norm_w, float eps, uint8_t *mask, float *out, int nth);
int64_t hc_decode_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *fc1,
                       const hc_weight *fc2, float thr, const hc_weight *up, const hc_weight *gate,
                       const hc_weight *down_t, const float *up_bias, int kind, int64_t T, const float *norm_w,
                       float eps, uint8_t *mask, float *y1, float *y2, int nth);
void hc_ffn_combine(int kind, int act, const float *u, const float *g, const float *up_bias, const float *gate_bias,
                    int64_t T, int64_t F, float *a, int nth);
int hc_dense_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *up, const hc_weight *gate,
                  const hc_weight *down, int down_is_t, const float *up_bias, int kind, int act, int64_t T,
                  const float *norm_w, float eps, float *y1, float *y2, int nth);
int64_t hc_thresholded_ffn(const hc_weight *score, const hc_in_rule *score_in, const float *scale, float thr,
                           int act_fn, const hc_weight *up, const hc_weight *gate, const hc_weight *down_t, int64_t T,
                           const float *x, const float *norm_w, float eps, uint8_t *mask, float *out, int nth);
int64_t hc_thresholded_tail(const hc_weight *wo, const float *attn, const float *x, const hc_weight *score,
                            const hc_in_rule *score_in, const float *scale, float thr, int act_fn,
                            const hc_weight *up, const hc_weight *gate, const hc_weight *down_t, int64_t T,
                            const float *norm_w, float eps, uint8_t *mask, float *y1, float *y2, int nth);

/* decode layers and steps (decode.c) */
int hc_decode_head(int nmat, const int *wts, const uint8_t *const *Ws, const int64_t *strides, const int64_t *Fs,
                   int packed, int64_t D, const float *x, const float *norm_w, float eps, float *const *qkv,
                   float *kc, float *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                   const float *sin, int neox, int64_t window, float *out, int nth);
void hc_moe_route(const float *logits, int64_t T, int64_t E, int64_t K, int gating, int64_t *ids, float *weights);
int hc_decode_step(int n, int64_t N, const hc_layer *const *Ls, float *x, int64_t D, const int64_t *pos,
                   const float *cos, const float *sin, const float *cos_l, const float *sin_l, int64_t *const *fired,
                   int nth);

/* norms and attention (norm_attention.c, prefill_attention.c) */
void hc_rms_norm(const float *x, const float *w, float eps, int64_t T, int64_t D, float *out);
void hc_layer_norm(const float *x, const float *w, const float *b, float eps, int64_t T, int64_t D, float *out);
int hc_attn_decode_rows(int64_t N, float *q, float *k, const float *v, float *const *kcs, float *const *vcs,
                        const int64_t *pos, int64_t H, int64_t Hkv, int64_t Dh, int64_t R, const float *cos,
                        const float *sin, int neox, int64_t window, float softcap, const float *sinks, float *out,
                        int nth);
int hc_attn_prefill(int64_t T, const float *q, const float *kc, const float *vc, int64_t pos, int64_t H, int64_t Hkv,
                    int64_t Dh, float *out, int nth);

/* the output head's screen (screen.c) */
int hc_screen_q8_0(int wt, const uint8_t *W, int64_t stride, int64_t F, int64_t D, uint8_t *Q, float *err,
                   float *qnorm, int nthreads);
int64_t hc_screen_select(int64_t T, int64_t V, const float *s, const double *err, const double *qnorm,
                         const double *a, const double *c, int64_t top, const int64_t *keep, const int64_t *koff,
                         uint8_t *mask, int nth);

/* sizeof of the structs above (0: hc_weight, 1: hc_in_rule, 2: hc_layer; -1 otherwise): cabi.py checks its
 * layouts against the compiler's */
int64_t hc_struct_size(int which);

#endif
