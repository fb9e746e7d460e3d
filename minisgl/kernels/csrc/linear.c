/* linear: y[M, N] = x[M, K] @ W^T (+ bias), W packed in column panels (or GGUF blocks: quant.c).
 *
 * W is packed as panels [ceil(N / NB), K, NB]: panel p holds output columns p*NB .. p*NB+NB-1
 * for every k, zero-padded past N (minisgl/kernels/cpu.py packs it). A tile multiplies `rows`
 * rows of x by one panel: the panel streams from memory once, front to back, while 2 * rows
 * vector accumulators stay in registers. At M = 1 that is a pure read stream of the weights
 * (bandwidth-bound); from M ~ 8 on it is bound by fused multiply-adds. A work item is one panel
 * times a chunk of up to MC rows. */
#include <stdlib.h>

#include "common.h"


static inline void store_tile_row(float* y, vf a0, vf a1, const float* bias, int64_t ncols) {
    if (bias) {
        float b[NB] = {0};
        memcpy(b, bias, (size_t)ncols * sizeof(float));
        a0 += vload(b);
        a1 += vload(b + VW);
    }
    if (ncols == NB) {
        vstore(y, a0);
        vstore(y + VW, a1);
        return;
    }
    float t[NB];
    vstore(t, a0);
    vstore(t + VW, a1);
    memcpy(y, t, (size_t)ncols * sizeof(float));
}

#define DEFINE_TILE(R)                                                                          \
    static void tile_##R(const float* x, int64_t ldx, const float* panel, int64_t K,           \
                         const float* bias, float* y, int64_t ldy, int64_t ncols) {            \
        vf a0[R], a1[R];                                                                        \
        for (int m = 0; m < R; m++) a0[m] = a1[m] = (vf){0};                                    \
        for (int64_t k = 0; k < K; k++) {                                                       \
            const vf b0 = vload(panel + k * NB), b1 = vload(panel + k * NB + VW);               \
            for (int m = 0; m < R; m++) {                                                       \
                const float xs = x[m * ldx + k];                                                \
                a0[m] += b0 * xs;                                                               \
                a1[m] += b1 * xs;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < R; m++) store_tile_row(y + m * ldy, a0[m], a1[m], bias, ncols);     \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
#if MR > 6
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)
#endif

typedef void (*tile_fn)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                        int64_t);
static const tile_fn tiles[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
                                      tile_7, tile_8, tile_9, tile_10, tile_11, tile_12
#endif
};

/* Rows split into tiles of equal size (up to MR): each tile reads the panel once (the first from
 * memory, the rest from cache), and a tile of a few rows is bound by the latency of its 2 * R
 * accumulator chains, so 5 rows in one tile of 5 take about what 4 do (as 4 + 1: 1.4x that). */
void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const float* panel,
                      int64_t K, const float* bias, float* y, int64_t ldy, int64_t ncols) {
    while (rows > 0) {
        const int64_t count = (rows + MR - 1) / MR, R = (rows + count - 1) / count; /* tiles left */
        tiles[R](x, ldx, panel, K, bias, y, ldy, ncols);
        x += R * ldx, y += R * ldy, rows -= R;
    }
}

int64_t linear_items(const linear_args* a) {
    if (a->w->num_segments) return quant_items(a);
    return ((a->N + NB - 1) / NB) * ((a->M + MC - 1) / MC);
}

/* A few chunks per thread: a thread that another process preempts hands its remaining panels
 * to the others instead of holding up the whole op. */
int64_t linear_chunk(const linear_args* a, int nthreads) {
    return max64(1, linear_items(a) / ((int64_t)nthreads * 4));
}

void linear_range(const void* args, int64_t begin, int64_t end) {
    const linear_args* a = args;
    if (a->w->num_segments) {
        quant_range(args, begin, end);
        return;
    }
    const float* packed = a->w->data;
    const int64_t num_panels = (a->N + NB - 1) / NB;
    for (int64_t item = begin; item < end; item++) {
        const int64_t p = item % num_panels, m0 = (item / num_panels) * MC;
        const int64_t n0 = p * NB;
        rows_times_panel(a->x + m0 * a->ldx, a->ldx, min64(MC, a->M - m0),
                         packed + p * a->K * NB, a->K, a->bias ? a->bias + n0 : 0,
                         a->y + m0 * a->ldy + n0, a->ldy, min64(NB, a->N - n0));
    }
}

int mg_block_n(void) { return NB; }

int64_t linear_tags(int64_t count) {
    static atomic_llong next = 1;
    return atomic_fetch_add(&next, count);
}

void mg_linear(const float* x, int64_t ldx, const mg_weight* w, const float* bias, float* y,
               int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
    linear_args a = {x, ldx, w, bias, y, ldy, M, K, N, linear_tags(1), 0};
    float* rounded = quant_round_x(&a, nthreads);
    if (rounded) a.x = rounded, a.ldx = K, a.x_rounded = 1;
    run_parallel(&a, linear_range, linear_items(&a), linear_chunk(&a, nthreads), nthreads);
    free(rounded);
}
