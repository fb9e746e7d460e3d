/* Prefill attention straight from the paged pool: a chunk of n query tokens of one sequence, at
 * positions [prefix, prefix + n), each attending causally to positions [0, its own + 1); the
 * K/V of position j sit at slot slots[j] of k_cache / v_cache ([slots, hk, D], fp32 or
 * another KV format of common.h).
 *
 * No gather, no mask tensor, no padded copy per KV head (what SDPA over the pool needs): a work
 * unit is one KV head, a block of the chunk's tokens, together up to CHUNK_M query vectors
 * (tokens times the query heads of that KV head), and one segment of CHUNK_SEG positions, so
 * that a short chunk after a long prefix (a few blocks, one per KV head) still gives every thread
 * its share. A unit walks the segment's positions that its block's last token sees in tiles of
 * CHUNK_TILE as two small matrix products held in registers, with the query vectors along the
 * vector lanes: scores S = K Q^T (6 positions by 16 query vectors per pass, K rows read where
 * they lie in the pool), online softmax per query vector, O^T = O^T * correction + V^T P (4
 * dimensions by 16 query vectors per pass). A second pass merges each block's segments, as the
 * decode kernel merges its splits (attention.c). Blocks go in waves of at most CHUNK_WAVE_FLOATS
 * of segment results, so a long chunk after a long prefix needs no more memory than that.
 *
 * A token's result depends neither on the thread count nor on its block mates nor on where the
 * chunk began: segments and tiles always start at multiples of their lengths from position 0,
 * every sum runs over the whole tile in one order (positions past a token's own, or past the
 * block's last, add exact zeros) and the merge adds segments in order (those a token does not
 * see, exact zeros). */
#include <stdlib.h>

#include "common.h"

#define CHUNK_M 64 /* query vectors (tokens x query heads of one KV head) per work unit */
#define CHUNK_MAX_GROUP 128 /* query heads per KV head (a unit has at least one token) */
#define CHUNK_CM 16 /* query vectors per register block (the lanes) */
#define CHUNK_CV (CHUNK_CM / VW) /* vectors of them */
#define CHUNK_RS 6 /* positions per score block: 12 accumulators */
#define CHUNK_RD 4 /* head dimensions per output block: 8 accumulators */
#define CHUNK_TILE 60 /* positions per tile, a multiple of CHUNK_RS */
#define CHUNK_SEG (16 * CHUNK_TILE) /* positions per work unit */
#define CHUNK_WAVE_FLOATS (1 << 21) /* segment results held at once */

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
    /* this wave: blocks [first_block, first_block + wave_blocks), each of `segments` segments;
     * a unit's result: O^T [D][Mp], running max and sum [Mp], part_floats apart */
    int64_t first_block, wave_blocks, segments, Mp, part_floats;
    float* parts;
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
        /* (exactly 1 where the max stays; a vector that sees nothing yet keeps zeros) */
        const vi seen = new_max > vsplat(-INFINITY);
        const vf scale = vselect(seen, vexp(old_max - new_max), (vf){0});
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

/* The tokens_per_unit tokens from r0 of KV head kh (query vectors m = token * group + head) over
 * segment `seg`, into `part`. */
static void chunk_unit(chunk_args* a, int64_t kh, int64_t r0, int64_t seg, float* part) {
    const int64_t group = a->hq / a->hk, D = a->D, T = CHUNK_TILE, Mp = a->Mp;
    const int64_t tokens = min64(a->tokens_per_unit, a->n - r0), M = tokens * group;
    const int64_t elem = kv_bytes(a->kv);
    float *ot = part, *part_max = ot + D * Mp, *part_sum = part_max + Mp;
    memset(part, 0, (size_t)a->part_floats * sizeof(float));
    for (int64_t m = 0; m < Mp; m++) part_max[m] = -INFINITY;
    /* the segment's positions that the last token sees */
    const int64_t begin = seg * CHUNK_SEG, end = min64(begin + CHUNK_SEG, a->prefix + r0 + tokens);
    if (begin >= end) return;
    /* Q^T [D][Mp], S [T][Mp], correction [Mp], K and V rows as fp32 [2 T][D] (formats other
     * than fp32), a row of zeros [D] */
    float* scratch = calloc((size_t)(Mp * (D + T + 1) + (2 * T + 1) * D), sizeof(float));
    if (!scratch) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *qt = scratch, *st = qt + D * Mp, *correction = st + T * Mp, *rows = correction + Mp;
    const float* zeros = rows + 2 * T * D;
    for (int64_t m = 0; m < M; m++) {
        const float* src = a->q + (r0 + m / group) * a->ldq + (kh * group + m % group) * D;
        for (int64_t d = 0; d < D; d++) qt[d * Mp + m] = src[d] * a->scale;
    }
    const float* k[CHUNK_TILE];
    const float* v[CHUNK_TILE];
    for (int64_t t0 = begin; t0 < end; t0 += T) {
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
    free(scratch);
}

/* The wave's block b from its longest (the chunk's last tokens), and its first token. */
static int64_t wave_block_start(const chunk_args* a, int64_t b) {
    return (a->blocks - 1 - (a->first_block + b)) * a->tokens_per_unit;
}

/* Units [begin, end) of the wave: KV head, then block, then segment. */
static void chunk_units_range(const void* args, int64_t begin, int64_t end) {
    chunk_args* a = (chunk_args*)args;
    for (int64_t u = begin; u < end; u++) {
        const int64_t block = u / a->segments % a->wave_blocks;
        chunk_unit(a, u / a->segments / a->wave_blocks, wave_block_start(a, block),
                   u % a->segments, a->parts + u * a->part_floats);
    }
}

/* Groups [begin, end) of the wave (KV head, then block): their segments merged into out. */
static void chunk_merge_range(const void* args, int64_t begin, int64_t end) {
    const chunk_args* a = args;
    const int64_t group = a->hq / a->hk, D = a->D, Mp = a->Mp;
    for (int64_t g = begin; g < end; g++) {
        const int64_t kh = g / a->wave_blocks, r0 = wave_block_start(a, g % a->wave_blocks);
        const int64_t M = min64(a->tokens_per_unit, a->n - r0) * group;
        const float* parts = a->parts + g * a->segments * a->part_floats;
        for (int64_t m = 0; m < M; m++) {
            float* dst = a->out + (r0 + m / group) * a->ldo + (kh * group + m % group) * D;
            float max = -INFINITY, denom = 0.0f;
            for (int64_t s = 0; s < a->segments; s++)
                max = fmaxf(max, parts[s * a->part_floats + D * Mp + m]);
            memset(dst, 0, (size_t)D * sizeof(float));
            for (int64_t s = 0; s < a->segments; s++) {
                const float* part = parts + s * a->part_floats;
                const float part_max = part[D * Mp + m];
                if (part_max == -INFINITY) continue; /* (positions this token does not see) */
                const float weight = sexp(part_max - max);
                denom += part[D * Mp + Mp + m] * weight;
                for (int64_t d = 0; d < D; d++) dst[d] += part[d * Mp + m] * weight;
            }
            const float inv = a->v_scale / denom;
            for (int64_t d = 0; d < D; d++) dst[d] *= inv;
        }
    }
}

/* Returns 0, 1 for an unsupported head layout, 2 when out of memory. */
int mg_chunk_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                       const int32_t* slots, int64_t prefix, int64_t n, float* out, int64_t ldo,
                       int64_t hq, int64_t hk, int64_t D, float scale, int kv, float v_scale,
                       int nthreads) {
    if (hk < 1 || hq % hk != 0 || hq / hk > CHUNK_MAX_GROUP || D % CHUNK_RD != 0) return 1;
    if (n == 0) return 0;
    const int64_t group = hq / hk, tokens_per_unit = min64(n, max64(1, CHUNK_M / group));
    const int64_t Mp = (tokens_per_unit * group + CHUNK_CM - 1) / CHUNK_CM * CHUNK_CM;
    chunk_args a = {q, ldq, k_cache, v_cache, slots, prefix, n, tokens_per_unit,
                    (n + tokens_per_unit - 1) / tokens_per_unit, out, ldo, hq, hk, D, scale,
                    v_scale, kv, 0};
    a.segments = (prefix + n + CHUNK_SEG - 1) / CHUNK_SEG, a.Mp = Mp, a.part_floats = Mp * (D + 2);
    const int64_t block_floats = hk * a.segments * a.part_floats;
    a.wave_blocks = min64(a.blocks, max64(1, CHUNK_WAVE_FLOATS / block_floats));
    a.parts = malloc((size_t)(a.wave_blocks * block_floats) * sizeof(float));
    if (!a.parts) return 2;
    for (a.first_block = 0; a.first_block < a.blocks; a.first_block += a.wave_blocks) {
        a.wave_blocks = min64(a.wave_blocks, a.blocks - a.first_block);
        run_parallel(&a, chunk_units_range, hk * a.wave_blocks * a.segments, 1, nthreads);
        run_parallel(&a, chunk_merge_range, hk * a.wave_blocks, 1, nthreads);
    }
    free(a.parts);
    return atomic_load(&a.failed) ? 2 : 0;
}
