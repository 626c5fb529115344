/* Micro-benchmark of one weight type, one core, L2-resident (256 x 2048): the row kernel (hc_gather_matvec)
 * against the packed GEMV (hc_packed_matvec), min of 3000 calls, and their largest difference.
 *   cc -O3 -march=native -fopenmp -std=gnu11 -Wno-psabi -ffp-contract=off -DWTYPE=WT_Q4_K -DSBYTES=1152 \
 *      -DBV=256 -DBB=144 -DDOFF=0 -o /tmp/packed_micro benchmarks/packed_micro.c -lm && /tmp/packed_micro
 * (Q4_0: -DWTYPE=WT_Q4_0 -DSBYTES=1152 -DBV=32 -DBB=18 -DDOFF=0; Q8_0: -DWTYPE=WT_Q8_0 -DSBYTES=2176 -DBV=32
 * -DBB=34 -DDOFF=0; Q6_K: -DWTYPE=WT_Q6_K -DSBYTES=1680 -DBV=256
 * -DBB=210 -DDOFF=208: row bytes, values and bytes per block, offset of the block scale.) */
#include "../src/hotcold/kernels/_cpu_kernels.c"
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
    const int64_t F = 256, D = 2048, stride = SBYTES;
    float *x = malloc(4 * D * 4), *o1 = malloc(4 * F * 4), *o2 = malloc(4 * F * 4);
    for (int i = 0; i < 4 * D; i++) x[i] = (float)((i * 7919) % 200 - 100) / 50.0f;
    uint8_t *W = malloc(F * stride);
    for (int64_t i = 0; i < F * stride; i++) W[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int64_t r = 0; r < F; r++) for (int64_t c = 0; c < D / BV; c++) { W[r * stride + c * BB + DOFF] = 0; W[r * stride + c * BB + DOFF + 1] = 0x20 + (r % 7); W[r * stride + c * BB + 2] = 0; W[r * stride + c * BB + 3] = 0x20; }
    uint8_t *P = malloc(hc_packed_nbytes(WTYPE, F, D));
    hc_pack(WTYPE, W, stride, F, D, P);
    for (int T = 1; T <= 4; T *= 4) {
        double b1 = 1e9, b2 = 1e9;
        for (int r = 0; r < 3000; r++) {
            double t0 = now(); hc_gather_matvec(WTYPE, W, stride, F, D, x, T, NULL, o1, 1); double t1 = now();
            hc_packed_matvec(WTYPE, P, F, D, x, T, o2, 1); double t2 = now();
            if (t1 - t0 < b1) b1 = t1 - t0; if (t2 - t1 < b2) b2 = t2 - t1;
        }
        double md = 0, mx = 0;
        for (int i = 0; i < T * F; i++) { double d = fabs(o1[i] - o2[i]); if (d > md) md = d; if (fabs(o1[i]) > mx) mx = fabs(o1[i]); }
        printf("T=%d row %.1f us (%.2f Gw/s)  packed %.1f us (%.2f Gw/s)  max|diff| %.3g of max %.3g\n", T, b1 * 1e6, T * F * D / b1 / 1e9, b2 * 1e6, T * F * D / b2 / 1e9, md, mx);
    }
    return 0;
}
