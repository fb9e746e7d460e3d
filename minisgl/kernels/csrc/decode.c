/* A whole dense decoder stack for a decode-only batch in one call.
 *
 * Sequence b computes one token at positions[b] of table row table_rows[b] (KV length
 * kv_lens[b], its K/V stored at out_slots[b]). Per layer, exactly the op-by-op path's kernels in
 * the same order (so the same numbers):
 *   normed = rmsnorm(hidden + residual)        (layer 0: residual = hidden, normed = rmsnorm)
 *   qkv = normed @ Wqkv^T (+ bias); q/k head norms (Qwen3); rope; store k, v
 *   attn = paged decode attention;  o = attn @ Wo^T
 *   normed = rmsnorm(o + residual);  hidden = silu_mul(normed @ Wgu^T) @ Wdown^T
 * On return `hidden` holds the last layer's output plus the residual: what the final norm
 * takes. Pool layout: [layers, 2 (k, v), num_slots, kv_heads, head_dim], contiguous.
 *
 * The whole step is one OpenMP region: the ~10 ops of each layer are handed to the team and meet
 * at its barrier (team_run, parallel.c), not at libgomp's. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"

#define OPS_PER_LAYER 12 /* team_run calls per layer, an upper bound */
#define OPS_PER_STEP 4 /* team_run calls outside the layers, an upper bound */

int mg_abi_version(void) { return MG_ABI_VERSION; }

/* ---- the stack -------------------------------------------------------------------------------- */
typedef struct {
    const float* input_norm;
    const float* post_norm;
    const mg_weight* qkv;
    const float* qkv_bias; /* NULL: none */
    const float* q_norm;   /* NULL: no per-head q/k norm */
    const float* k_norm;
    const mg_weight* o;
    const mg_weight* gate_up;
    const mg_weight* down;
} mg_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, head_norm_eps, scale;
    const float* cos_cache;
    const float* sin_cache;
    const mg_layer* layers;
} mg_model;

/* Per-op time, summed over layers, when the caller passes MG_NUM_OPS doubles
 * (benchmark/offline/profile_decode.py); NULL costs nothing. Wall time, or with one thread its
 * CPU time (exact when other processes share the cores). */
enum {
    OP_NORM, OP_QKV, OP_HEAD_NORM, OP_ROPE_STORE, OP_ATTENTION, OP_O_PROJ, OP_GATE_UP,
    OP_SILU_MUL, OP_DOWN, MG_NUM_OPS
};
int mg_num_ops(void) { return MG_NUM_OPS; }

static inline int64_t op_clock_ns(double* op_seconds, int nthreads) {
    if (!op_seconds) return 0;
    if (nthreads > 1) return now_ns();
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void lap(double* op_seconds, int op, int64_t* last, int nthreads) {
    if (!op_seconds) return;
    const int64_t t = op_clock_ns(op_seconds, nthreads);
    op_seconds[op] += 1e-9 * (double)(t - *last);
    *last = t;
}

/* Floats of scratch mg_decode_layers needs for B sequences (besides attention's). */
int64_t mg_decode_scratch_floats(const mg_model* m, int64_t B) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return B * (3 * m->hidden + (q + 2 * kv) + q + 3 * m->inter);
}

typedef struct {
    const float* src;
    float* dst;
    int64_t width;
    int add; /* dst += src instead of dst = src */
} rows_args;

static void rows_range(const void* args, int64_t begin, int64_t end) {
    const rows_args* a = args;
    for (int64_t r = begin; r < end; r++) {
        const float* s = a->src + r * a->width;
        float* d = a->dst + r * a->width;
        if (!a->add) {
            memcpy(d, s, (size_t)a->width * sizeof(float));
            continue;
        }
        for (int64_t i = 0; i < a->width; i++) d[i] += s[i];
    }
}

typedef struct {
    rope_args rope;
    store_kv_args store;
} rope_store_args;

static void rope_store_range(const void* args, int64_t begin, int64_t end) {
    const rope_store_args* a = args;
    rope_range(&a->rope, begin, end);
    store_kv_range(&a->store, begin, end);
}

typedef struct {
    const mg_model* m;
    float* hidden;
    int64_t B;
    const int64_t* positions;
    const int64_t* out_slots;
    void* pool; /* fp32, or codes (kv_format) scaled by kv_scales [layers, 2 (k, v)] */
    int64_t num_slots;
    int kv_format;
    const float* kv_scales;
    float* scratch;
    attention_args attention; /* with its items planned */
    int64_t attention_units;
    double* op_seconds; /* recorded by thread 0 */
    int64_t tags; /* the first of the linear ops' tags (4 per layer) */
} step_args;

/* One thread's part of a step (every thread runs it). Returns 0, or 1 if out of counters. */
static int decode_step(mg_team* team, const step_args* s, int is_timer) {
    const mg_model* m = s->m;
    const int64_t B = s->B, H = m->hidden, D = m->head_dim, I = m->inter;
    const int64_t q_width = m->heads * D, kv_width = m->kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int nthreads = team->size;
    float* residual = s->scratch;
    float* normed = residual + B * H;
    float* o = normed + B * H;
    float* qkv = o + B * H;
    float* attn = qkv + B * qkv_width;
    float* gate_up = attn + B * q_width;
    float* act = gate_up + B * 2 * I;
    double* timers = is_timer ? s->op_seconds : 0;
    int64_t last = op_clock_ns(timers, nthreads);
    const int64_t elem_bytes = kv_bytes(s->kv_format);
    const int64_t cache_bytes = s->num_slots * kv_width * elem_bytes;
    const int64_t rows = max64(1, (B + 2 * nthreads - 1) / (2 * nthreads)); /* row chunk */
    int failed = 0;
    const rows_args copy = {s->hidden, residual, B * H, 0};
    failed |= team_run(team, &copy, rows_range, 1, 1);
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const mg_layer* L = &m->layers[l];
        char* k_cache = (char*)s->pool + (2 * l) * cache_bytes;
        char* v_cache = (char*)s->pool + (2 * l + 1) * cache_bytes;
        const float k_scale = s->kv_scales[2 * l], v_scale = s->kv_scales[2 * l + 1];
        const rmsnorm_args norm1 = {s->hidden, H, 1, l ? residual : 0, H, L->input_norm,
                                    normed, H, H, m->eps};
        failed |= team_run(team, &norm1, rmsnorm_range, B, rows);
        lap(timers, OP_NORM, &last, nthreads);
        const int64_t tag = s->tags + 4 * l; /* one per linear op below */
        const linear_args qkv_proj = {normed, H, L->qkv, L->qkv_bias, qkv, qkv_width, B, H,
                                      qkv_width, tag};
        failed |= team_run(team, &qkv_proj, linear_range, linear_items(&qkv_proj),
                           linear_chunk(&qkv_proj, nthreads));
        lap(timers, OP_QKV, &last, nthreads);
        float* q = qkv;
        float* k = qkv + q_width;
        float* v = k + kv_width;
        if (L->q_norm && L->k_norm) {
            const rmsnorm_args qn = {q, qkv_width, m->heads, 0, 0, L->q_norm, q, qkv_width, D,
                                     m->head_norm_eps};
            const rmsnorm_args kn = {k, qkv_width, m->kv_heads, 0, 0, L->k_norm, k, qkv_width, D,
                                     m->head_norm_eps};
            failed |= team_run(team, &qn, rmsnorm_range, B * m->heads, rows * m->heads);
            failed |= team_run(team, &kn, rmsnorm_range, B * m->kv_heads, rows * m->kv_heads);
            lap(timers, OP_HEAD_NORM, &last, nthreads);
        }
        const rope_store_args rope_store = {
            {q, qkv_width, m->heads, k, qkv_width, m->kv_heads, D, s->positions, m->cos_cache,
             m->sin_cache},
            {k, qkv_width, v, qkv_width, k_cache, v_cache, s->out_slots, kv_width, s->kv_format,
             k_scale, v_scale}};
        failed |= team_run(team, &rope_store, rope_store_range, B, rows);
        lap(timers, OP_ROPE_STORE, &last, nthreads);
        attention_args attention = s->attention;
        attention.q = q, attention.ldq = qkv_width;
        attention.k_cache = k_cache, attention.v_cache = v_cache;
        attention.scale = m->scale * k_scale, attention.v_scale = v_scale;
        attention.out = attn, attention.ldo = q_width;
        failed |= team_run(team, &attention, attention_units_range, s->attention_units, 1);
        failed |= team_run(team, &attention, attention_merge_range, B, 1);
        lap(timers, OP_ATTENTION, &last, nthreads);
        const linear_args o_proj = {attn, q_width, L->o, 0, o, H, B, q_width, H, tag + 1};
        failed |= team_run(team, &o_proj, linear_range, linear_items(&o_proj),
                           linear_chunk(&o_proj, nthreads));
        lap(timers, OP_O_PROJ, &last, nthreads);
        const rmsnorm_args norm2 = {o, H, 1, residual, H, L->post_norm, normed, H, H, m->eps};
        failed |= team_run(team, &norm2, rmsnorm_range, B, rows);
        lap(timers, OP_NORM, &last, nthreads);
        const linear_args gu_proj = {normed, H, L->gate_up, 0, gate_up, 2 * I, B, H, 2 * I,
                                     tag + 2};
        failed |= team_run(team, &gu_proj, linear_range, linear_items(&gu_proj),
                           linear_chunk(&gu_proj, nthreads));
        lap(timers, OP_GATE_UP, &last, nthreads);
        const silu_mul_args silu = {gate_up, 2 * I, act, I, I};
        failed |= team_run(team, &silu, silu_mul_range, B, rows);
        lap(timers, OP_SILU_MUL, &last, nthreads);
        const linear_args down_proj = {act, I, L->down, 0, s->hidden, H, B, I, H, tag + 3};
        failed |= team_run(team, &down_proj, linear_range, linear_items(&down_proj),
                           linear_chunk(&down_proj, nthreads));
        lap(timers, OP_DOWN, &last, nthreads);
    }
    const rows_args add = {residual, s->hidden, H, 1};
    failed |= team_run(team, &add, rows_range, B, rows);
    lap(timers, OP_NORM, &last, nthreads);
    return failed;
}

/* Returns 0; 1 for attention shapes over the kernel's limits; 2 when out of memory; 3 when the
 * step ran out of work counters (a bug). */
int mg_decode_layers(const mg_model* m, float* hidden, int64_t B, const int64_t* positions,
                     const int64_t* out_slots, const int32_t* page_table, int64_t ld_pt,
                     const int64_t* table_rows, const int64_t* kv_lens, void* pool,
                     int64_t num_slots, int kv_format, const float* kv_scales, float* scratch,
                     double* op_seconds, int nthreads) {
    if (B == 0) return 0;
    step_args s = {m,        hidden,    B,       positions, out_slots, pool, num_slots,
                   kv_format, kv_scales, scratch,
                   {0, 0, 0, 0, 0, page_table, ld_pt, table_rows, kv_lens, 0, 0, B, m->heads,
                    m->kv_heads, m->head_dim, m->scale, 0, 0, 0, kv_format, 1.0f},
                   0, op_seconds, linear_tags(4 * m->num_layers)};
    const int64_t num_counters = m->num_layers * OPS_PER_LAYER + OPS_PER_STEP;
    int64_t* first_item = malloc((size_t)(B + 1) * sizeof(int64_t));
    atomic_llong* counters = calloc((size_t)num_counters, sizeof(atomic_llong));
    attention_unit* units = 0;
    float* parts = 0;
    int status = 2;
    if (!first_item || !counters) goto done;
    const int64_t items = attention_count_items(&s.attention, first_item);
    if (items < 0) {
        status = 1;
        goto done;
    }
    units = malloc((size_t)(2 * items) * sizeof(attention_unit));
    parts = malloc((size_t)(items * attention_part_floats(&s.attention)) * sizeof(float));
    if (!units || !parts) goto done;
    s.attention_units = attention_fill_units(&s.attention, first_item, nthreads, units);
    s.attention.first_item = first_item, s.attention.units = units;
    s.attention.parts = parts;
    mg_barrier barrier;
    atomic_init(&barrier.arrived, 0);
    atomic_init(&barrier.generation, 0);
    atomic_int failed;
    atomic_init(&failed, 0);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        mg_team team = {omp_get_num_threads(), &barrier, counters, num_counters, 0};
        if (decode_step(&team, &s, omp_get_thread_num() == 0)) atomic_store(&failed, 1);
    }
    status = atomic_load(&failed) ? 3 : 0;
done:
    free(first_item), free(counters), free(units), free(parts);
    return status;
}
