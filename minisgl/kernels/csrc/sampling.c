/* Sampling: the seeded uniforms of minisgl/engine/sampler.py bit for bit, and temperature
 * sampling (softmax and the exponential race) in one pass per row. */
#include <stdint.h>

#include "common.h"

/* ---- seeded uniforms --------------------------------------------------------------------------
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

/* 23: every u exact in float32 and < 1 (sampler.py's _UNIFORM_BITS says why) */
#define UNIFORM_BITS 23
#define UNIFORM_CHUNK 4096 /* vocab ids per work item */

/* The row's hash key, from its seed and the position being sampled. */
static inline uint32_t row_key(int64_t seed, int64_t position) {
    return mix32(mix32((uint32_t)seed) ^ (uint32_t)position);
}

/* The uniform of vocab id i in the row of `key`: (top UNIFORM_BITS bits of the hash + 0.5) /
 * 2^UNIFORM_BITS. The one definition both the uniforms and the sampler below use. */
static inline float suniform(uint32_t key, uint32_t i) {
    const uint32_t h = mix32(mix32(key * 0x9E3779B1u + i) ^ key);
    return ((float)(h >> (32 - UNIFORM_BITS)) + 0.5f) * (1.0f / (float)(1 << UNIFORM_BITS));
}

/* The same for ids first + lane[0 .. VW). */
static inline vf vuniform(uint32_t key, uint32_t first, vu lane) {
    const vu h = vmix32(vmix32(key * 0x9E3779B1u + (first + lane)) ^ key);
    const vf top = __builtin_convertvector((vi)(h >> (32 - UNIFORM_BITS)), vf);
    return (top + 0.5f) * (1.0f / (float)(1 << UNIFORM_BITS));
}

typedef struct {
    const int64_t* seeds;
    const int64_t* positions;
    int64_t vocab;
    float* out;
} uniform_args;

static void uniform_range(const void* args, int64_t begin, int64_t end) {
    const uniform_args* a = args;
    const int64_t chunks = (a->vocab + UNIFORM_CHUNK - 1) / UNIFORM_CHUNK;
    vu lane;
    for (int i = 0; i < VW; i++) lane[i] = (uint32_t)i;
    for (int64_t item = begin; item < end; item++) {
        const int64_t r = item / chunks, first = (item % chunks) * UNIFORM_CHUNK;
        const int64_t last = min64(first + UNIFORM_CHUNK, a->vocab);
        const uint32_t key = row_key(a->seeds[r], a->positions[r]);
        float* o = a->out + r * a->vocab;
        int64_t i = first;
        for (; i + VW <= last; i += VW) vstore(o + i, vuniform(key, (uint32_t)i, lane));
        for (; i < last; i++) o[i] = suniform(key, (uint32_t)i);
    }
}

void mg_seeded_uniform(const int64_t* seeds, const int64_t* positions, int64_t rows,
                       int64_t vocab, float* out, int nthreads) {
    const uniform_args a = {seeds, positions, vocab, out};
    const int64_t chunks = (vocab + UNIFORM_CHUNK - 1) / UNIFORM_CHUNK;
    run_parallel(&a, uniform_range, rows * chunks, 1, nthreads);
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

/* The first id of the row's maximum, as torch.argmax, in one vector pass: each lane keeps its
 * maximum and where it first saw it (strictly greater replaces), then the lanes' best is the
 * largest value at the lowest id; the tail continues with the same rule. */
static int64_t argmax_row(const float* x, int64_t n) {
    vi lane;
    for (int j = 0; j < VW; j++) lane[j] = j;
    vf best = vsplat(-INFINITY);
    vi best_at = lane;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf v = vload(x + i);
        const vi better = v > best;
        best = vselect(better, v, best);
        best_at = (better & (lane + (int32_t)i)) | (~better & best_at);
    }
    float mx = -INFINITY;
    int64_t at = 0;
    for (int j = 0; j < VW; j++)
        if (best[j] > mx || (best[j] == mx && best_at[j] < at)) mx = best[j], at = best_at[j];
    for (; i < n; i++)
        if (x[i] > mx) mx = x[i], at = i;
    return at;
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
    vu lane;
    for (int j = 0; j < VW; j++) lane[j] = (uint32_t)j;
    float best = -INFINITY;
    int64_t best_id = 0;
    for (i = 0; i + VW <= vocab; i += VW) {
        const vf u = vuniform(key, (uint32_t)i, lane);
        const vf score = vexp(vload(logits + i) / t - mx) / sum / -vlog(u);
        for (int j = 0; j < VW; j++)
            if (score[j] > best) best = score[j], best_id = i + j;
    }
    for (; i < vocab; i++) {
        float lanes[VW] = {suniform(key, (uint32_t)i)}; /* the vector log, as above */
        const float score = sexp(logits[i] / t - mx) / sum / -vlog(vload(lanes))[0];
        if (score > best) best = score, best_id = i;
    }
    return best_id;
}

typedef struct {
    const float* logits;
    int64_t ld;
    const float* temperatures;
    const int64_t* seeds;
    const int64_t* positions;
    int64_t vocab;
    int64_t* out;
} sample_args;

static void sample_range(const void* args, int64_t begin, int64_t end) {
    const sample_args* a = args;
    for (int64_t r = begin; r < end; r++) {
        const float* row = a->logits + r * a->ld;
        if (a->temperatures[r] == 0.0f) {
            a->out[r] = argmax_row(row, a->vocab);
            continue;
        }
        const uint32_t key = row_key(a->seeds[r], a->positions[r]);
        a->out[r] = sample_row(row, a->vocab, a->temperatures[r], key);
    }
}

void mg_sample(const float* logits, int64_t ld, const float* temperatures, const int64_t* seeds,
               const int64_t* positions, int64_t rows, int64_t vocab, int64_t* out,
               int nthreads) {
    const sample_args a = {logits, ld, temperatures, seeds, positions, vocab, out};
    run_parallel(&a, sample_range, rows, 1, nthreads);
}
