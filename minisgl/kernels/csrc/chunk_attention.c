/* Prefill attention straight from the paged pool: a chunk of n query tokens of one sequence, at
 * positions [prefix, prefix + n), each attending causally to positions [0, its own + 1); the
 * K/V of position j sit at slot slots[j] of k_cache / v_cache ([slots, hk, D], fp32 or
 * another KV format of common.h).
 *
 * No gather, no mask tensor, no padded copy per KV head (what SDPA over the pool needs): a work
 * unit is one KV head and a block of the chunk's tokens, together up to CHUNK_M query vectors
 * (tokens times the query heads of that KV head). It walks the positions its last token sees in
 * tiles of CHUNK_TILE as two small matrix products held in registers, with the query vectors
 * along the vector lanes: scores S = K Q^T (6 positions by 16 query vectors per pass, K rows read
 * where they lie in the pool), online softmax per query vector, O^T = O^T * correction + V^T P
 * (4 dimensions by 16 query vectors per pass).
 *
 * A token's result depends neither on the thread count nor on its block mates nor on where the
 * chunk began: tiles always start at position 0 and every sum runs over the whole tile in one
 * order (positions past a token's own, or past the block's last, add exact zeros). */
#include <stdlib.h>

#include "common.h"

#define CHUNK_M 64 /* query vectors (tokens x query heads of one KV head) per work unit */
#define CHUNK_MAX_GROUP 128 /* query heads per KV head (a unit has at least one token) */
#define CHUNK_CM 16 /* query vectors per register block (the lanes) */
#define CHUNK_CV (CHUNK_CM / VW) /* vectors of them */
#define CHUNK_RS 6 /* positions per score block: 12 accumulators */
#define CHUNK_RD 4 /* head dimensions per output block: 8 accumulators */
#define CHUNK_TILE 60 /* positions per tile, a multiple of CHUNK_RS */

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

/* st[r][0, 16) = dot(k[r], query vectors [0, 16) of qt) for CHUNK_RS positions r; qt [D][ld],
 * st rows ld apart. */
static inline void scores_block(const float* const* k, const float* qt, int64_t D, int64_t ld,
                                float* st) {
    vf acc[CHUNK_RS][CHUNK_CV];
    for (int r = 0; r < CHUNK_RS; r++)
        for (int c = 0; c < CHUNK_CV; c++) acc[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf q[CHUNK_CV];
        for (int c = 0; c < CHUNK_CV; c++) q[c] = vload(qt + d * ld + c * VW);
        for (int r = 0; r < CHUNK_RS; r++) {
            const vf kd = broadcast(k[r][d]);
            for (int c = 0; c < CHUNK_CV; c++) acc[r][c] += kd * q[c];
        }
    }
    for (int r = 0; r < CHUNK_RS; r++)
        for (int c = 0; c < CHUNK_CV; c++) vstore(st + r * ld + c * VW, acc[r][c]);
}

/* ot[r][0, 16) = ot[r][..] * correction + sum over the tile's t of v[t][d + r] p[t][..], for
 * CHUNK_RD dimensions r from d; ot and p rows ld apart. */
static inline void outputs_block(float* ot, const float* const* v, int64_t d, const float* p,
                                 const float* correction, int64_t ld) {
    vf acc[CHUNK_RD][CHUNK_CV];
    for (int r = 0; r < CHUNK_RD; r++)
        for (int c = 0; c < CHUNK_CV; c++)
            acc[r][c] = vload(ot + r * ld + c * VW) * vload(correction + c * VW);
    for (int64_t t = 0; t < CHUNK_TILE; t++) {
        vf pt[CHUNK_CV];
        for (int c = 0; c < CHUNK_CV; c++) pt[c] = vload(p + t * ld + c * VW);
        for (int r = 0; r < CHUNK_RD; r++) {
            const vf vd = broadcast(v[t][d + r]);
            for (int c = 0; c < CHUNK_CV; c++) acc[r][c] += vd * pt[c];
        }
    }
    for (int r = 0; r < CHUNK_RD; r++)
        for (int c = 0; c < CHUNK_CV; c++) vstore(ot + r * ld + c * VW, acc[r][c]);
}

/* Online softmax over one tile of scores st [CHUNK_TILE][ld] for query vectors [0, Mp): they
 * become probabilities (exact zeros where masked, -inf); each vector's running max and sum move
 * on, and `correction` gets what its outputs so far must be scaled by. */
static void softmax_columns(float* st, int64_t Mp, int64_t ld, float* part_max, float* part_sum,
                            float* correction) {
    for (int64_t m = 0; m < Mp; m += VW) {
        vf tile_max = vsplat(-INFINITY);
        for (int64_t t = 0; t < CHUNK_TILE; t++) tile_max = vmax(tile_max, vload(st + t * ld + m));
        const vf old_max = vload(part_max + m), new_max = vmax(old_max, tile_max);
        const vf scale = vexp(old_max - new_max); /* (exactly 1 where the max stays) */
        vf sum = vload(part_sum + m) * scale;
        for (int64_t t = 0; t < CHUNK_TILE; t++) {
            const vf s = vload(st + t * ld + m);
            const vf p = vselect((vi)(s > vsplat(-INFINITY)), vexp(s - new_max), (vf){0});
            vstore(st + t * ld + m, p);
            sum += p;
        }
        vstore(part_max + m, new_max), vstore(part_sum + m, sum), vstore(correction + m, scale);
    }
}

/* The tokens_per_unit tokens from r0 of KV head kh: query vectors m = token * group + head. */
static void chunk_unit(chunk_args* a, int64_t kh, int64_t r0) {
    const int64_t group = a->hq / a->hk, D = a->D, T = CHUNK_TILE;
    const int64_t tokens = min64(a->tokens_per_unit, a->n - r0), M = tokens * group;
    const int64_t Mp = (M + CHUNK_CM - 1) / CHUNK_CM * CHUNK_CM, elem = kv_bytes(a->kv);
    /* Q^T and O^T [D][Mp], S [T][Mp], running max, sum and correction [Mp], K and V rows as
     * fp32 [2 T][D] (formats other than fp32), a row of zeros [D] */
    float* scratch = calloc((size_t)(Mp * (2 * D + T + 3) + (2 * T + 1) * D), sizeof(float));
    if (!scratch) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *qt = scratch, *ot = qt + D * Mp, *st = ot + D * Mp, *part_max = st + T * Mp;
    float *part_sum = part_max + Mp, *correction = part_sum + Mp, *rows = correction + Mp;
    const float* zeros = rows + 2 * T * D;
    for (int64_t m = 0; m < M; m++) {
        const float* src = a->q + (r0 + m / group) * a->ldq + (kh * group + m % group) * D;
        for (int64_t d = 0; d < D; d++) qt[d * Mp + m] = src[d] * a->scale;
    }
    for (int64_t m = 0; m < Mp; m++) part_max[m] = -INFINITY;
    const float* k[CHUNK_TILE];
    const float* v[CHUNK_TILE];
    const int64_t end = a->prefix + r0 + tokens; /* the last token's positions */
    for (int64_t t0 = 0; t0 < end; t0 += T) {
        for (int64_t t = 0; t < T; t++) {
            k[t] = v[t] = zeros;
            if (t0 + t >= end) continue;
            if (t0 + t + ATTN_PREFETCH < end) { /* (rows lie scattered over the pool) */
                const int64_t ahead = a->slots[t0 + t + ATTN_PREFETCH] * a->hk + kh;
                for (int64_t i = 0; i < D * elem; i += 64) {
                    __builtin_prefetch((const char*)a->k_cache + ahead * D * elem + i, 0, 3);
                    __builtin_prefetch((const char*)a->v_cache + ahead * D * elem + i, 0, 3);
                }
            }
            const int64_t offset = ((int64_t)a->slots[t0 + t] * a->hk + kh) * D * elem;
            k[t] = (const float*)((const char*)a->k_cache + offset);
            v[t] = (const float*)((const char*)a->v_cache + offset);
        }
        if (a->kv) { /* (the rows past `end` are fp32 zeros already) */
            const int64_t nt = min64(T, end - t0);
            decode_rows((const void**)k, nt, D, a->kv, rows);
            decode_rows((const void**)v, nt, D, a->kv, rows + T * D);
        }
        for (int64_t t = 0; t < T; t += CHUNK_RS)
            for (int64_t m = 0; m < Mp; m += CHUNK_CM)
                scores_block(k + t, qt + m, D, Mp, st + t * Mp + m);
        /* causal: token r sees positions up to prefix + r0 + r (padding vectors as the last) */
        for (int64_t m = 0; m < Mp; m++) {
            const int64_t last = a->prefix + r0 + min64(m / group, tokens - 1);
            for (int64_t t = max64(0, last + 1 - t0); t < T; t++) st[t * Mp + m] = -INFINITY;
        }
        softmax_columns(st, Mp, Mp, part_max, part_sum, correction);
        for (int64_t m = 0; m < Mp; m += CHUNK_CM)
            for (int64_t d = 0; d < D; d += CHUNK_RD)
                outputs_block(ot + d * Mp + m, v, d, st + m, correction + m, Mp);
    }
    for (int64_t m = 0; m < M; m++) {
        float* dst = a->out + (r0 + m / group) * a->ldo + (kh * group + m % group) * D;
        const float inv = a->v_scale / part_sum[m];
        for (int64_t d = 0; d < D; d++) dst[d] = ot[d * Mp + m] * inv;
    }
    free(scratch);
}

/* Units [begin, end): the longest blocks (the chunk's last tokens) first. */
static void chunk_units_range(const void* args, int64_t begin, int64_t end) {
    chunk_args* a = (chunk_args*)args;
    for (int64_t u = begin; u < end; u++)
        chunk_unit(a, u / a->blocks, (a->blocks - 1 - u % a->blocks) * a->tokens_per_unit);
}

/* Returns 0, 1 for an unsupported head layout, 2 when out of memory. */
int mg_chunk_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                       const int32_t* slots, int64_t prefix, int64_t n, float* out, int64_t ldo,
                       int64_t hq, int64_t hk, int64_t D, float scale, int kv, float v_scale,
                       int nthreads) {
    if (hk < 1 || hq % hk != 0 || hq / hk > CHUNK_MAX_GROUP || D % CHUNK_RD != 0) return 1;
    if (n == 0) return 0;
    const int64_t tokens_per_unit = max64(1, CHUNK_M / (hq / hk));
    chunk_args a = {q, ldq, k_cache, v_cache, slots, prefix, n, tokens_per_unit,
                    (n + tokens_per_unit - 1) / tokens_per_unit, out, ldo, hq, hk, D, scale,
                    v_scale, kv, 0};
    run_parallel(&a, chunk_units_range, hk * a.blocks, 1, nthreads);
    return atomic_load(&a.failed) ? 2 : 0;
}
