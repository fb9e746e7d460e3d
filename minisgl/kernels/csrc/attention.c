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
 * (running max and sum); a second pass merges each decode's items.
 *
 * An fp8 pool (fp8 != 0, common.h) holds codes: each tile's K and V rows are decoded to fp32 in
 * a scratch tile first, then attended to as fp32 rows. The K scale comes folded into `scale`;
 * outputs are multiplied by v_scale. */
#include <stdlib.h>

#include "common.h"

#define ATTN_TILE 64 /* KV positions per online-softmax tile */
#define ATTN_SPLIT 128 /* KV positions per work item (2+ items per sequence from 129 on) */
#define ATTN_MAX_HEADS 128 /* query heads (on this rank) */
#define ATTN_MAX_GROUP_CHUNK 4 /* query heads of one KV head computed together */
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_PREFETCH 8 /* K/V rows fetched this many positions ahead */

static inline void axpy(float* y, float a, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vload(y + i) + vload(x + i) * a);
    for (; i < n; i++) y[i] += x[i] * a;
}

static inline void prefetch_row(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

/* The n fp8 rows of D codes at rows[t] decoded into tile [n, D]; rows[t] then point there. */
static void decode_fp8_rows(const void** rows, int64_t n, int64_t D, int fp8, float* tile) {
    for (int64_t t = 0; t < n; t++) {
        if (t + ATTN_PREFETCH < n) __builtin_prefetch(rows[t + ATTN_PREFETCH], 0, 3);
        const uint8_t* codes = rows[t];
        float* row = tile + t * D;
        int64_t i = 0;
        for (; i + VW <= D; i += VW) vstore(row + i, fp8_vload(codes + i, fp8));
        for (; i < D; i++) row[i] = fp8_get(codes, i, fp8);
        rows[t] = row;
    }
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
    const float* q, const void* k_cache, const void* v_cache, const int32_t* slots,
    int64_t begin, int64_t end, int64_t row_width, int64_t kv_offset, const int64_t GC,
    const int64_t D, int fp8, float* fp8_tiles, float scale, float* part_max, float* part_sum,
    float* part_acc) {
    const int64_t vecs = D / VW, tail_start = vecs * VW;
    const int64_t elem = fp8 ? 1 : (int64_t)sizeof(float);
    float scores[ATTN_MAX_GROUP_CHUNK][ATTN_TILE];
    float correction[ATTN_MAX_GROUP_CHUNK];
    const void* keys[ATTN_TILE];
    const void* values[ATTN_TILE];
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
            const int64_t offset = ((int64_t)slots[t0 + t] * row_width + kv_offset) * elem;
            keys[t] = (const char*)k_cache + offset;
            values[t] = (const char*)v_cache + offset;
        }
        if (fp8) {
            decode_fp8_rows(keys, n, D, fp8, fp8_tiles);
            decode_fp8_rows(values, n, D, fp8, fp8_tiles + ATTN_TILE * D);
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
                              GC_VALUE, 64, fp8, tiles, scale, part_max, part_sum, part_acc);   \
        else if (D == 128)                                                                      \
            attend_heads_impl(q, k_cache, v_cache, slots, begin, end, row_width, kv_offset,     \
                              GC_VALUE, 128, fp8, tiles, scale, part_max, part_sum, part_acc);  \
        else                                                                                    \
            attend_heads_impl(q, k_cache, v_cache, slots, begin, end, row_width, kv_offset,     \
                              GC_VALUE, D, fp8, tiles, scale, part_max, part_sum, part_acc);    \
    } while (0)

static void attend_heads(const float* q, const void* k_cache, const void* v_cache,
                         const int32_t* slots, int64_t begin, int64_t end, int64_t row_width,
                         int64_t kv_offset, int64_t gc, int64_t D, int fp8, float* tiles,
                         float scale, float* part_max, float* part_sum, float* part_acc) {
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
static void attend_range(const float* q, const void* k_cache, const void* v_cache,
                         const int32_t* slots, int64_t begin, int64_t end, int64_t hk,
                         int64_t group, int64_t D, int fp8, float scale, float* part_max,
                         float* part_sum, float* part_acc) {
    const int64_t gc = group_chunk(group), row_width = hk * D;
    float fp8_tiles[fp8 ? 2 * ATTN_TILE * D : 1]; /* decoded K and V rows of one tile */
    for (int64_t h = 0; h < hk * group; h += gc) {
        attend_heads(q + h * D, k_cache, v_cache, slots, begin, end, row_width, (h / group) * D,
                     gc, D, fp8, fp8_tiles, scale, part_max + h, part_sum + h, part_acc + h * D);
    }
}

int64_t attention_count_items(const attention_args* a, int64_t* first_item) {
    if (a->hq > ATTN_MAX_HEADS || a->D > ATTN_MAX_HEAD_DIM || a->hk < 1 || a->hq % a->hk != 0)
        return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < a->B; b++)
        first_item[b + 1] = first_item[b] + (a->kv_lens[b] + ATTN_SPLIT - 1) / ATTN_SPLIT;
    return first_item[a->B];
}

void attention_fill_item_seq(const attention_args* a, const int64_t* first_item,
                             int64_t* item_seq) {
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) item_seq[i] = b;
}

int64_t attention_part_floats(const attention_args* a) { return a->hq * (a->D + 2); }

void attention_items_range(const void* args, int64_t begin, int64_t end) {
    const attention_args* a = args;
    const int64_t group = a->hq / a->hk, part_width = attention_part_floats(a);
    for (int64_t item = begin; item < end; item++) {
        const int64_t b = a->item_seq[item];
        const int64_t first = (item - a->first_item[b]) * ATTN_SPLIT;
        const int64_t last = min64(first + ATTN_SPLIT, a->kv_lens[b]);
        float* part = a->parts + item * part_width;
        const int64_t row = a->q_rows ? a->q_rows[b] : b;
        attend_range(a->q + row * a->ldq, a->k_cache, a->v_cache,
                     a->page_table + a->table_rows[b] * a->ld_pt, first, last, a->hk, group, a->D,
                     a->fp8, a->scale, part, part + a->hq, part + 2 * a->hq);
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
                        int fp8, float v_scale, int nthreads) {
    attention_args a = {q,   ldq, q_rows, k_cache, v_cache, page_table, ld_pt, table_rows,
                        kv_lens, out, ldo, B, hq, hk, D, scale, 0, 0, 0, fp8, v_scale};
    if (B == 0) return 0;
    int64_t* first_item = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first_item) return 2;
    const int64_t items = attention_count_items(&a, first_item);
    if (items < 0) {
        free(first_item);
        return 1;
    }
    int64_t* item_seq = malloc((size_t)items * sizeof(int64_t));
    float* parts = malloc((size_t)(items * attention_part_floats(&a)) * sizeof(float));
    int status = 2;
    if (item_seq && parts) {
        attention_fill_item_seq(&a, first_item, item_seq);
        a.first_item = first_item, a.item_seq = item_seq, a.parts = parts;
        run_parallel(&a, attention_items_range, items, 1, nthreads);
        run_parallel(&a, attention_merge_range, B, 1, nthreads);
        status = 0;
    }
    free(first_item), free(item_seq), free(parts);
    return status;
}
