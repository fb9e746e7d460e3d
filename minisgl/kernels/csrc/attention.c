/* Decode attention straight from the paged pool.
 *
 * Decode b (one query token at query row q_rows[b], or b when q_rows is NULL) attends to
 * positions [0, kv_lens[b]) of table row table_rows[b]; position j's K/V sit at slot
 * page_table[row * ld_pt + j] of k_cache / v_cache ([slots, hk, D]).
 *
 * Work items are (decode, range of up to ATTN_SPLIT positions): a long sequence spreads over
 * the threads, and since the split depends only on the sequence's own length, its result does
 * not depend on the batch or the thread count. An item computes every query head; the heads of
 * one KV head share every K/V load; softmax runs online over tiles of ATTN_TILE positions
 * (running max and sum); a second pass merges each decode's items. Decodes of one table row (a
 * speculative verify's rows, side by side in the batch) read the same K/V: their items of one
 * range are one unit of work that takes each K/V tile through all of them in turn, so it comes
 * from memory once and from this core's L1 for the others.
 *
 * A pool of another format than fp32 (kv_format != 0: fp8, f16, bf16; common.h) holds codes:
 * each tile's K and V rows are decoded to fp32 in a scratch tile first, then attended to as fp32
 * rows. The K scale comes folded into `scale`;
 * outputs are multiplied by v_scale. */
#include <stdlib.h>

#include "common.h"

#define ATTN_SPLIT 128 /* KV positions per work item (2+ items per sequence from 129 on) */
#define ATTN_MAX_HEADS 128 /* query heads (on this rank) */
#define ATTN_MAX_GROUP_CHUNK 4 /* query heads of one KV head computed together */
#define ATTN_MAX_HEAD_DIM 256

static inline void axpy(float* y, float a, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vload(y + i) + vload(x + i) * a);
    for (; i < n; i++) y[i] += x[i] * a;
}

static inline void prefetch_row(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

#if VW == 16
/* Lane i = vsum(a[i]), by the same additions (the same bits), for 16 vectors at once: each
 * level adds the two halves of two vectors held side by side in one register, so 16 sums take
 * 46 instructions instead of 128, and no chain of dependent shuffles per sum. */
static inline vf vsum16(const vf a[16]) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){8, 9, 10, 11, 12, 13, 14, 15,
                                      24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1],
                                 (vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
               __builtin_shuffle(c[2 * i], c[2 * i + 1],
                                 (vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    /* (the last level also puts vector i's sum in lane i) */
    return __builtin_shuffle(d[0], d[1],
                             (vi){0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30}) +
           __builtin_shuffle(d[0], d[1],
                             (vi){1, 5, 9, 13, 3, 7, 11, 15, 17, 21, 25, 29, 19, 23, 27, 31});
}
#endif

/* Decodes of one table row over the same positions from `begin` on, attended to together:
 * each K/V tile is read from memory once, then from this core's L1 for the others. */
#define ATTN_MAX_ROWS 16 /* (a larger group goes in turns) */
typedef struct {
    int64_t count, hq;
    const float* q[ATTN_MAX_ROWS]; /* row r's queries [hq, D] */
    int64_t end[ATTN_MAX_ROWS];    /* row r's positions: [begin, end[r]) */
    float* part[ATTN_MAX_ROWS];    /* row r's running max [hq], sum [hq], accumulators [hq, D] */
} attn_rows;

/* Unnormalized attention of GC query heads h.. of each row ([GC, D]; they share one KV head, at
 * kv_offset in each K/V row) over its positions: per head the running max, the sum of
 * exponentials and the exponential-weighted sum of V. Every K/V vector loaded serves all GC
 * heads; each row takes the same additions as it would alone. Inlined into copies for constant
 * GC and common D (see attend_heads), so queries, dot products and accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void attend_heads_impl(
    const attn_rows* rows, int64_t h, const void* k_cache, const void* v_cache,
    const int32_t* slots, int64_t begin, int64_t row_width, int64_t kv_offset, const int64_t GC,
    const int64_t D, int kv_format, float* kv_tiles, float scale) {
    const int64_t vecs = D / VW, tail_start = vecs * VW, hq = rows->hq;
    const int64_t elem = kv_bytes(kv_format);
    float scores[ATTN_MAX_GROUP_CHUNK][ATTN_TILE];
    float correction[ATTN_MAX_GROUP_CHUNK];
    const void* keys[ATTN_TILE];
    const void* values[ATTN_TILE];
    vf qv[ATTN_MAX_GROUP_CHUNK][ATTN_MAX_HEAD_DIM / VW];
    int64_t end = begin;
    for (int64_t r = 0; r < rows->count; r++) {
        end = max64(end, rows->end[r]);
        for (int64_t j = 0; j < GC; j++) {
            rows->part[r][h + j] = -INFINITY;
            rows->part[r][hq + h + j] = 0.0f;
            memset(rows->part[r] + 2 * hq + (h + j) * D, 0, (size_t)D * sizeof(float));
        }
    }
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_TILE) {
        const int64_t n_any = end - t0 < ATTN_TILE ? end - t0 : ATTN_TILE;
        for (int64_t t = 0; t < n_any; t++) {
            const int64_t offset = ((int64_t)slots[t0 + t] * row_width + kv_offset) * elem;
            keys[t] = (const char*)k_cache + offset;
            values[t] = (const char*)v_cache + offset;
        }
        if (kv_format) {
            decode_rows(keys, n_any, D, kv_format, kv_tiles);
            decode_rows(values, n_any, D, kv_format, kv_tiles + ATTN_TILE * D);
        }
        for (int64_t r = 0; r < rows->count; r++) {
            const int64_t n = min64(n_any, rows->end[r] - t0);
            if (n <= 0) continue;
            const float* q = rows->q[r] + h * D;
            float *part_max = rows->part[r] + h, *part_sum = rows->part[r] + hq + h;
            float* part_acc = rows->part[r] + 2 * hq + h * D;
            for (int64_t j = 0; j < GC; j++)
                for (int64_t c = 0; c < vecs; c++) qv[j][c] = vload(q + j * D + c * VW) * scale;
#if VW == 16
            if (tail_start == D) { /* 16 positions' dot products summed across lanes at once */
                for (int64_t u0 = 0; u0 < n; u0 += 16) {
                    vf lanes[ATTN_MAX_GROUP_CHUNK][16];
                    for (int64_t u = 0; u < 16; u++) {
                        const int64_t t = u0 + u;
                        if (t + ATTN_PREFETCH < n) prefetch_row(keys[t + ATTN_PREFETCH], D);
                        vf dot[ATTN_MAX_GROUP_CHUNK];
                        for (int64_t j = 0; j < GC; j++) dot[j] = (vf){0};
                        for (int64_t c = 0; c < vecs && t < n; c++) {
                            const vf kv = vload((const float*)keys[t] + c * VW);
                            for (int64_t j = 0; j < GC; j++) dot[j] += qv[j][c] * kv;
                        }
                        for (int64_t j = 0; j < GC; j++) lanes[j][u] = dot[j];
                    }
                    for (int64_t j = 0; j < GC; j++) vstore(&scores[j][u0], vsum16(lanes[j]));
                }
            } else
#endif
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
                    for (int64_t i = tail_start; i < D; i++)
                        part_acc[j * D + i] += value[i] * scores[j][t];
            }
            for (int64_t j = 0; j < GC; j++)
                for (int64_t c = 0; c < vecs; c++) vstore(part_acc + j * D + c * VW, av[j][c]);
        }
    }
}

#define ATTEND_HEADS_FOR_D(GC_VALUE)                                                            \
    do {                                                                                        \
        if (D == 64)                                                                            \
            attend_heads_impl(rows, h, k_cache, v_cache, slots, begin, row_width, kv_offset,    \
                              GC_VALUE, 64, kv_format, tiles, scale);                                 \
        else if (D == 128)                                                                      \
            attend_heads_impl(rows, h, k_cache, v_cache, slots, begin, row_width, kv_offset,    \
                              GC_VALUE, 128, kv_format, tiles, scale);                                \
        else                                                                                    \
            attend_heads_impl(rows, h, k_cache, v_cache, slots, begin, row_width, kv_offset,    \
                              GC_VALUE, D, kv_format, tiles, scale);                                  \
    } while (0)

static void attend_heads(const attn_rows* rows, int64_t h, const void* k_cache,
                         const void* v_cache, const int32_t* slots, int64_t begin,
                         int64_t row_width, int64_t kv_offset, int64_t gc, int64_t D,
                         int kv_format, float* tiles, float scale) {
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

/* Every query head of the rows over their positions from `begin` on. */
static void attend_range(const attn_rows* rows, const void* k_cache, const void* v_cache,
                         const int32_t* slots, int64_t begin, int64_t hk, int64_t group,
                         int64_t D, int kv_format, float scale) {
    const int64_t gc = group_chunk(group), row_width = hk * D;
    float kv_tiles[kv_format ? 2 * ATTN_TILE * D : 1]; /* decoded K and V rows of one tile */
    for (int64_t h = 0; h < hk * group; h += gc)
        attend_heads(rows, h, k_cache, v_cache, slots, begin, row_width, (h / group) * D, gc, D,
                     kv_format, kv_tiles, scale);
}

int64_t attention_count_items(const attention_args* a, int64_t* first_item) {
    if (a->hq > ATTN_MAX_HEADS || a->D > ATTN_MAX_HEAD_DIM || a->hk < 1 || a->hq % a->hk != 0)
        return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < a->B; b++)
        first_item[b + 1] = first_item[b] + (a->kv_lens[b] + ATTN_SPLIT - 1) / ATTN_SPLIT;
    return first_item[a->B];
}

/* Decode b's group: b up to the first decode after it of another table row. */
static int64_t group_end(const attention_args* a, int64_t b) {
    int64_t end = b + 1;
    while (end < a->B && a->table_rows[end] == a->table_rows[b]) end++;
    return end;
}

/* The work items of the group's longest decode. */
static int64_t group_splits(const int64_t* first_item, int64_t b, int64_t end) {
    int64_t splits = 0;
    for (int64_t i = b; i < end; i++) splits = max64(splits, first_item[i + 1] - first_item[i]);
    return splits;
}

int64_t attention_fill_units(const attention_args* a, const int64_t* first_item, int nthreads,
                             attention_unit* units) {
    int64_t whole = 0;
    for (int64_t b = 0, end; b < a->B; b = end) {
        end = group_end(a, b);
        whole += group_splits(first_item, b, end);
    }
    /* Too few for the threads (a batch-1 verify over a few hundred positions: 2-3 units, one
     * of them short): each group's rows go in two halves, each half reading the K/V itself. */
    const int halves = whole < 2 * nthreads;
    int64_t count = 0;
    for (int64_t b = 0, end; b < a->B; b = end) {
        end = group_end(a, b);
        const int64_t mid = halves ? b + (end - b + 1) / 2 : end;
        for (int64_t split = 0, splits = group_splits(first_item, b, end); split < splits;
             split++) {
            units[count++] = (attention_unit){b, mid, split};
            if (mid < end) units[count++] = (attention_unit){mid, end, split};
        }
    }
    return count;
}

int64_t attention_part_floats(const attention_args* a) { return a->hq * (a->D + 2); }

void attention_units_range(const void* args, int64_t begin, int64_t end) {
    const attention_args* a = args;
    const int64_t group = a->hq / a->hk, part_width = attention_part_floats(a);
    for (int64_t unit = begin; unit < end; unit++) {
        const int64_t first_b = a->units[unit].first_b, last_b = a->units[unit].end_b;
        const int64_t split = a->units[unit].split, first = split * ATTN_SPLIT;
        attn_rows rows = {.count = 0, .hq = a->hq};
        for (int64_t b = first_b; b < last_b; b++) {
            const int64_t item = a->first_item[b] + split;
            if (item < a->first_item[b + 1]) { /* (not a shorter decode of the group) */
                const int64_t r = rows.count++;
                rows.q[r] = a->q + (a->q_rows ? a->q_rows[b] : b) * a->ldq;
                rows.end[r] = min64(first + ATTN_SPLIT, a->kv_lens[b]);
                rows.part[r] = a->parts + item * part_width;
            }
            if (rows.count == ATTN_MAX_ROWS || (b + 1 == last_b && rows.count)) {
                attend_range(&rows, a->k_cache, a->v_cache,
                             a->page_table + a->table_rows[first_b] * a->ld_pt, first, a->hk,
                             group, a->D, a->kv_format, a->scale);
                rows.count = 0;
            }
        }
    }
}

void attention_merge_range(const void* args, int64_t begin, int64_t end) {
    const attention_args* a = args;
    const int64_t hq = a->hq, D = a->D, part_width = attention_part_floats(a);
    for (int64_t b = begin; b < end; b++) {
        float* o = a->out + (a->q_rows ? a->q_rows[b] : b) * a->ldo;
        const int64_t first = a->first_item[b], last = a->first_item[b + 1];
        for (int64_t h = 0; h < hq; h++) {
            float max = -INFINITY, denom = 0.0f;
            for (int64_t i = first; i < last; i++) max = fmaxf(max, a->parts[i * part_width + h]);
            memset(o + h * D, 0, (size_t)D * sizeof(float));
            for (int64_t i = first; i < last; i++) {
                const float* part = a->parts + i * part_width;
                const float weight = sexp(part[h] - max);
                denom += part[hq + h] * weight;
                axpy(o + h * D, weight, part + 2 * hq + h * D, D);
            }
            const float inv = a->v_scale / denom;
            for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
        }
    }
}

/* Returns 0, 1 for unsupported head counts / head_dim, 2 when out of memory. */
int mg_decode_attention(const float* q, int64_t ldq, const int64_t* q_rows, const void* k_cache,
                        const void* v_cache, const int32_t* page_table, int64_t ld_pt,
                        const int64_t* table_rows, const int64_t* kv_lens, float* out,
                        int64_t ldo, int64_t B, int64_t hq, int64_t hk, int64_t D, float scale,
                        int kv_format, float v_scale, int nthreads) {
    attention_args a = {q,   ldq, q_rows, k_cache, v_cache, page_table, ld_pt, table_rows,
                        kv_lens, out, ldo, B, hq, hk, D, scale, 0, 0, 0, kv_format, v_scale};
    if (B == 0) return 0;
    int64_t* first_item = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first_item) return 2;
    const int64_t items = attention_count_items(&a, first_item);
    if (items < 0) {
        free(first_item);
        return 1;
    }
    attention_unit* units = malloc((size_t)(2 * items) * sizeof(attention_unit));
    float* parts = malloc((size_t)(items * attention_part_floats(&a)) * sizeof(float));
    int status = 2;
    if (units && parts) {
        a.first_item = first_item, a.units = units, a.parts = parts;
        run_parallel(&a, attention_units_range,
                     attention_fill_units(&a, first_item, nthreads, units), 1, nthreads);
        run_parallel(&a, attention_merge_range, B, 1, nthreads);
        status = 0;
    }
    free(first_item), free(units), free(parts);
    return status;
}
