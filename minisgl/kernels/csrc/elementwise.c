/* RMSNorm (with the fused residual add), SiLU-and-mul, rotary embedding and the KV store. */
#include "common.h"

/* Rows per chunk for cheap per-row ops: one chunk per thread and a half, never tiny. */
static int64_t row_chunk(int64_t rows, int nthreads) {
    return max64(1, (rows + 2 * (int64_t)nthreads - 1) / (2 * (int64_t)nthreads));
}

/* ---- RMSNorm ---------------------------------------------------------------------------------
 * out = weight * (r * rsqrt(mean(r^2) + eps)), r = x, or r = x + residual (written back to
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

void rmsnorm_range(const void* args, int64_t begin, int64_t end) {
    const rmsnorm_args* a = args;
    for (int64_t row = begin; row < end; row++) {
        const int64_t t = row / a->heads, h = row % a->heads;
        rmsnorm_row(a->x + t * a->ldx + h * a->H, a->residual ? a->residual + t * a->ldr : 0, a->w,
                    a->out + t * a->ldo + h * a->H, a->H, a->eps);
    }
}

void mg_rmsnorm(const float* x, int64_t ldx, int64_t heads, float* residual, int64_t ldr,
                const float* w, float* out, int64_t ldo, int64_t T, int64_t H, float eps,
                int nthreads) {
    const rmsnorm_args a = {x, ldx, heads, residual, ldr, w, out, ldo, H, eps};
    run_parallel(&a, rmsnorm_range, T * heads, row_chunk(T * heads, nthreads), nthreads);
}

/* ---- SiLU and multiply: out[m, i] = silu(gu[m, i]) * gu[m, I + i] ---------------------------
 * silu(g) = g / (1 + exp(-g)), the formula torch's CPU kernel uses. */
void silu_mul_range(const void* args, int64_t begin, int64_t end) {
    const silu_mul_args* a = args;
    for (int64_t m = begin; m < end; m++) {
        const float* g = a->gu + m * a->ldg;
        const float* u = g + a->I;
        float* o = a->out + m * a->ldo;
        int64_t i = 0;
        for (; i + VW <= a->I; i += VW) {
            vf gv = vload(g + i);
            vstore(o + i, gv / (1.0f + vexp(-gv)) * vload(u + i));
        }
        for (; i < a->I; i++) o[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
    }
}

void mg_silu_mul(const float* gu, int64_t ldg, float* out, int64_t ldo, int64_t M, int64_t I,
                 int nthreads) {
    const silu_mul_args a = {gu, ldg, out, ldo, I};
    run_parallel(&a, silu_mul_range, M, row_chunk(M, nthreads), nthreads);
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

void rope_range(const void* args, int64_t begin, int64_t end) {
    const rope_args* a = args;
    for (int64_t t = begin; t < end; t++) {
        const float* c = a->cos_cache + a->positions[t] * a->D;
        const float* s = a->sin_cache + a->positions[t] * a->D;
        rope_heads(a->q + t * a->ldq, a->hq, a->D, c, s);
        rope_heads(a->k + t * a->ldk, a->hk, a->D, c, s);
    }
}

void mg_rope(float* q, int64_t ldq, int64_t hq, float* k, int64_t ldk, int64_t hk, int64_t T,
             int64_t D, const int64_t* positions, const float* cos_cache, const float* sin_cache,
             int nthreads) {
    const rope_args a = {q, ldq, hq, k, ldk, hk, D, positions, cos_cache, sin_cache};
    run_parallel(&a, rope_range, T, row_chunk(T, nthreads), nthreads);
}

/* ---- KV store: row t of k and v goes to slot slots[t] of the layer's caches ([slots, width]) */
void store_kv_range(const void* args, int64_t begin, int64_t end) {
    const store_kv_args* a = args;
    const int64_t w = a->width;
    for (int64_t t = begin; t < end; t++) {
        const float* k = a->k + t * a->ldk;
        const float* v = a->v + t * a->ldv;
        if (!a->kv_format) {
            memcpy((float*)a->k_cache + a->slots[t] * w, k, (size_t)w * sizeof(float));
            memcpy((float*)a->v_cache + a->slots[t] * w, v, (size_t)w * sizeof(float));
            continue;
        }
        const int64_t size = kv_bytes(a->kv_format);
        char* kc = (char*)a->k_cache + a->slots[t] * w * size;
        char* vc = (char*)a->v_cache + a->slots[t] * w * size;
        for (int64_t i = 0; i < w; i++) {
            kv_encode(k[i] / a->k_scale, a->kv_format, kc + i * size);
            kv_encode(v[i] / a->v_scale, a->kv_format, vc + i * size);
        }
    }
}

void mg_store_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, float* k_cache,
                 float* v_cache, const int64_t* slots, int64_t T, int64_t width) {
    const store_kv_args a = {k, ldk, v, ldv, k_cache, v_cache, slots, width, 0, 1.0f, 1.0f};
    store_kv_range(&a, 0, T); /* a memcpy per token: not worth a parallel region */
}
