/* Shared by minisgl's fp32 CPU kernels (this folder): vector helpers, the work-splitting
 * primitives, and the ops' range functions that the standalone entry points (mg_* in each file,
 * one OpenMP region per call) and the fused decode stack (decode.c, one region per step) share.
 *
 * Built at first use by minisgl/kernels/cpu.py (gcc -O3 -march=native -fopenmp, every .c here
 * into one library) and called through ctypes with raw pointers: no torch headers, so the build
 * takes a second or two and needs nothing beyond a C compiler.
 *
 * Every kernel computes in fp32 with the formulas of the torch ops it replaces (only summation
 * order and fused multiply-adds differ; the one exception, opt-in GGUF blocks times int8
 * activations, is llama.cpp's arithmetic: quant_int8.c), and no result depends on the thread count or
 * on which thread computed it: work is split by output element, never inside one sum.
 *
 * The OpenMP runtime is the one torch already loaded (same soname): the kernels share torch's
 * thread pool, and callers pass torch's thread count explicitly.
 */
#ifndef MINISGL_CPU_COMMON_H
#define MINISGL_CPU_COMMON_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* Bumped whenever an exported signature changes, so a stale cached build is never called. */
#define MG_ABI_VERSION 10

/* Vector width in floats: GCC vector extensions compile to AVX-512, AVX2 or SSE/NEON. */
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

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

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

/* ---- K/V element formats ---------------------------------------------------------------------
 * `kv` names a KV pool's element type: 0 fp32; 4, 5: the fp8 formats by their exponent bits
 * (float8_e4m3fn, float8_e5m2); KV_F16, KV_BF16: float16, bfloat16. Each non-fp32 format is a
 * small float (sign, exponent, mantissa, IEEE bias): a code's bits below its sign, shifted into
 * an fp32's exponent and mantissa fields and rebiased, are its value as an fp32; a subnormal code
 * (exponent 0) gets the exponent 1 instead and the implicit leading one subtracted (as fast
 * half-to-float conversions do), so no step computes with a subnormal fp32 (slow on x86). Codes
 * of inf or NaN are not read as such: kv_encode saturates, so it writes none. */
enum { KV_F16 = 16, KV_BF16 = 17 };
static inline int kv_bits(int kv) { return kv < KV_F16 ? 8 : 16; }
static inline int64_t kv_bytes(int kv) { return kv ? kv_bits(kv) / 8 : (int64_t)sizeof(float); }
static inline int kv_exponent_bits(int kv) { return kv == KV_F16 ? 5 : kv == KV_BF16 ? 8 : kv; }
static inline int kv_shift(int kv) { return 24 + kv_exponent_bits(kv) - kv_bits(kv); } /* 23 - mantissa bits */
static inline uint32_t kv_bias(int kv) { return (1u << (kv_exponent_bits(kv) - 1)) - 1; }
static inline float kv_max(int kv) { /* the largest finite value */
    return kv == 4 ? 448.0f : kv == 5 ? 57344.0f : kv == KV_F16 ? 65504.0f : 0x1.FEp127f;
}
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

/* The VW codes at p (format kv, not fp32) as fp32, exactly. */
static inline __attribute__((always_inline)) vf kv_vload(const void* p, int kv) {
    vu x;
    vf f;
    if (kv_bits(kv) == 8) {
        vb codes;
        memcpy(&codes, p, sizeof codes);
        x = __builtin_convertvector(codes, vu);
    } else {
        vh codes;
        memcpy(&codes, p, sizeof codes);
#if defined(__F16C__) && VW == 8
        if (kv == KV_F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128(p));
#elif defined(__F16C__) && VW == 16
        if (kv == KV_F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(p));
#endif
        x = __builtin_convertvector(codes, vu);
        if (kv == KV_BF16) { /* the upper half of an fp32 */
            x <<= 16;
            memcpy(&f, &x, sizeof f);
            return f;
        }
    }
    const uint32_t sign = 1u << (kv_bits(kv) - 1), mantissa_bits = 23 - kv_shift(kv);
    const vu mag = x & (sign - 1);
    const vu subnormal = (vu)(mag >> mantissa_bits == 0); /* all ones where the exponent is 0 */
    const vu bits = (mag << kv_shift(kv)) + ((127 - kv_bias(kv) + (subnormal & 1)) << 23);
    const vu one = subnormal & ((128 - kv_bias(kv)) << 23); /* 2^(1 - bias) there, else 0 */
    vf lead;
    memcpy(&f, &bits, sizeof f);
    memcpy(&lead, &one, sizeof lead);
    f -= lead;
    vu out;
    memcpy(&out, &f, sizeof out);
    out |= (x & sign) << (32 - kv_bits(kv));
    memcpy(&f, &out, sizeof f);
    return f;
}
/* Element i of the codes at p (format kv, not fp32) as an fp32. */
static inline float kv_get(const void* p, int64_t i, int kv) {
    uint16_t lanes[VW] = {0};
    memcpy(lanes, (const char*)p + i * kv_bytes(kv), (size_t)kv_bytes(kv));
    return kv_vload(lanes, kv)[0];
}
static inline float pow2f(int e) { /* 2^e for e in [-126, 127] */
    const uint32_t bits = (uint32_t)(127 + e) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* x as the nearest code of format kv (not fp32; ties to even), saturated to its largest finite
 * value as torch's conversion of a clamped value. A normal code's value: x scaled by
 * 2^(bias - 127) into the fp32 whose fields the code's are (exactly), rounded at the code's last
 * mantissa bit; a subnormal one's: x in units of the code's smallest step, rounded to an integer
 * by the FPU (scaling into a subnormal fp32 instead would round twice). Writes kv_bytes(kv). */
static inline void kv_encode(float x, int kv, void* out) {
    const int bias = (int)kv_bias(kv), shift = kv_shift(kv);
    const float a = fminf(fabsf(x), kv_max(kv));
    uint32_t code;
    if (a < pow2f(1 - bias)) {
        code = (uint32_t)(a * pow2f(bias - 1) * pow2f(23 - shift) + 0x1p23f - 0x1p23f);
    } else {
        const float scaled = a * pow2f(bias - 127);
        uint32_t bits;
        memcpy(&bits, &scaled, sizeof bits);
        bits += (1u << (shift - 1)) - 1 + ((bits >> shift) & 1);
        code = bits >> shift;
    }
    code |= signbit(x) ? 1u << (kv_bits(kv) - 1) : 0u;
    if (kv_bits(kv) == 8)
        *(uint8_t*)out = (uint8_t)code;
    else
        *(uint16_t*)out = (uint16_t)code;
}

/* ---- attention (attention.c: decodes, chunk_attention.c: prefill chunks) ---------------------- */
#define ATTN_TILE 64 /* KV positions per online-softmax tile */
#define ATTN_PREFETCH 8 /* K/V rows fetched this many positions ahead */

/* The n rows of D codes (format kv) at rows[t] decoded into tile [n, D]; rows[t] then point
 * there. Inlined into one copy per format (decode_rows), so each loop knows its format. */
static inline __attribute__((always_inline)) void decode_rows_as(const void** rows, int64_t n,
                                                                 int64_t D, const int kv,
                                                                 float* tile) {
    for (int64_t t = 0; t < n; t++) {
        if (t + ATTN_PREFETCH < n) __builtin_prefetch(rows[t + ATTN_PREFETCH], 0, 3);
        const char* codes = rows[t];
        float* row = tile + t * D;
        int64_t i = 0;
        for (; i + VW <= D; i += VW) vstore(row + i, kv_vload(codes + i * kv_bytes(kv), kv));
        for (; i < D; i++) row[i] = kv_get(codes, i, kv);
        rows[t] = row;
    }
}

static inline void decode_rows(const void** rows, int64_t n, int64_t D, int kv, float* tile) {
    switch (kv) {
        case 4: decode_rows_as(rows, n, D, 4, tile); break;
        case 5: decode_rows_as(rows, n, D, 5, tile); break;
        case KV_F16: decode_rows_as(rows, n, D, KV_F16, tile); break;
        default: decode_rows_as(rows, n, D, KV_BF16, tile); break;
    }
}


/* Online-softmax update of `heads` rows of tile scores [.][ATTN_TILE] (n valid): turns them into
 * exponentials, folds the tile into the running max / sum, and returns through `correction`
 * the factor each head's accumulator must be scaled by first. */
static inline void softmax_tile(float (*scores)[ATTN_TILE], int64_t heads, int64_t n,
                                float* part_max, float* part_sum, float* correction) {
    for (int64_t j = 0; j < heads; j++) {
        vf maxes = vsplat(-INFINITY); /* (vectors: fmaxf is a libm call per position) */
        int64_t t = 0;
        for (; t + VW <= n; t += VW) maxes = vmax(maxes, vload(&scores[j][t]));
        float tile_max = -INFINITY;
        for (; t < n; t++) tile_max = scores[j][t] > tile_max ? scores[j][t] : tile_max;
        for (int i = 0; i < VW; i++) tile_max = maxes[i] > tile_max ? maxes[i] : tile_max;
        const float new_max = fmaxf(part_max[j], tile_max);
        correction[j] = part_max[j] == -INFINITY ? 1.0f : sexp(part_max[j] - new_max);
        part_max[j] = new_max;
        t = 0;
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

/* ---- splitting work over threads -------------------------------------------------------------
 * An op is a range function over `items` independent work items (rows, panels, ...). The
 * standalone entry points run it in one OpenMP region (run_parallel); the fused decode stack
 * runs a whole step in one region and hands each op to its team (team_run): threads take chunks
 * of items from a shared counter, then meet at a barrier that spins briefly and then yields the
 * core, so a thread another process preempted delays the others little and costs them no CPU
 * (both in parallel.c). */
typedef void (*range_fn)(const void* args, int64_t begin, int64_t end);

void run_parallel(const void* args, range_fn fn, int64_t items, int64_t chunk, int nthreads);

typedef struct {
    atomic_int arrived;
    atomic_int generation;
} mg_barrier;

typedef struct {
    int size;
    mg_barrier* barrier;
    atomic_llong* counters; /* one per team_run of a step, zeroed before the region */
    int64_t num_counters;
    int64_t next_counter; /* every thread walks the same sequence of ops */
} mg_team;

void team_sync(mg_team* team);
/* Runs fn over [0, items) in chunks across the team, then team_sync. Returns 0, or 1 when the
 * step needs more counters than were allocated (a bug: the op count per layer changed). */
int team_run(mg_team* team, const void* args, range_fn fn, int64_t items, int64_t chunk);

/* ---- the ops (range functions and their arguments) -------------------------------------------- */
/* A linear weight [N, K] as the kernels read it (minisgl/kernels/cpu_ops.py builds it). With no
 * segments: fp32 column panels (linear.c). Else GGUF block rows (quant.c): segment s is
 * rows[s] output rows of GGUF type types[s], and the segments' rows lie back to back at data
 * (a merged qkv may hold q and k as Q4_K and v as Q6_K). */
#define MG_MAX_SEGMENTS 4
typedef struct {
    const void* data;
    int64_t num_segments;
    int64_t types[MG_MAX_SEGMENTS];
    int64_t rows[MG_MAX_SEGMENTS];
} mg_weight;

typedef struct {
    const float* x;
    int64_t ldx;
    const mg_weight* w;
    const float* bias;
    float* y;
    int64_t ldy, M, K, N;
    /* Tells ops apart for quant.c's int8 path (which quantizes x once per op and thread): the
     * same for every thread's part of one op, never reused; 0 for "quantize again". */
    int64_t tag;
    int x_rounded; /* x already holds its int8 values (quant_round_x): take the fp32 panels */
} linear_args;
/* A fresh linear_args tag (and `count` - 1 more after it). */
int64_t linear_tags(int64_t count);
int64_t linear_items(const linear_args* a);
int64_t linear_chunk(const linear_args* a, int nthreads);
void linear_range(const void* args, int64_t begin, int64_t end);
#define MC (8 * MR) /* rows of x per work item */
/* y[rows, ncols] = x[rows, K] times one packed panel [K, NB] (+ bias): linear.c's tiles */
void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t K,
                      const float* bias, float* y, int64_t ldy, int64_t ncols);
/* the GGUF block path of the three above (quant.c) */
int64_t quant_items(const linear_args* a);
void quant_range(const void* args, int64_t begin, int64_t end);
/* For the int8 path's large batches (prefill): x rounded to its int8 values per 32 elements, in
 * a new [M, K] buffer the caller frees, for the fp32 panels to multiply (the same result up to
 * rounding, and faster there); NULL when op a does not need it (or out of memory). */
float* quant_round_x(const linear_args* a, int nthreads);

typedef struct {
    const float* x;
    int64_t ldx, heads;
    float* residual; /* NULL, or [T, H] with row stride ldr: x + residual is normalized */
    int64_t ldr;
    const float* w;
    float* out;
    int64_t ldo, H;
    float eps;
} rmsnorm_args;
void rmsnorm_range(const void* args, int64_t begin, int64_t end); /* rows: T * heads */

typedef struct {
    const float* gu;
    int64_t ldg;
    float* out;
    int64_t ldo, I;
} silu_mul_args;
void silu_mul_range(const void* args, int64_t begin, int64_t end); /* rows */

typedef struct {
    float* q;
    int64_t ldq, hq;
    float* k;
    int64_t ldk, hk, D;
    const int64_t* positions;
    const float* cos_cache;
    const float* sin_cache;
} rope_args;
void rope_range(const void* args, int64_t begin, int64_t end); /* tokens */

typedef struct {
    const float* k;
    int64_t ldk;
    const float* v;
    int64_t ldv;
    void* k_cache; /* format kv_format: fp32, or codes of k / k_scale and v / v_scale */
    void* v_cache;
    const int64_t* slots;
    int64_t width;
    int kv_format;
    float k_scale, v_scale;
} store_kv_args;
void store_kv_range(const void* args, int64_t begin, int64_t end); /* tokens */

typedef struct {
    const float* q;
    int64_t ldq;
    const int64_t* q_rows; /* NULL: decode b's query is row b */
    const void* k_cache; /* format kv_format: fp32, or codes (k_scale folded into scale) */
    const void* v_cache;
    const int32_t* page_table;
    int64_t ld_pt;
    const int64_t* table_rows;
    const int64_t* kv_lens;
    float* out;
    int64_t ldo, B, hq, hk, D;
    float scale;
    /* work items: decode b owns items [first_item[b], first_item[b + 1]); a unit of work is
     * one split's items of some decodes of one table row (attention.c) */
    const int64_t* first_item;
    const struct attention_unit* units;
    float* parts; /* per item: max [hq], sum [hq], acc [hq, D] */
    int kv_format;
    float v_scale; /* outputs are multiplied by it */
} attention_args;
/* Checks the shapes and fills first_item [B + 1]; returns the item count, or -1 when the head
 * count or head_dim is over the kernel's limits. */
int64_t attention_count_items(const attention_args* a, int64_t* first_item);
/* Decodes [first_b, end_b) (of one table row), their items of positions split * ATTN_SPLIT on. */
typedef struct attention_unit {
    int64_t first_b, end_b, split;
} attention_unit;
/* Fills units (room for two per item); returns their count. */
int64_t attention_fill_units(const attention_args* a, const int64_t* first_item, int nthreads,
                             attention_unit* units);
int64_t attention_part_floats(const attention_args* a); /* per item */
void attention_units_range(const void* args, int64_t begin, int64_t end);
void attention_merge_range(const void* args, int64_t begin, int64_t end); /* decodes */

#endif
