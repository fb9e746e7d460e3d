/* A planning probe, not project code (benchmark/RESULTS.md, section 23b): Q4_1 weights times
 * activation rows on one thread, weights in L2 (the compute-bound regime of a verify step's
 * rows), two ways:
 *   fp32   as minisgl/kernels/csrc/quant.c's direct path: each weight row's block decoded
 *          through its 16-value table, two accumulators per activation row;
 *   2-digit  weights row-interleaved, 16 rows per `vpdpbusd` lane group (lane i: row i's 4
 *          consecutive codes); each activation block of 32 as a 16-bit code times a scale,
 *          split in two int8 digits (hi signed, lo - 128 signed, its 128 x code sum
 *          precomputed per weight block); int32 sums per block, then scaled by d and m in fp32.
 * Prints GMAC/s at 1-16 activation rows and the largest difference from the fp32 result.
 *
 *     gcc -O3 -march=native -o /tmp/probe benchmark/kernels/probe_two_digit_q4.c -lm && /tmp/probe
 *
 * Needs AVX-512 VNNI. Scales here are fp32 (a real layout would keep GGUF's f16). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>
#define N 3072
#define K 576
#define NB (K / 32)
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static uint8_t q[N][K]; static float d[N][NB], mm[N][NB];
// fp32 path data: Q4_1 blocks as in GGUF: per row per block: d, m (floats here), 16 bytes nibbles
static uint8_t nib[N][NB][16];
// 2-digit path data: per 16-row group, per block: 4 x 64 bytes codes, d[16], m[16], qsum128[16]
typedef struct { uint8_t codes[4][64]; float d[16], m[16]; int32_t qs[16]; } grp_blk;
static grp_blk G[N / 16][NB];
static inline __attribute__((always_inline)) void fp32_rows(const int M, const float* x,
                                                            float* y) {
    const __m512 iota = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
    for (int n = 0; n < N; n++) {
        __m512 a0[16], a1[16];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();
        for (int b = 0; b < NB; b++) {
            __m512 t = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[n][b]), _mm512_set1_ps(mm[n][b]));
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)nib[n][b]));
            __m512 lo = _mm512_permutexvar_ps(c, t);
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * K + 32 * b), a0[m]);
                a1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * K + 32 * b + 16), a1[m]);
            }
        }
        for (int m = 0; m < M; m++)
            y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    }
}
// activations: per row per block: hi[32], lo[32] (int8), s, sx
static int8_t xh[16][K], xl[16][K]; static float xs[16][NB], xsx[16][NB];
static inline __attribute__((always_inline)) void twodig_rows(const int M, float* y) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < N / 16; g++) {
        __m512 acc[16];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < NB; b++) {
            const grp_blk* B = &G[g][b];
            __m512i w[8];
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512(B->codes[p]);
                w[2 * p] = _mm512_and_si512(v, low4);
                w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            const __m512 dv = _mm512_loadu_ps(B->d), mv = _mm512_loadu_ps(B->m);
            const __m512i qs = _mm512_loadu_si512(B->qs);
            for (int m = 0; m < M; m++) {
                const int32_t* h = (const int32_t*)(xh[m] + 32 * b);
                const int32_t* l = (const int32_t*)(xl[m] + 32 * b);
                __m512i ah = _mm512_setzero_si512(), al = qs;
                for (int j = 0; j < 8; j++) {
                    ah = _mm512_dpbusd_epi32(ah, w[j], _mm512_set1_epi32(h[j]));
                    al = _mm512_dpbusd_epi32(al, w[j], _mm512_set1_epi32(l[j]));
                }
                const __m512i tot = _mm512_add_epi32(_mm512_slli_epi32(ah, 8), al);
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xs[m][b]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), scale, acc[m]);
                acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsx[m][b]), acc[m]);
            }
        }
        for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * N + 16 * g, acc[m]);
    }
}
#define WRAP(M) static void fp32_##M(const float* x, float* y) { fp32_rows(M, x, y); } \
    static void twodig_##M(float* y) { twodig_rows(M, y); }
WRAP(1) WRAP(2) WRAP(5) WRAP(8) WRAP(16)
typedef void (*ffn)(const float*, float*); typedef void (*tfn)(float*);
int main(void) {
    srand(1);
    for (int n = 0; n < N; n++) for (int b = 0; b < NB; b++) {
        d[n][b] = 0.001f + (rand() % 1000) * 1e-5f; mm[n][b] = -8 * d[n][b];
        for (int t = 0; t < 32; t++) q[n][32 * b + t] = rand() & 15;
        for (int t = 0; t < 16; t++) nib[n][b][t] = q[n][32 * b + t] | (q[n][32 * b + 16 + t] << 4);
    }
    for (int g = 0; g < N / 16; g++) for (int b = 0; b < NB; b++) {
        grp_blk* B = &G[g][b];
        for (int i = 0; i < 16; i++) {
            int n = 16 * g + i, s = 0;
            B->d[i] = d[n][b]; B->m[i] = mm[n][b];
            for (int t = 0; t < 32; t++) s += q[n][32 * b + t];
            B->qs[i] = 128 * s;
            for (int p = 0; p < 4; p++) for (int t = 0; t < 4; t++)
                B->codes[p][4 * i + t] =
                    q[n][32 * b + 8 * p + t] | (q[n][32 * b + 8 * p + 4 + t] << 4);
        }
    }
    static float x[16 * K], y1[16 * N], y2[16 * N];
    for (int i = 0; i < 16 * K; i++) /* a few outliers, as activations have */
        x[i] = (rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 0 ? 20 : 2);
    for (int m = 0; m < 16; m++) for (int b = 0; b < NB; b++) {
        float mx = 0; for (int t = 0; t < 32; t++) mx = fmaxf(mx, fabsf(x[m * K + 32 * b + t]));
        float s = mx / 32767; if (s == 0) s = 1; int sum = 0;
        for (int t = 0; t < 32; t++) {
            int c = (int)lrintf(x[m * K + 32 * b + t] / s), hi = c >> 8, lo = c - 256 * hi;
            xh[m][32 * b + t] = (int8_t)hi; xl[m][32 * b + t] = (int8_t)(lo - 128); sum += c;
        }
        xs[m][b] = s; xsx[m][b] = s * sum;
    }
    int Ms[] = {1, 2, 5, 8, 16};
    ffn F[] = {fp32_1, fp32_2, fp32_5, fp32_8, fp32_16};
    tfn TT[] = {twodig_1, twodig_2, twodig_5, twodig_8, twodig_16};
    for (int mi = 0; mi < 5; mi++) {
        int M = Ms[mi]; double b1 = 1e9, b2 = 1e9;
        for (int r = 0; r < 30; r++) {
            double t = now(); F[mi](x, y1); b1 = fmin(b1, now() - t);
            t = now(); TT[mi](y2); b2 = fmin(b2, now() - t);
        }
        double err = 0, ref = 0;
        for (int i = 0; i < M * N; i++) {
            err = fmax(err, fabs(y1[i] - y2[i]));
            ref = fmax(ref, fabs(y1[i]));
        }
        double macs = (double)N * K * M;
        printf("M=%2d fp32 %7.1f us (%5.1f GMAC/s)  2-digit %7.1f us (%5.1f GMAC/s)  %.2fx  "
               "max err %.1e of %.1e\n",
               M, b1 * 1e6, macs / b1 / 1e9, b2 * 1e6, macs / b2 / 1e9, b1 / b2, err, ref);
    }
}
