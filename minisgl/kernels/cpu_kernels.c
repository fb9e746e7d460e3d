/* minisgl's fp32 CPU kernels: built at first use by minisgl/kernels/cpu.py (gcc -O3
 * -march=native -fopenmp), called through ctypes with raw pointers. No torch headers, so the
 * build takes a second or two and needs nothing beyond a C compiler.
 *
 * Why they exist: at decode batch sizes torch's CPU matmuls (MKL) stream the weights at a third
 * of the machine's read bandwidth, and a layer's small elementwise ops cost more in dispatch
 * than in arithmetic. Here the weights are stored pre-packed in column panels that one thread
 * reads front to back (see mg_linear), and each op a layer needs is one call.
 *
 * Every kernel computes in fp32 with the same formulas as the torch reference ops (only the
 * summation order and fused multiply-adds differ), and none depends on the thread count for its
 * result: work is split by output element, never inside one sum.
 *
 * The OpenMP runtime is the one torch already loaded (same soname), so these kernels share
 * torch's thread pool; the caller passes torch's thread count explicitly.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Bumped whenever a signature changes, so a stale cached build is never called. */
#define MG_ABI_VERSION 5

/* Vector width in floats. GCC vector extensions compile to AVX-512, AVX2 or SSE/NEON. */
#if defined(__AVX512F__)
#define VW 16
#define MR 12 /* rows per GEMM tile: 2*MR accumulators + 2 panel vectors fit 32 registers */
#elif defined(__AVX__)
#define VW 8
#define MR 6 /* 16 registers */
#else
#define VW 4
#define MR 6
#endif
#define NB (2 * VW) /* panel width: output columns per packed panel */
#define MC (8 * MR) /* rows of x per work item of the GEMM */
#define ATTN_TILE 64 /* KV positions per online-softmax tile */
#define ATTN_SPLIT 512 /* KV positions per work item: longer sequences split across threads */
#define ATTN_MAX_HEADS 128 /* query heads (on this rank) */
#define ATTN_MAX_GROUP_CHUNK 4 /* query heads of one KV head computed together */
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_PREFETCH 8 /* K rows fetched this many positions ahead (latency-bound otherwise) */

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float s) { return (vf){0} + s; }
/* Horizontal sum as a tree of half-swaps (log2(VW) shuffles, not VW dependent adds). */
static inline float vsum(vf v) {
#if VW == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif VW == 8
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#else
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2});
#endif
    return v[0];
}
/* Lane-wise select (C has no vector ?:): comparisons give all-ones / all-zeros lanes. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmin(vf a, vf b) { return vselect(a < b, a, b); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp(x) for a vector: Cephes' expf (range reduction by ln 2, degree-6 polynomial), within
 * about 1 ulp of libm. Inputs are clamped to where the result is a normal float. */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vsplat(-87.3365447505531f)), vsplat(88.3762626647949f));
    const vf round_magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504088896341f + round_magic) - round_magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sexp(float x) {
    float lanes[VW] = {x};
    vf v = vexp(vload(lanes));
    return v[0];
}

int mg_abi_version(void) { return MG_ABI_VERSION; }
int mg_block_n(void) { return NB; }

/* ---- linear: y[M, N] = x[M, K] @ W^T (+ bias) ------------------------------------------------
 * W is packed as panels [ceil(N / NB), K, NB]: panel p holds output columns p*NB .. p*NB+NB-1
 * for every k, zero-padded past N. A tile multiplies `rows` rows of x by one panel: the panel
 * streams from memory once, front to back, while 2*rows vector accumulators stay in registers.
 * At M = 1 this is a pure read stream of the weights (bandwidth-bound); from M ~ 8 on it is
 * bound by fused multiply-adds. */
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
DEFINE_TILE(MR)
DEFINE_TILE(4)
DEFINE_TILE(3)
DEFINE_TILE(2)
DEFINE_TILE(1)

static void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const float* panel,
                             int64_t K, const float* bias, float* y, int64_t ldy, int64_t ncols) {
    while (rows >= MR) {
        tile_MR(x, ldx, panel, K, bias, y, ldy, ncols);
        x += MR * ldx, y += MR * ldy, rows -= MR;
    }
    while (rows >= 4) {
        tile_4(x, ldx, panel, K, bias, y, ldy, ncols);
        x += 4 * ldx, y += 4 * ldy, rows -= 4;
    }
    if (rows == 3) tile_3(x, ldx, panel, K, bias, y, ldy, ncols);
    if (rows == 2) tile_2(x, ldx, panel, K, bias, y, ldy, ncols);
    if (rows == 1) tile_1(x, ldx, panel, K, bias, y, ldy, ncols);
}

void mg_linear(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
               int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
    const int64_t num_panels = (N + NB - 1) / NB;
    const int64_t num_row_chunks = (M + MC - 1) / MC;
    const int64_t items = num_panels * num_row_chunks;
    /* Dynamic chunks (a few per thread): a thread that another process preempts hands its
     * remaining panels to the others instead of holding up the whole call. */
    int64_t chunk = items / ((int64_t)nthreads * 4);
    if (chunk < 1) chunk = 1;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(nthreads) if (nthreads > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t p = item % num_panels, rc = item / num_panels;
        const int64_t m0 = rc * MC, rows = M - m0 < MC ? M - m0 : MC;
        const int64_t n0 = p * NB, ncols = N - n0 < NB ? N - n0 : NB;
        rows_times_panel(x + m0 * ldx, ldx, rows, packed + p * K * NB, K, bias ? bias + n0 : 0,
                         y + m0 * ldy + n0, ldy, ncols);
    }
}

/* ---- RMSNorm ---------------------------------------------------------------------------------
 * out = weight * (r * rsqrt(mean(r^2) + eps)), r = x, or r = x + residual (then written back to
 * residual: the fused residual add). Rows may be heads within tokens: row (t, h) starts at
 * t * ldx + h * H (heads = 1 for plain rows). */
static void rmsnorm_row(const float* x, float* residual, const float* w, float* out, int64_t H,
                        float eps) {
    vf acc = (vf){0};
    float tail = 0.0f;
    int64_t i = 0;
    if (residual) {
        for (; i + VW <= H; i += VW) {
            vf r = vload(x + i) + vload(residual + i);
            vstore(residual + i, r);
            acc += r * r;
        }
        for (; i < H; i++) {
            residual[i] = x[i] + residual[i];
            tail += residual[i] * residual[i];
        }
        x = residual;
    } else {
        for (; i + VW <= H; i += VW) {
            vf r = vload(x + i);
            acc += r * r;
        }
        for (; i < H; i++) tail += x[i] * x[i];
    }
    const float inv = 1.0f / sqrtf((vsum(acc) + tail) / (float)H + eps);
    for (i = 0; i + VW <= H; i += VW) vstore(out + i, (vload(x + i) * inv) * vload(w + i));
    for (; i < H; i++) out[i] = (x[i] * inv) * w[i];
}

void mg_rmsnorm(const float* x, int64_t ldx, int64_t heads, float* residual, int64_t ldr,
                const float* w, float* out, int64_t ldo, int64_t T, int64_t H, float eps,
                int nthreads) {
    const int64_t rows = T * heads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && rows >= 8)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t t = row / heads, h = row % heads;
        rmsnorm_row(x + t * ldx + h * H, residual ? residual + t * ldr : 0, w,
                    out + t * ldo + h * H, H, eps);
    }
}

/* ---- SiLU and multiply: out[m, i] = silu(gu[m, i]) * gu[m, I + i] ---------------------------
 * silu(g) = g / (1 + exp(-g)), the formula torch's CPU kernel uses. */
void mg_silu_mul(const float* gu, int64_t ldg, float* out, int64_t ldo, int64_t M, int64_t I,
                 int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && M >= 4)
    for (int64_t m = 0; m < M; m++) {
        const float* g = gu + m * ldg;
        const float* u = g + I;
        float* o = out + m * ldo;
        int64_t i = 0;
        for (; i + VW <= I; i += VW) {
            vf gv = vload(g + i);
            vstore(o + i, gv / (1.0f + vexp(-gv)) * vload(u + i));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
    }
}

/* ---- rotary embedding, in place (neox layout: rotate halves) ---------------------------------
 * x * cos + rotate_half(x) * sin with cos/sin rows of the position ([max_pos, D], halves
 * repeated), for q heads [T, hq, D] and k heads [T, hk, D] with token strides ldq / ldk. */
static void rope_heads(float* x, int64_t heads, int64_t D, const float* c, const float* s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++, x += D) {
        int64_t i = 0;
        for (; i + VW <= half; i += VW) {
            vf x1 = vload(x + i), x2 = vload(x + half + i);
            vstore(x + i, x1 * vload(c + i) - x2 * vload(s + i));
            vstore(x + half + i, x2 * vload(c + half + i) + x1 * vload(s + half + i));
        }
        for (; i < half; i++) {
            const float x1 = x[i], x2 = x[half + i];
            x[i] = x1 * c[i] - x2 * s[i];
            x[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
    }
}

void mg_rope(float* q, int64_t ldq, int64_t hq, float* k, int64_t ldk, int64_t hk, int64_t T,
             int64_t D, const int64_t* positions, const float* cos_cache, const float* sin_cache,
             int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos_cache + positions[t] * D;
        const float* s = sin_cache + positions[t] * D;
        rope_heads(q + t * ldq, hq, D, c, s);
        rope_heads(k + t * ldk, hk, D, c, s);
    }
}

/* ---- KV store: row t of k and v goes to slot slots[t] of the layer's caches ([slots, width]) */
void mg_store_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, float* k_cache,
                 float* v_cache, const int64_t* slots, int64_t T, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * width, k + t * ldk, (size_t)width * sizeof(float));
        memcpy(v_cache + slots[t] * width, v + t * ldv, (size_t)width * sizeof(float));
    }
}

/* ---- decode attention straight from the paged pool -------------------------------------------
 * Decode i (one query token at query row q_rows[i], or i when q_rows is NULL) attends to
 * positions [0, kv_lens[i]) of table row table_rows[i]; position j's K/V sit at slot
 * page_table[row * ld_pt + j] of k_cache / v_cache ([slots, hk, D]).
 *
 * Work items are (decode, range of up to ATTN_SPLIT positions): a long sequence spreads over
 * the threads, and since the split depends only on the sequence's own length, its result does
 * not depend on the batch or the thread count. An item reads each position's whole K/V row (all
 * KV heads: contiguous memory) and computes every query head: softmax online over tiles of
 * ATTN_TILE positions (running max and sum), partial results merged per decode at the end. */
static inline void axpy(float* y, float a, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vload(y + i) + vload(x + i) * a);
    for (; i < n; i++) y[i] += x[i] * a;
}

static inline void prefetch_row(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

/* Online-softmax update of `heads` rows of tile scores [.][ATTN_TILE] (n valid): turns them into
 * exponentials, folds the tile into the running max / sum, and returns through `correction`
 * the factor each head's accumulator must be scaled by first. */
static inline void softmax_tile(float (*scores)[ATTN_TILE], int64_t heads, int64_t n,
                                float* part_max, float* part_sum, float* correction) {
    for (int64_t j = 0; j < heads; j++) {
        float tile_max = -INFINITY;
        for (int64_t t = 0; t < n; t++) tile_max = fmaxf(tile_max, scores[j][t]);
        const float new_max = fmaxf(part_max[j], tile_max);
        correction[j] = part_max[j] == -INFINITY ? 1.0f : sexp(part_max[j] - new_max);
        part_max[j] = new_max;
        int64_t t = 0;
        vf sum = (vf){0};
        for (; t + VW <= n; t += VW) {
            vf p = vexp(vload(&scores[j][t]) - new_max);
            vstore(&scores[j][t], p);
            sum += p;
        }
        float tail = 0.0f;
        for (; t < n; t++) {
            scores[j][t] = sexp(scores[j][t] - new_max);
            tail += scores[j][t];
        }
        part_sum[j] = part_sum[j] * correction[j] + vsum(sum) + tail;
    }
}

/* Unnormalized attention of GC query heads q ([GC, D]) that share one KV head (at kv_offset in
 * each K/V row) over positions [begin, end): per head the running max (part_max), the sum of
 * exponentials (part_sum) and the exponential-weighted sum of V (part_acc, [GC, D]). Every K/V
 * vector loaded serves all GC heads. Inlined into copies for constant GC and common D (see
 * attend_heads), so queries, dot products and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_heads_impl(
    const float* q, const float* k_cache, const float* v_cache, const int32_t* slots,
    int64_t begin, int64_t end, int64_t row_width, int64_t kv_offset, const int64_t GC,
    const int64_t D, float scale, float* part_max, float* part_sum, float* part_acc) {
    const int64_t vecs = D / VW, tail_start = vecs * VW;
    float scores[ATTN_MAX_GROUP_CHUNK][ATTN_TILE];
    float correction[ATTN_MAX_GROUP_CHUNK];
    const float* keys[ATTN_TILE];
    const float* values[ATTN_TILE];
    vf qv[ATTN_MAX_GROUP_CHUNK][ATTN_MAX_HEAD_DIM / VW];
    for (int64_t j = 0; j < GC; j++) {
        part_max[j] = -INFINITY;
        part_sum[j] = 0.0f;
        memset(part_acc + j * D, 0, (size_t)D * sizeof(float));
        for (int64_t c = 0; c < vecs; c++) qv[j][c] = vload(q + j * D + c * VW) * scale;
    }
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_TILE) {
        const int64_t n = end - t0 < ATTN_TILE ? end - t0 : ATTN_TILE;
        for (int64_t t = 0; t < n; t++) {
            keys[t] = k_cache + (int64_t)slots[t0 + t] * row_width + kv_offset;
            values[t] = v_cache + (int64_t)slots[t0 + t] * row_width + kv_offset;
        }
        for (int64_t t = 0; t < n; t++) {
            if (t + ATTN_PREFETCH < n) prefetch_row(keys[t + ATTN_PREFETCH], D);
            const float* key = keys[t];
            vf dot[ATTN_MAX_GROUP_CHUNK];
            for (int64_t j = 0; j < GC; j++) dot[j] = (vf){0};
            for (int64_t c = 0; c < vecs; c++) {
                const vf kv = vload(key + c * VW);
                for (int64_t j = 0; j < GC; j++) dot[j] += qv[j][c] * kv;
            }
            for (int64_t j = 0; j < GC; j++) {
                float tail = 0.0f;
                for (int64_t i = tail_start; i < D; i++) tail += q[j * D + i] * scale * key[i];
                scores[j][t] = vsum(dot[j]) + tail;
            }
        }
        for (int64_t t = 0; t < n && t < ATTN_PREFETCH; t++) prefetch_row(values[t], D);
        softmax_tile(scores, GC, n, part_max, part_sum, correction);
        vf av[ATTN_MAX_GROUP_CHUNK][ATTN_MAX_HEAD_DIM / VW];
        for (int64_t j = 0; j < GC; j++) {
            float* acc = part_acc + j * D;
            for (int64_t c = 0; c < vecs; c++) av[j][c] = vload(acc + c * VW) * correction[j];
            for (int64_t i = tail_start; i < D; i++) acc[i] *= correction[j];
        }
        for (int64_t t = 0; t < n; t++) {
            if (t + ATTN_PREFETCH < n) prefetch_row(values[t + ATTN_PREFETCH], D);
            const float* value = values[t];
            for (int64_t c = 0; c < vecs; c++) {
                const vf vv = vload(value + c * VW);
                for (int64_t j = 0; j < GC; j++) av[j][c] += vv * scores[j][t];
            }
            for (int64_t j = 0; j < GC; j++)
                for (int64_t i = tail_start; i < D; i++) part_acc[j * D + i] += value[i] * scores[j][t];
        }
        for (int64_t j = 0; j < GC; j++)
            for (int64_t c = 0; c < vecs; c++) vstore(part_acc + j * D + c * VW, av[j][c]);
    }
}

#define ATTEND_HEADS_FOR_D(GC_VALUE)                                                            \
    do {                                                                                        \
        if (D == 64)                                                                            \
            attend_heads_impl(q, k_cache, v_cache, slots, begin, end, row_width, kv_offset,     \
                              GC_VALUE, 64, scale, part_max, part_sum, part_acc);               \
        else if (D == 128)                                                                      \
            attend_heads_impl(q, k_cache, v_cache, slots, begin, end, row_width, kv_offset,     \
                              GC_VALUE, 128, scale, part_max, part_sum, part_acc);              \
        else                                                                                    \
            attend_heads_impl(q, k_cache, v_cache, slots, begin, end, row_width, kv_offset,     \
                              GC_VALUE, D, scale, part_max, part_sum, part_acc);                \
    } while (0)

static void attend_heads(const float* q, const float* k_cache, const float* v_cache,
                         const int32_t* slots, int64_t begin, int64_t end, int64_t row_width,
                         int64_t kv_offset, int64_t gc, int64_t D, float scale, float* part_max,
                         float* part_sum, float* part_acc) {
    switch (gc) {
        case 1: ATTEND_HEADS_FOR_D(1); break;
        case 2: ATTEND_HEADS_FOR_D(2); break;
        case 3: ATTEND_HEADS_FOR_D(3); break;
        default: ATTEND_HEADS_FOR_D(4); break;
    }
}

/* The largest chunk of a KV head's query-head group that attend_heads takes at once. */
static int64_t group_chunk(int64_t group) {
    for (int64_t gc = ATTN_MAX_GROUP_CHUNK; gc > 1; gc--)
        if (group % gc == 0) return gc;
    return 1;
}

/* Every query head of q ([hq, D]) over positions [begin, end): part_max [hq], part_sum [hq],
 * part_acc [hq, D]. */
static void attend_range(const float* q, const float* k_cache, const float* v_cache,
                         const int32_t* slots, int64_t begin, int64_t end, int64_t hk,
                         int64_t group, int64_t D, float scale, float* part_max, float* part_sum,
                         float* part_acc) {
    const int64_t gc = group_chunk(group), row_width = hk * D;
    for (int64_t h = 0; h < hk * group; h += gc) {
        attend_heads(q + h * D, k_cache, v_cache, slots, begin, end, row_width, (h / group) * D,
                     gc, D, scale, part_max + h, part_sum + h, part_acc + h * D);
    }
}

int mg_decode_attention(const float* q, int64_t ldq, const int64_t* q_rows, const float* k_cache,
                        const float* v_cache, const int32_t* page_table, int64_t ld_pt,
                        const int64_t* table_rows, const int64_t* kv_lens, float* out,
                        int64_t ldo, int64_t B, int64_t hq, int64_t hk, int64_t D, float scale,
                        int nthreads) {
    const int64_t group = hq / hk;
    if (hq > ATTN_MAX_HEADS || D > ATTN_MAX_HEAD_DIM || group * hk != hq) return 1;
    if (B == 0) return 0;
    int64_t* first_item = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first_item) return 2;
    first_item[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first_item[b + 1] = first_item[b] + (kv_lens[b] + ATTN_SPLIT - 1) / ATTN_SPLIT;
    const int64_t items = first_item[B], part_width = hq * (D + 2);
    int64_t* item_seq = malloc((size_t)items * sizeof(int64_t));
    float* parts = malloc((size_t)(items * part_width) * sizeof(float));
    if (!item_seq || !parts) {
        free(first_item), free(item_seq), free(parts);
        return 2;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) item_seq[i] = b;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item_seq[item], split = item - first_item[b];
            const int64_t begin = split * ATTN_SPLIT;
            const int64_t end = begin + ATTN_SPLIT < kv_lens[b] ? begin + ATTN_SPLIT : kv_lens[b];
            float* part = parts + item * part_width;
            const int64_t row = q_rows ? q_rows[b] : b;
            attend_range(q + row * ldq, k_cache, v_cache, page_table + table_rows[b] * ld_pt,
                         begin, end, hk, group, D, scale, part, part + hq, part + 2 * hq);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float* o = out + (q_rows ? q_rows[b] : b) * ldo;
            for (int64_t h = 0; h < hq; h++) {
                float max = -INFINITY, denom = 0.0f;
                for (int64_t i = first_item[b]; i < first_item[b + 1]; i++)
                    max = fmaxf(max, parts[i * part_width + h]);
                for (int64_t d = 0; d < D; d++) o[h * D + d] = 0.0f;
                for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) {
                    const float* part = parts + i * part_width;
                    const float weight = sexp(part[h] - max);
                    denom += part[hq + h] * weight;
                    axpy(o + h * D, weight, part + 2 * hq + h * D, D);
                }
                const float inv = 1.0f / denom;
                for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
            }
        }
    }
    free(first_item), free(item_seq), free(parts);
    return 0;
}

/* ---- seeded uniforms for sampling ------------------------------------------------------------
 * out[r, i] = uniform (0, 1) number for (seeds[r], positions[r], vocab id i): bit for bit the
 * torch formula in minisgl/engine/sampler.py (seeded_uniform; lowbias32 hashes in 32-bit
 * arithmetic), which builds a dozen int64 [rows, vocab] tensors to get there. */
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

static inline vu vmix32(vu x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

#define UNIFORM_BITS 24
#define UNIFORM_CHUNK 4096 /* vocab ids per work item */

void mg_seeded_uniform(const int64_t* seeds, const int64_t* positions, int64_t rows,
                       int64_t vocab, float* out, int nthreads) {
    const int64_t chunks = (vocab + UNIFORM_CHUNK - 1) / UNIFORM_CHUNK;
    const float inv = 1.0f / (float)(1 << UNIFORM_BITS);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t item = 0; item < rows * chunks; item++) {
        const int64_t r = item / chunks, begin = (item % chunks) * UNIFORM_CHUNK;
        const int64_t end = begin + UNIFORM_CHUNK < vocab ? begin + UNIFORM_CHUNK : vocab;
        const uint32_t key = mix32(mix32((uint32_t)seeds[r]) ^ (uint32_t)positions[r]);
        float* o = out + r * vocab;
        vu lane;
        for (int i = 0; i < VW; i++) lane[i] = (uint32_t)i;
        int64_t i = begin;
        for (; i + VW <= end; i += VW) {
            vu h = vmix32(key * 0x9E3779B1u + ((uint32_t)i + lane));
            h = vmix32(h ^ key);
            vi top = (vi)(h >> (32 - UNIFORM_BITS));
            vstore(o + i, (__builtin_convertvector(top, vf) + 0.5f) * inv);
        }
        for (; i < end; i++) {
            const uint32_t h = mix32(mix32(key * 0x9E3779B1u + (uint32_t)i) ^ key);
            o[i] = ((float)(h >> (32 - UNIFORM_BITS)) + 0.5f) * inv;
        }
    }
}

/* ---- sampling: temperature, softmax and the exponential race in one pass per row -------------
 * out[r] = argmax_i softmax(logits[r] / t)_i / -log(u_i) with t = max(temps[r], 1e-5) and u the
 * seeded uniforms above: the torch formula of minisgl/engine/sampler.py (no top-k / top-p /
 * min-p) without its [rows, vocab] temporaries. Rows with temperature 0 take the argmax of
 * their logits. Ties go to the lowest id, as torch.argmax. */
#define MIN_TEMPERATURE 1e-5f

/* log(x) for positive normal x: Cephes' logf (x = m * 2^e, m in [sqrt(1/2), sqrt(2))). */
static inline vf vlog(vf x) {
    vi bits;
    memcpy(&bits, &x, sizeof bits);
    vi e = ((bits >> 23) & 0xff) - 126;
    vi mantissa_bits = (bits & 0x007fffff) | 0x3f000000; /* m in [0.5, 1) */
    vf m;
    memcpy(&m, &mantissa_bits, sizeof m);
    const vi small = m < 0.707106781186547524f;
    e += small; /* small lanes are -1: e - 1, m doubled below */
    m = vselect(small, m + m - 1.0f, m - 1.0f);
    const vf ef = __builtin_convertvector(e, vf);
    const vf z = m * m;
    vf y = vsplat(7.0376836292e-2f);
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y += ef * -2.12194440e-4f;
    y -= 0.5f * z;
    return m + y + ef * 0.693359375f;
}

static int64_t argmax_row(const float* x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int64_t sample_row(const float* logits, int64_t vocab, float temperature, uint32_t key) {
    const float t = temperature > MIN_TEMPERATURE ? temperature : MIN_TEMPERATURE;
    vf vmx = vsplat(-INFINITY);
    float mx = -INFINITY;
    int64_t i = 0;
    for (; i + VW <= vocab; i += VW) vmx = vmax(vmx, vload(logits + i) / t);
    for (; i < vocab; i++) mx = fmaxf(mx, logits[i] / t);
    for (int j = 0; j < VW; j++) mx = fmaxf(mx, vmx[j]);
    vf vs = (vf){0};
    float sum = 0.0f;
    for (i = 0; i + VW <= vocab; i += VW) vs += vexp(vload(logits + i) / t - mx);
    for (; i < vocab; i++) sum += sexp(logits[i] / t - mx);
    sum += vsum(vs);
    const float inv = 1.0f / (float)(1 << UNIFORM_BITS);
    vu lane;
    for (int j = 0; j < VW; j++) lane[j] = (uint32_t)j;
    float best = -INFINITY;
    int64_t best_id = 0;
    for (i = 0; i + VW <= vocab; i += VW) {
        vu h = vmix32(vmix32(key * 0x9E3779B1u + ((uint32_t)i + lane)) ^ key);
        const vf u = (__builtin_convertvector((vi)(h >> (32 - UNIFORM_BITS)), vf) + 0.5f) * inv;
        const vf score = vexp(vload(logits + i) / t - mx) / sum / -vlog(u);
        for (int j = 0; j < VW; j++)
            if (score[j] > best) best = score[j], best_id = i + j;
    }
    for (; i < vocab; i++) {
        const uint32_t h = mix32(mix32(key * 0x9E3779B1u + (uint32_t)i) ^ key);
        float lanes[VW] = {((float)(h >> (32 - UNIFORM_BITS)) + 0.5f) * inv};
        const float score = sexp(logits[i] / t - mx) / sum / -vlog(vload(lanes))[0];
        if (score > best) best = score, best_id = i;
    }
    return best_id;
}

void mg_sample(const float* logits, int64_t ld, const float* temperatures, const int64_t* seeds,
               const int64_t* positions, int64_t rows, int64_t vocab, int64_t* out,
               int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = logits + r * ld;
        if (temperatures[r] == 0.0f) {
            out[r] = argmax_row(row, vocab);
            continue;
        }
        const uint32_t key = mix32(mix32((uint32_t)seeds[r]) ^ (uint32_t)positions[r]);
        out[r] = sample_row(row, vocab, temperatures[r], key);
    }
}

/* ---- a whole dense decoder stack for a decode-only batch, in one call ------------------------
 * Sequence b computes one token at positions[b] of table row table_rows[b] (KV length
 * kv_lens[b], its K/V stored at out_slots[b]). Per layer, exactly the op-by-op path's kernels in
 * the same order (so the same numbers):
 *   normed = rmsnorm(hidden + residual)        (layer 0: residual = hidden, normed = rmsnorm)
 *   qkv = normed @ Wqkv^T (+ bias); q/k head norms (Qwen3); rope; store k, v
 *   attn = paged decode attention;  o = attn @ Wo^T
 *   normed = rmsnorm(o + residual);  hidden = silu_mul(normed @ Wgu^T) @ Wdown^T
 * On return `hidden` holds the last layer's output plus the residual: what the final norm
 * takes. Pool layout: [layers, 2 (k, v), num_slots, kv_heads, head_dim], contiguous. */
typedef struct {
    const float* input_norm;
    const float* post_norm;
    const float* qkv;
    const float* qkv_bias; /* NULL: none */
    const float* q_norm;   /* NULL: no per-head q/k norm */
    const float* k_norm;
    const float* o;
    const float* gate_up;
    const float* down;
} mg_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, head_norm_eps, scale;
    const float* cos_cache;
    const float* sin_cache;
    const mg_layer* layers;
} mg_model;

/* Floats of scratch mg_decode_layers needs for B sequences. */
int64_t mg_decode_scratch_floats(const mg_model* m, int64_t B) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return B * (3 * m->hidden + (q + 2 * kv) + q + 3 * m->inter);
}

/* Per-op wall time of mg_decode_layers, summed over layers, when the caller passes an array of
 * MG_NUM_OPS doubles (benchmark/offline/profile_decode.py); NULL costs nothing. */
enum {
    OP_NORM, OP_QKV, OP_HEAD_NORM, OP_ROPE, OP_STORE_KV, OP_ATTENTION, OP_O_PROJ, OP_GATE_UP,
    OP_SILU_MUL, OP_DOWN, MG_NUM_OPS
};
int mg_num_ops(void) { return MG_NUM_OPS; }

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void lap(double* op_seconds, int op, double* last) {
    if (!op_seconds) return;
    const double t = now_s();
    op_seconds[op] += t - *last;
    *last = t;
}

int mg_decode_layers(const mg_model* m, float* hidden, int64_t B, const int64_t* positions,
                     const int64_t* out_slots, const int32_t* page_table, int64_t ld_pt,
                     const int64_t* table_rows, const int64_t* kv_lens, float* pool,
                     int64_t num_slots, float* scratch, double* op_seconds, int nthreads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->inter;
    const int64_t q_width = m->heads * D, kv_width = m->kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    float* residual = scratch;
    float* normed = residual + B * H;
    float* o = normed + B * H;
    float* qkv = o + B * H;
    float* attn = qkv + B * qkv_width;
    float* gate_up = attn + B * q_width;
    float* act = gate_up + B * 2 * I;
    const int64_t cache_floats = num_slots * kv_width;
    double last = op_seconds ? now_s() : 0.0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const mg_layer* L = &m->layers[l];
        float* k_cache = pool + (2 * l) * cache_floats;
        float* v_cache = pool + (2 * l + 1) * cache_floats;
        if (l == 0) {
            memcpy(residual, hidden, (size_t)(B * H) * sizeof(float));
            mg_rmsnorm(hidden, H, 1, 0, H, L->input_norm, normed, H, B, H, m->eps, nthreads);
        } else {
            mg_rmsnorm(hidden, H, 1, residual, H, L->input_norm, normed, H, B, H, m->eps,
                       nthreads);
        }
        lap(op_seconds, OP_NORM, &last);
        mg_linear(normed, H, L->qkv, L->qkv_bias, qkv, qkv_width, B, H, qkv_width, nthreads);
        lap(op_seconds, OP_QKV, &last);
        float* q = qkv;
        float* k = qkv + q_width;
        float* v = k + kv_width;
        if (L->q_norm && L->k_norm) {
            mg_rmsnorm(q, qkv_width, m->heads, 0, 0, L->q_norm, q, qkv_width, B, D,
                       m->head_norm_eps, nthreads);
            mg_rmsnorm(k, qkv_width, m->kv_heads, 0, 0, L->k_norm, k, qkv_width, B, D,
                       m->head_norm_eps, nthreads);
            lap(op_seconds, OP_HEAD_NORM, &last);
        }
        mg_rope(q, qkv_width, m->heads, k, qkv_width, m->kv_heads, B, D, positions, m->cos_cache,
                m->sin_cache, nthreads);
        lap(op_seconds, OP_ROPE, &last);
        mg_store_kv(k, qkv_width, v, qkv_width, k_cache, v_cache, out_slots, B, kv_width);
        lap(op_seconds, OP_STORE_KV, &last);
        const int status = mg_decode_attention(q, qkv_width, 0, k_cache, v_cache, page_table,
                                               ld_pt, table_rows, kv_lens, attn, q_width, B,
                                               m->heads, m->kv_heads, D, m->scale, nthreads);
        if (status != 0) return status;
        lap(op_seconds, OP_ATTENTION, &last);
        mg_linear(attn, q_width, L->o, 0, o, H, B, q_width, H, nthreads);
        lap(op_seconds, OP_O_PROJ, &last);
        mg_rmsnorm(o, H, 1, residual, H, L->post_norm, normed, H, B, H, m->eps, nthreads);
        lap(op_seconds, OP_NORM, &last);
        mg_linear(normed, H, L->gate_up, 0, gate_up, 2 * I, B, H, 2 * I, nthreads);
        lap(op_seconds, OP_GATE_UP, &last);
        mg_silu_mul(gate_up, 2 * I, act, I, B, I, nthreads);
        lap(op_seconds, OP_SILU_MUL, &last);
        mg_linear(act, I, L->down, 0, hidden, H, B, I, H, nthreads);
        lap(op_seconds, OP_DOWN, &last);
    }
    for (int64_t i = 0; i < B * H; i++) hidden[i] += residual[i];
    lap(op_seconds, OP_NORM, &last);
    return 0;
}
