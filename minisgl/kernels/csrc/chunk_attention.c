/* Prefill attention straight from the paged pool: a chunk of n query tokens of one sequence, at
 * positions [prefix, prefix + n), each attending causally to positions [0, its own + 1); the
 * K/V of position j sit at slot slots[j] of k_cache / v_cache ([slots, hk, D], fp32 or
 * another KV format of common.h).
 *
 * No gather, no mask tensor, no padded copy per KV head (what SDPA over the pool needs): a work
 * unit is one KV head and a block of the chunk's tokens, together CHUNK_M query vectors (tokens
 * times the query heads of that KV head). It walks the positions its last token sees in tiles
 * of ATTN_TILE as two small matrix products held in registers: scores = Q K^T (the tile's K
 * transposed once, then 4 query vectors by 16 positions per pass), online softmax over the
 * tile, O = O * correction + P V (4 query vectors by 16 dimensions per pass).
 *
 * A token's result depends neither on the thread count nor on its block mates nor on where the
 * chunk began: tiles always start at position 0, and every score and output element adds its
 * terms in one order (a tile past a token's last position adds exact zeros). */
#include <stdlib.h>

#include "common.h"

#define CHUNK_M 60 /* query vectors (tokens x query heads of one KV head) per work unit */
#define CHUNK_MAX_GROUP 128 /* query heads per KV head (a unit has at least one token) */
#define CHUNK_RM 6 /* query vectors per register block (12 accumulators of 16) */
#define CHUNK_CN 16 /* positions (scores) or dimensions (outputs) per register block */
#define CHUNK_CV (CHUNK_CN / VW) /* vectors of them */
#define CHUNK_PREFETCH 8 /* K/V rows fetched this many positions ahead */

typedef struct {
    const float* q; /* [n, hq, D] rows ldq apart */
    int64_t ldq;
    const void* k_cache;
    const void* v_cache;
    const int32_t* slots; /* [prefix + n] */
    int64_t prefix, n, tokens_per_unit, blocks;
    float* out; /* like q, rows ldo apart */
    int64_t ldo, hq, hk, D;
    float scale, v_scale;
    int kv; /* the pool's element format (common.h) */
    atomic_int failed; /* a unit found no memory */
} chunk_args;

/* s in every lane (vsplat's 0 + s keeps an add: it turns -0 into +0; s - 0 is s) */
static inline vf broadcast(float s) { return s - (vf){0}; }

/* One K or V row (D elements) of the pool as fp32. */
static inline void load_row(float* dst, const void* src, int64_t D, int kv) {
    if (!kv) {
        memcpy(dst, src, (size_t)D * sizeof(float));
        return;
    }
    int64_t i = 0;
    for (; i + VW <= D; i += VW) vstore(dst + i, kv_vload((const char*)src + i * kv_bytes(kv), kv));
    for (; i < D; i++) dst[i] = kv_get(src, i, kv);
}

/* s[m][t] = dot(q[m], k[t]) for CHUNK_RM query vectors m and CHUNK_CN positions t, kt the
 * transposed tile [D][ATTN_TILE]. */
static inline void scores_block(const float* q, const float* kt, int64_t D, float* s) {
    vf acc[CHUNK_RM][CHUNK_CV];
    for (int r = 0; r < CHUNK_RM; r++)
        for (int c = 0; c < CHUNK_CV; c++) acc[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf k[CHUNK_CV];
        for (int c = 0; c < CHUNK_CV; c++) k[c] = vload(kt + d * ATTN_TILE + c * VW);
        for (int r = 0; r < CHUNK_RM; r++) {
            const vf qd = broadcast(q[r * D + d]);
            for (int c = 0; c < CHUNK_CV; c++) acc[r][c] += qd * k[c];
        }
    }
    for (int r = 0; r < CHUNK_RM; r++)
        for (int c = 0; c < CHUNK_CV; c++) vstore(s + r * ATTN_TILE + c * VW, acc[r][c]);
}

/* o[m][d] = o[m][d] * correction[m] + sum over t < nt of p[m][t] v[t][d], for CHUNK_RM query
 * vectors and CHUNK_CN dimensions (o and v rows D apart, p rows ATTN_TILE apart). */
static inline void outputs_block(float* o, const float* p, const float* v, const float* correction,
                                 int64_t nt, int64_t D) {
    vf acc[CHUNK_RM][CHUNK_CV];
    for (int r = 0; r < CHUNK_RM; r++)
        for (int c = 0; c < CHUNK_CV; c++) acc[r][c] = vload(o + r * D + c * VW) * correction[r];
    for (int64_t t = 0; t < nt; t++) {
        vf x[CHUNK_CV];
        for (int c = 0; c < CHUNK_CV; c++) x[c] = vload(v + t * D + c * VW);
        for (int r = 0; r < CHUNK_RM; r++) {
            const vf pt = broadcast(p[r * ATTN_TILE + t]);
            for (int c = 0; c < CHUNK_CV; c++) acc[r][c] += pt * x[c];
        }
    }
    for (int r = 0; r < CHUNK_RM; r++)
        for (int c = 0; c < CHUNK_CV; c++) vstore(o + r * D + c * VW, acc[r][c]);
}

/* Query vectors [0, M) (padded to Mp, a multiple of CHUNK_RM) of KV head kh, tokens from r0. */
static void chunk_unit(chunk_args* a, int64_t kh, int64_t r0) {
    const int64_t group = a->hq / a->hk, D = a->D, T = ATTN_TILE;
    const int64_t tokens = min64(a->tokens_per_unit, a->n - r0), M = tokens * group;
    const int64_t Mp = (M + CHUNK_RM - 1) / CHUNK_RM * CHUNK_RM;
    const int64_t Dp = (D + CHUNK_CN - 1) / CHUNK_CN * CHUNK_CN; /* o and V rows, zero-padded */
    const int64_t row_width = a->hk * D, elem = kv_bytes(a->kv);
    /* q [Mp, D], o [Mp, Dp], scores [Mp, T], K transposed [D, T], V [T, Dp], running max, sum
     * and correction [Mp]; paddings stay zero */
    float* scratch = calloc((size_t)(Mp * (D + Dp + T + 3) + T * (D + Dp)), sizeof(float));
    if (!scratch) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *q = scratch, *o = q + Mp * D, *s = o + Mp * Dp, *kt = s + Mp * T, *v = kt + D * T;
    float *part_max = v + T * Dp, *part_sum = part_max + Mp, *correction = part_sum + Mp;
    for (int64_t m = 0; m < M; m++) {
        const float* src = a->q + (r0 + m / group) * a->ldq + (kh * group + m % group) * D;
        for (int64_t d = 0; d < D; d++) q[m * D + d] = src[d] * a->scale;
    }
    for (int64_t m = 0; m < Mp; m++) part_max[m] = -INFINITY;
    const int64_t end = a->prefix + r0 + tokens; /* the last token's positions */
    for (int64_t t0 = 0; t0 < end; t0 += T) {
        const int64_t nt = min64(T, end - t0);
        for (int64_t t = 0; t < T; t++) {
            float* row = v + t * Dp; /* (K is read through the V row, then transposed) */
            if (t < nt) {
                if (t0 + t + CHUNK_PREFETCH < end) { /* (rows lie scattered over the pool) */
                    const int64_t ahead = a->slots[t0 + t + CHUNK_PREFETCH] * row_width + kh * D;
                    for (int64_t i = 0; i < D * elem; i += 64) {
                        __builtin_prefetch((const char*)a->k_cache + ahead * elem + i, 0, 3);
                        __builtin_prefetch((const char*)a->v_cache + ahead * elem + i, 0, 3);
                    }
                }
                const int64_t offset = ((int64_t)a->slots[t0 + t] * row_width + kh * D) * elem;
                load_row(row, (const char*)a->k_cache + offset, D, a->kv);
                for (int64_t d = 0; d < D; d++) kt[d * T + t] = row[d];
                load_row(row, (const char*)a->v_cache + offset, D, a->kv);
            } else {
                for (int64_t d = 0; d < D; d++) kt[d * T + t] = 0.0f;
                memset(row, 0, (size_t)D * sizeof(float));
            }
        }
        for (int64_t m = 0; m < Mp; m += CHUNK_RM)
            for (int64_t t = 0; t < T; t += CHUNK_CN)
                scores_block(q + m * D, kt + t, D, s + m * T + t);
        /* Causal: token r sees positions up to prefix + r0 + r. The softmax always takes the
         * whole tile (its sums then add in one order whatever the block's end), the positions
         * past a token's as exact zeros (exp would give the smallest normal float). */
        int64_t seen[CHUNK_MAX_GROUP + CHUNK_RM];
        for (int64_t m = 0; m < Mp; m++) {
            seen[m] = max64(0, min64(nt, a->prefix + r0 + min64(m / group, tokens - 1) + 1 - t0));
            for (int64_t t = seen[m]; t < T; t++) s[m * T + t] = -INFINITY;
        }
        softmax_tile((float (*)[ATTN_TILE])s, Mp, T, part_max, part_sum, correction);
        for (int64_t m = 0; m < Mp; m++)
            for (int64_t t = seen[m]; t < T; t++) s[m * T + t] = 0.0f;
        for (int64_t m = 0; m < Mp; m += CHUNK_RM)
            for (int64_t d = 0; d < Dp; d += CHUNK_CN)
                outputs_block(o + m * Dp + d, s + m * T, v + d, correction + m, nt, Dp);
    }
    for (int64_t m = 0; m < M; m++) {
        float* dst = a->out + (r0 + m / group) * a->ldo + (kh * group + m % group) * D;
        const float inv = a->v_scale / part_sum[m];
        for (int64_t d = 0; d < D; d++) dst[d] = o[m * Dp + d] * inv;
    }
    free(scratch);
}

/* Units [begin, end): the longest blocks (the chunk's last tokens) first. */
static void chunk_units_range(const void* args, int64_t begin, int64_t end) {
    chunk_args* a = (chunk_args*)args;
    for (int64_t u = begin; u < end; u++)
        chunk_unit(a, u / a->blocks, (a->blocks - 1 - u % a->blocks) * a->tokens_per_unit);
}

/* Returns 0, 1 for unsupported head counts, 2 when out of memory. */
int mg_chunk_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                       const int32_t* slots, int64_t prefix, int64_t n, float* out, int64_t ldo,
                       int64_t hq, int64_t hk, int64_t D, float scale, int kv, float v_scale,
                       int nthreads) {
    if (hk < 1 || hq % hk != 0 || hq / hk > CHUNK_MAX_GROUP) return 1;
    if (n == 0) return 0;
    const int64_t tokens_per_unit = max64(1, CHUNK_M / (hq / hk));
    chunk_args a = {q, ldq, k_cache, v_cache, slots, prefix, n, tokens_per_unit,
                    (n + tokens_per_unit - 1) / tokens_per_unit, out, ldo, hq, hk, D, scale,
                    v_scale, kv, 0};
    run_parallel(&a, chunk_units_range, hk * a.blocks, 1, nthreads);
    return atomic_load(&a.failed) ? 2 : 0;
}
