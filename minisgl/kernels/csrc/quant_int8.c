/* GGUF blocks times int8 activations (opt-in: MINISGL_INT8_ACTIVATIONS=1), llama.cpp's numerics.
 *
 * Activation rows are quantized to int8 codes per block, a weight block's dot with them is an
 * integer sum of byte products, and one float multiply-add per block scales it. Two ways of
 * quantizing x, as llama.cpp pairs them with the weight types:
 * - per 32 elements for Q4_0, Q4_1, Q8_0 weights (llama.cpp's q8_0): codes round(x / dx), dx =
 *   max |x| / 127 in fp32 (llama.cpp keeps dx in fp16: the one difference);
 * - per 256 for Q4_K, Q6_K (llama.cpp's q8_K, bit for bit): codes round(x * 127 / max |x|), dx
 *   the inverse of that factor, and the sums of every 16 codes (for the weights' offsets).
 * Rounding is to the nearest code, ties to even, as llama.cpp's.
 *
 * With AVX2 (section "AVX2"): Q4_0, Q4_1, Q8_0, Q4_K and Q6_K rows, byte products by vpmaddubsw
 * (unsigned times signed bytes, pairs added into int16) and vpmaddwd (int16 pairs times the
 * block scales, or ones, into int32), as llama.cpp's AVX2 kernels do. With AVX-512 VNNI
 * (section "AVX-512 VNNI"): Q4_0, Q4_1 and Q8_0 rows by vpdpbusd; K-quants there take the AVX2
 * kernels. The AVX2 kernels run at every batch size up to INT8_MAX_ROWS (and past it in the
 * fused decode stack); each activation row's sum in one order whatever its batch mates.
 *
 * Prefill: mg_linear past INT8_MAX_ROWS rows rounds x to its int8 values (codes times dx, per
 * the weight's blocks: quant_round_x) and multiplies by quant.c's fp32 panels, faster there and
 * the same result up to float rounding, so a prompt's cached prefill and its decoding see one
 * model. Not the default (RESULTS.md, sections 32 and 39): the model served is then no longer
 * the fp32 dequantized one (logprobs move ~0.07 a token), prompts gain nothing, and quantizing x
 * amplifies the last-bit differences between the prefill and decode paths (another attention
 * kernel, another summation order) into visibly different logprobs. */
#include <stdlib.h>

#include "quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#define INT8_AVX2 1
#else
#define INT8_AVX2 0
#endif

/* Off unless asked for (mg_set_int8_activations): see the header on why it is not the default. */
static int int8_on;

/* Past this many rows mg_linear rounds x for the fp32 panels instead (the header): each block
 * of products needs its own float scaling, and what the int8 path saves, decoding the weights
 * once per row, a large batch amortizes. */
#define INT8_MAX_ROWS 64

/* How op a's activations are quantized: X_FP32 (not the int8 path), per 32 or per 256. */
enum { X_FP32, X_Q8_0, X_Q8_K };

static int x_kind(const linear_args* a);

/* This thread's scratch of at least `bytes` for op a's quantized activations; *fresh when they
 * must be quantized (again): once per op and thread (ops are told apart by their tag; no
 * barrier). NULL when out of memory. */
static __attribute__((unused)) char* x_scratch(const linear_args* a, int64_t bytes, int* fresh) {
    static __thread char* buffer;
    static __thread int64_t capacity, tag;
    if (bytes > capacity) tag = 0; /* (a new buffer holds no op's rows) */
    if (!quant_grow(&buffer, &capacity, bytes)) return 0;
    *fresh = a->tag == 0 || a->tag != tag;
    tag = a->tag;
    return buffer;
}

/* ---- AVX-512 VNNI ------------------------------------------------------------------------------
 * Q4_0, Q4_1 and Q8_0 rows (K a multiple of 64) times x per 32 elements (its vec_dot_q4_0_q8_0 /
 * q4_1_q8_1): a weight block's dot with x's is an integer sum (vpdpbusd: 64 byte products per
 * instruction, four times an fp32 FMA's 16) scaled once. Every weight type is read as
 * w = d * q + m with unsigned bytes q: Q4_0's nibbles with m = -8 d, Q4_1's with its m, Q8_0's
 * int8 + 128 with m = -128 d; the m terms add up, per weight row and activation row, to a dot
 * of the row's m with the blocks' sums of x.
 *
 * Two blocks A, B (64 elements) per vector, interleaved by 4 elements (A 0..3, B 0..3, A 4..7,
 * ...): vpdpbusd's even lanes then hold A's partial sums and its odd lanes B's, so the scales
 * of both blocks are one 64-bit broadcast. A weight row is decoded once (a scratch of its
 * pairs) and met by the activation rows 8 at a time, each with its own even and odd
 * accumulators. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define INT8_VNNI 1
/* x quantized, pair-major (the rows of one pair side by side): codes [K / 64, M, 64] (pair
 * order), dx [K / 64, M, 2] (A's, B's); block sums [M, K / 32]. */
typedef struct {
    int8_t* codes;
    float* scales;
    float* sums;
    int64_t rows; /* M: the pair stride, in rows */
} xquant;

static inline __m512i interleave_pair(__m512i ab) { /* [A 0..31, B 0..31] bytes -> pair order */
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), ab);
}
static inline __m512 pair_scales(const float* ab) { /* lanes A, B, A, B, ... */
    double both;
    memcpy(&both, ab, sizeof both);
    return _mm512_castpd_ps(_mm512_set1_pd(both));
}

/* Block x[0..32) as 32 codes; its dx and the sum of its quantized values through the pointers. */
static inline __m256i quantize_block(const float* x, float* scale, float* sum) {
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo),
                                                       _mm512_andnot_ps(sign, hi))) / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i qlo = _mm512_cvtps_epi32(lo * inv), qhi = _mm512_cvtps_epi32(hi * inv);
    *scale = d;
    *sum = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)) * d;
    return _mm256_set_m128i(_mm512_cvtsepi32_epi8(qhi), _mm512_cvtsepi32_epi8(qlo));
}

static void quantize_rows(const linear_args* a, xquant* q) {
    const int64_t K = a->K;
    for (int64_t m = 0; m < a->M; m++) {
        const float* x = a->x + m * a->ldx;
        float* sums = q->sums + m * K / 32;
        for (int64_t p = 0; p < K / 64; p++) {
            float* scales = q->scales + 2 * (p * a->M + m);
            const __m256i ca = quantize_block(x + 64 * p, scales, sums + 2 * p);
            const __m256i cb = quantize_block(x + 64 * p + 32, scales + 1, sums + 2 * p + 1);
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(ca), cb, 1);
            _mm512_storeu_si512(q->codes + 64 * (p * a->M + m), interleave_pair(ab));
        }
    }
}

/* The activation rows of op `a` quantized, in this thread's scratch: once per op and thread
 * (ops are told apart by their tag). Codes NULL when out of memory. */
static xquant quantized_x(const linear_args* a) {
    const int64_t bytes = a->M * a->K + 2 * a->M * (a->K / 32) * (int64_t)sizeof(float);
    int fresh;
    char* buffer = x_scratch(a, bytes, &fresh);
    xquant q = {0, 0, 0, a->M};
    if (!buffer) return q;
    q.codes = (int8_t*)buffer;
    q.scales = (float*)(buffer + a->M * a->K);
    q.sums = q.scales + a->M * a->K / 32;
    if (fresh) quantize_rows(a, &q);
    return q;
}

/* A pair of weight blocks at a: its 64 unsigned codes (pair order), d of A and B (lanes A, B,
 * ...), and m of A and B into m[0..2). */
static inline __m512i nibbles(const uint8_t* a, const uint8_t* b) {
    const __m128i qa = _mm_loadu_si128((const __m128i*)a), qb = _mm_loadu_si128((const __m128i*)b);
    /* byte j of a nibble row: element j (low nibble) and j + 16 (high) */
    const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi32(qa, qb), _mm_unpacklo_epi32(qa, qb));
    const __m256i low = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(v & low), _mm256_srli_epi16(v, 4) & low, 1);
}
static inline __m512 half_pair(const uint8_t* a, const uint8_t* b) {
    uint16_t ha, hb;
    memcpy(&ha, a, 2), memcpy(&hb, b, 2);
    return _mm512_broadcast_f32x2(_mm_cvtph_ps(_mm_cvtsi32_si128(ha | (uint32_t)hb << 16)));
}
static inline __m512i pair_q4_0(const uint8_t* a, __m512* d, float* m) {
    const uint8_t* b = a + 2 + QK / 2;
    *d = half_pair(a, b);
    _mm_storel_pi((__m64*)m, _mm512_castps512_ps128(*d * -8.0f));
    return nibbles(a + 2, b + 2);
}
static inline __m512i pair_q4_1(const uint8_t* a, __m512* d, float* m) {
    const uint8_t* b = a + 4 + QK / 2;
    *d = half_pair(a, b);
    _mm_storel_pi((__m64*)m, _mm512_castps512_ps128(half_pair(a + 2, b + 2)));
    return nibbles(a + 4, b + 4);
}
static inline __m512i pair_q8_0(const uint8_t* a, __m512* d, float* m) {
    const uint8_t* b = a + 2 + QK;
    *d = half_pair(a, b);
    _mm_storel_pi((__m64*)m, _mm512_castps512_ps128(*d * -128.0f));
    const __m512i ab = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 2))),
        _mm256_loadu_si256((const __m256i*)(b + 2)), 1);
    return interleave_pair(ab) ^ _mm512_set1_epi8((char)0x80); /* int8 + 128 */
}

/* Weight row src decoded for dot_pairs: per pair its codes q[p], d of A and B (d[2p], d[2p + 1])
 * and m of A and B (m[2p], m[2p + 1]). Once per row, however many activation rows it meets. */
static void decode_pairs(int64_t type, const uint8_t* src, int64_t pairs, __m512i* q, float* d,
                         float* m) {
#define DECODE_PAIRS(decode, bytes)                                                              \
    for (int64_t p = 0; p < pairs; p++) {                                                       \
        __m512 dv;                                                                              \
        q[p] = decode(src + 2 * p * (bytes), &dv, m + 2 * p);                                   \
        _mm_storel_pi((__m64*)(d + 2 * p), _mm512_castps512_ps128(dv));                         \
    }
    switch (type) {
    case GGUF_Q4_0: DECODE_PAIRS(pair_q4_0, 2 + QK / 2); break;
    case GGUF_Q4_1: DECODE_PAIRS(pair_q4_1, 4 + QK / 2); break;
    case GGUF_Q8_0: DECODE_PAIRS(pair_q8_0, 2 + QK); break;
    }
#undef DECODE_PAIRS
}

/* out[r] = dot(decoded weight row, activation row r) for R <= INT8_ROWS quantized activation
 * rows. Two accumulators per row, even and odd pairs (the FMA latency would bound one), and the
 * same order of additions for every R: a row's result does not depend on its batch. */
#define INT8_ROWS 8
static inline __attribute__((always_inline)) void dot_pairs(const __m512i* q, const float* d,
                                                            const float* m, int64_t pairs,
                                                            const xquant* x, const int R,
                                                            float* out) {
    __m512 even[INT8_ROWS], odd[INT8_ROWS];
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps();
#define PAIR(p, ACC)                                                                             \
    do {                                                                                        \
        const __m512 dw = pair_scales(d + 2 * (p));                                             \
        const int8_t* codes = x->codes + 64 * (p) * x->rows;                                    \
        const float* scales = x->scales + 2 * (p) * x->rows;                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[p],               \
                                                    _mm512_loadu_si512(codes + 64 * r));        \
            const __m512 scale = dw * pair_scales(scales + 2 * r);                              \
            ACC[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, ACC[r]);                   \
        }                                                                                       \
    } while (0)
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {
        PAIR(p, even);
        PAIR(p + 1, odd);
    }
    if (p < pairs) PAIR(p, even);
#undef PAIR
    const int64_t blocks = 2 * pairs;
    const __mmask16 tail = (__mmask16)((1u << (blocks % 16)) - 1);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
        const float* sums = x->sums + r * blocks;
        __m512 s = _mm512_add_ps(even[r], odd[r]);
        int64_t b = 0;
        for (; b + 16 <= blocks; b += 16)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(m + b), _mm512_loadu_ps(sums + b), s);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, m + b),
                            _mm512_maskz_loadu_ps(tail, sums + b), s);
        out[r] = _mm512_reduce_add_ps(s);
    }
}
#define DEFINE_DOT_PAIRS(R)                                                                      \
    static void dot_pairs_##R(const __m512i* q, const float* d, const float* m, int64_t pairs,  \
                              const xquant* x, float* out) {                                    \
        dot_pairs(q, d, m, pairs, x, R, out);                                                   \
    }
DEFINE_DOT_PAIRS(1)
DEFINE_DOT_PAIRS(2)
DEFINE_DOT_PAIRS(3)
DEFINE_DOT_PAIRS(4)
DEFINE_DOT_PAIRS(5)
DEFINE_DOT_PAIRS(6)
DEFINE_DOT_PAIRS(7)
DEFINE_DOT_PAIRS(8)
typedef void (*dot_pairs_fn)(const __m512i*, const float*, const float*, int64_t, const xquant*,
                             float*);
static const dot_pairs_fn DOT_PAIRS_FNS[INT8_ROWS + 1] = {
    0, dot_pairs_1, dot_pairs_2, dot_pairs_3, dot_pairs_4, dot_pairs_5, dot_pairs_6, dot_pairs_7,
    dot_pairs_8,
};

/* Items [begin, end) of RG weight rows each, each row decoded once and dotted with every
 * activation row (INT8_ROWS at a time). Returns 0 when out of memory. */
static int vnni_range(const linear_args* a, int64_t begin, int64_t end) {
    static __thread char* scratch; /* one decoded weight row */
    static __thread int64_t capacity;
    const int64_t K = a->K, pairs = K / 64;
    quant_grow(&scratch, &capacity, pairs * (64 + 4 * (int64_t)sizeof(float)));
    const xquant x = quantized_x(a);
    if (!scratch || !x.codes) return 0;
    __m512i* q = (__m512i*)scratch;
    float* d = (float*)(q + pairs);
    float* m = d + 2 * pairs;
    for (int64_t n = begin * RG; n < min64(a->N, end * RG); n++) {
        int64_t type;
        const uint8_t* src = quant_weight_row(a->w, K, n, &type);
        decode_pairs(type, src, pairs, q, d, m);
        for (int64_t m0 = 0; m0 < a->M; m0 += INT8_ROWS) {
            const int64_t R = min64(INT8_ROWS, a->M - m0);
            const xquant rows = {x.codes + 64 * m0, x.scales + 2 * m0, x.sums + m0 * K / 32,
                                 a->M};
            float out[INT8_ROWS];
            DOT_PAIRS_FNS[R](q, d, m, pairs, &rows, out);
            for (int64_t r = 0; r < R; r++)
                a->y[(m0 + r) * a->ldy + n] = out[r] + (a->bias ? a->bias[n] : 0.0f);
        }
    }
    return 1;
}
#else
#define INT8_VNNI 0
#endif

/* ---- AVX2 --------------------------------------------------------------------------------------
 * Q4_K and Q6_K rows times x per 256 (vec_dot_q4_K_q8_K / q6_K_q8_K), Q4_0, Q4_1 and Q8_0 rows
 * times x per 32 (vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0). A K-quant super-block is read in
 * registers (unsigned codes, int16 scales spread by byte shuffles) and met by up to KQ_ROWS
 * activation rows: per 32 elements one vpmaddubsw (codes times x's codes, pairs added) and one
 * vpmaddwd (times the scales, pairs added) into an int32 sum per super-block, scaled once by
 * d * dx. The weights' offsets (Q4_K's mins, Q6_K's -32) multiply x's sums of 16 codes: one
 * vpmaddwd per super-block. Q8_0's and Q4_0's signed codes take vpmaddubsw as |w| times x with
 * w's sign (vpsignb), Q4_1's unsigned nibbles as they are (its offset m times x's block sum, a
 * scalar FMA), one float multiply-add per block. Every activation row's sum adds in one order
 * whatever its batch mates. */
#if INT8_AVX2
/* x quantized per block (QK or QK_K elements), row-major: codes [M, K], dx [M, K / block], and
 * per QK_K the sums of every 16 codes [M, K / 16] (the K-quants' offsets), per QK each block's
 * dx times its sum of codes [M, K / QK] (Q4_1's: llama.cpp's q8_1 keeps it in the block). */
typedef struct {
    const int8_t* codes;
    const float* scales;
    const int16_t* sums;
    const float* block_sums;
} xcodes;

/* x[0..n) (n a multiple of 32) as codes; returns their scale dx. q8_K: codes round(x * f),
 * f = 127 / max |x|, dx = 1 / f; else dx = max |x| / 127 and codes round(x * (1 / dx)). */
static float quantize_avx2(const float* x, int64_t n, int q8_k, int8_t* codes) {
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    float dx = amax / 127.0f, f = dx != 0.0f ? 1.0f / dx : 0.0f;
    if (q8_k) f = amax != 0.0f ? 127.0f / amax : 0.0f, dx = amax != 0.0f ? 1.0f / f : 0.0f;
    const __m256 factor = _mm256_set1_ps(f);
    for (int64_t i = 0; i < n; i += 32) {
        __m256i q[4]; /* |x * f| <= 127: the packs never saturate */
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), factor));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                  _mm256_packs_epi32(q[2], q[3]));
        /* the packs interleave 128-bit lanes: 4-byte runs back into element order */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i*)(codes + i), _mm256_permutevar8x32_epi32(packed, order));
    }
    return dx;
}

/* Op a's activation rows quantized per `block`, in this thread's scratch (codes NULL when out
 * of memory). */
static xcodes quantized_x_avx2(const linear_args* a, int64_t block) {
    const int64_t M = a->M, K = a->K;
    const int64_t bytes = M * K + M * (K / block) * (int64_t)sizeof(float) + M * (K / 16) * 2;
    int fresh;
    char* buffer = x_scratch(a, bytes, &fresh);
    if (!buffer) return (xcodes){0, 0, 0, 0};
    int8_t* codes = (int8_t*)buffer;
    float* scales = (float*)(buffer + M * K);
    int16_t* sums = (int16_t*)(scales + M * (K / block));
    float* block_sums = (float*)sums; /* (as many bytes: one or the other) */
    for (int64_t m = 0; fresh && m < M; m++)
        for (int64_t b = 0; b < K / block; b++) {
            const int64_t at = m * (K / block) + b;
            int8_t* c = codes + m * K + b * block;
            scales[at] = quantize_avx2(a->x + m * a->ldx + b * block, block, block == QK_K, c);
            int sum = 0;
            for (int e = 0; block == QK && e < QK; e++) sum += c[e];
            if (block == QK) block_sums[at] = scales[at] * (float)sum;
        }
    for (int64_t g = 0; fresh && block == QK_K && g < M * K / 16; g++) {
        int sum = 0;
        for (int e = 0; e < 16; e++) sum += codes[16 * g + e];
        sums[g] = (int16_t)sum;
    }
    return (xcodes){codes, scales, sums, block_sums};
}

/* A Q4_K or Q6_K super-block's dot with 256 codes x (sums: x's 16-code sums) is d dx (sum of
 * q . x . s: unsigned codes q, int16 scales s per pair of codes) plus the weights' offsets,
 * t . sums (t per 16 codes; Q6_K adds them to the integer sum, Q4_K scales them by -dmin dx).
 * The super-block is read in registers, as llama.cpp's AVX2 kernels do, type by type: an
 * unpacked copy in memory (stores, then loads per row) cost a batch-1 row about as much as its
 * products. Each int32 lane sums the same products whatever the batch, so results do not
 * depend on it (nor on how rows are grouped: integer sums are exact). */
#define KQ_ROWS 4 /* activation rows per pass over a K-quant row (accumulators in registers) */

/* A row's x at super-block b: codes, 16-code sums, dx. */
typedef struct {
    const int8_t* codes;
    const int16_t* sums;
    const float* dx;
    int64_t K; /* the row stride of codes (sums: K / 16, dx: K / QK_K) */
} xrows;

/* dot[r] plus codes q (32, element order) times x's 32 codes at `at` of row r, each pair of
 * products times its int16 scale in s (lanes 0-7: codes 0-15). */
static inline __attribute__((always_inline)) void group_dot(__m256i q, __m256i s,
                                                            const xrows* x, int64_t at,
                                                            const int R, __m256i* dot) {
    for (int r = 0; r < R; r++) {
        const __m256i xr = _mm256_loadu_si256((const __m256i*)(x->codes + r * x->K + at));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xr), s));
    }
}

/* int16 lane i of s16 (both 128-bit halves hold the same 8) in every lane: one byte shuffle. */
static inline __m256i spread16(__m256i s16, int i) {
    return _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(2 * i | (2 * i + 1) << 8)));
}

/* Q4_K: d, dmin (f16), 8 6-bit scales and mins in 12 bytes (as quant.c's read_q4_k: 0-3 in the
 * low 6 bits of bytes 0-3 and 4-7, 4-7 split into a nibble of bytes 8-11 and the top 2 bits of
 * bytes 0-7), 128 bytes of nibbles (bytes [32 i, +32): groups 2 i (low) and 2 i + 1 (high)).
 * acc[r] plus the dot of block b (super-block number blk) with R activation rows. */
static inline __attribute__((always_inline)) void q4_k_block(const uint8_t* b, const xrows* x,
                                                             int64_t blk, const int R,
                                                             __m256* acc) {
    uint32_t w[3];
    memcpy(w, b + 4, sizeof w);
    const uint64_t sc = (w[0] & 0x3F3F3F3F) |
                        (uint64_t)((w[2] & 0x0F0F0F0F) | (w[0] >> 6 & 0x03030303) << 4) << 32;
    const uint64_t mn = (w[1] & 0x3F3F3F3F) |
                        (uint64_t)((w[2] >> 4 & 0x0F0F0F0F) | (w[1] >> 6 & 0x03030303) << 4) << 32;
    const __m128i mins = _mm_cvtsi64_si128((long long)mn);
    /* scale j as int16 lane j of both halves; t: min j for codes [32 j, 32 j + 32) */
    const __m256i scales =
        _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    const __m256i t = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
    __m256i dot[KQ_ROWS];
    for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < 4; i++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * i));
        const __m256i low = _mm256_set1_epi8(15);
        group_dot(bytes & low, spread16(scales, 2 * i), x, blk * QK_K + 64 * i, R, dot);
        group_dot(_mm256_srli_epi16(bytes, 4) & low, spread16(scales, 2 * i + 1), x,
                  blk * QK_K + 64 * i + 32, R, dot);
    }
    const float d = load_half(b), dmin = load_half(b + 2);
    for (int r = 0; r < R; r++) {
        const __m256i sums = _mm256_loadu_si256(
            (const __m256i*)(x->sums + (r * x->K + blk * QK_K) / 16));
        const float dx = x->dx[r * (x->K / QK_K) + blk];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(d * dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t, sums)),
                                 _mm256_set1_ps(-dmin * dx), acc[r]);
    }
}

/* Q6_K: codes as quant.c's group_q6_k (low 4 bits from ql, high 2 from qh), 16 int8 scales
 * (one per 16 codes), d (f16); the -32 of every code is t = -32 scale times x's 16-code sums.
 * acc[r] plus the dot of block b (super-block number blk) with R activation rows. */
static inline __attribute__((always_inline)) void q6_k_block(const uint8_t* b, const xrows* x,
                                                             int64_t blk, const int R,
                                                             __m256* acc) {
    const __m256i scales = _mm256_cvtepi8_epi16(
        _mm_loadu_si128((const __m128i*)(b + QK_K / 2 + QK_K / 4)));
    /* scales 0-7 (then 8-15) in both halves: group j's pairs take scale 2 j (codes 0-15, the
     * low half) and 2 j + 1 (the high half), one byte shuffle */
    const __m256i halves[2] = {_mm256_permute2x128_si256(scales, scales, 0x00),
                               _mm256_permute2x128_si256(scales, scales, 0x11)};
    __m256i dot[KQ_ROWS];
    for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const int i = j % 4, lshift = 4 * (i / 2), hshift = 2 * i, lane = 2 * j % 8;
        const __m256i l = _mm256_loadu_si256((const __m256i*)(b + 64 * (j / 4) + 32 * (i % 2)));
        const __m256i h = _mm256_loadu_si256((const __m256i*)(b + QK_K / 2 + 32 * (j / 4)));
        const __m256i high = hshift <= 4 ? _mm256_slli_epi16(h, 4 - hshift)
                                         : _mm256_srli_epi16(h, hshift - 4);
        const __m256i q = (_mm256_srli_epi16(l, lshift) & _mm256_set1_epi8(15)) |
                          (high & _mm256_set1_epi8(0x30));
        const __m256i pick =
            _mm256_setr_m128i(_mm_set1_epi16((short)(2 * lane | (2 * lane + 1) << 8)),
                              _mm_set1_epi16((short)((2 * lane + 2) | (2 * lane + 3) << 8)));
        group_dot(q, _mm256_shuffle_epi8(halves[j / 4], pick), x, blk * QK_K + 32 * j, R, dot);
    }
    const __m256i t = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(scales, 5));
    const float d = load_half(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (int r = 0; r < R; r++) {
        const __m256i sums = _mm256_loadu_si256(
            (const __m256i*)(x->sums + (r * x->K + blk * QK_K) / 16));
        const __m256i all = _mm256_add_epi32(dot[r], _mm256_madd_epi16(t, sums));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all),
                                 _mm256_set1_ps(d * x->dx[r * (x->K / QK_K) + blk]), acc[r]);
    }
}

static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* How far ahead of the super-block being read the weights are prefetched: weight rows lie back
 * to back, one stream per thread, and the hardware prefetcher alone left a batch-1 row waiting
 * on memory (RESULTS.md, "K-quant int8 kernels at batch 1"). */
#define PREFETCH_AHEAD_BYTES 4096
#define Q4_K_BYTES (4 + 12 + QK_K / 2)
#define Q6_K_BYTES (QK_K / 2 + QK_K / 4 + QK_K / 16 + 2)

/* Prefetches the weights PREFETCH_AHEAD_BYTES past a block of `bytes` (successive blocks' lines
 * 64 bytes apart or closer: every line of the stream). Always inlined: gcc deems a function of
 * prefetches alone free of effects and drops the calls. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* block,
                                                                 const int bytes) {
    for (int at = 0; at < bytes; at += 64)
        _mm_prefetch((const char*)block + PREFETCH_AHEAD_BYTES + at, _MM_HINT_T0);
}

/* out[r] = dot(K-quant row src, activation row r of x) for r < R <= KQ_ROWS. */
static inline __attribute__((always_inline)) void kquant_rows_r(int64_t type,
                                                                const uint8_t* src,
                                                                const xrows* x, const int R,
                                                                float* out) {
    __m256 acc[KQ_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    if (type == GGUF_Q4_K)
        for (int64_t b = 0; b < x->K / QK_K; b++) {
            prefetch_ahead(src + b * Q4_K_BYTES, Q4_K_BYTES);
            q4_k_block(src + b * Q4_K_BYTES, x, b, R, acc);
        }
    else
        for (int64_t b = 0; b < x->K / QK_K; b++) {
            prefetch_ahead(src + b * Q6_K_BYTES, Q6_K_BYTES);
            q6_k_block(src + b * Q6_K_BYTES, x, b, R, acc);
        }
    for (int r = 0; r < R; r++) out[r] = hsum_avx2(acc[r]);
}

/* out[r] = dot(K-quant row src, activation row m0 + r) for r < R, KQ_ROWS rows at a time. */
static void kquant_rows(int64_t type, const uint8_t* src, int64_t K, const xcodes* x,
                        int64_t m0, int64_t R, float* out) {
    for (int64_t r = 0; r < R; r += KQ_ROWS) {
        const int64_t m = m0 + r;
        const xrows rows = {x->codes + m * K, x->sums + m * K / 16, x->scales + m * (K / QK_K), K};
        switch (min64(KQ_ROWS, R - r)) {
        case 1: kquant_rows_r(type, src, &rows, 1, out + r); break;
        case 2: kquant_rows_r(type, src, &rows, 2, out + r); break;
        case 3: kquant_rows_r(type, src, &rows, 3, out + r); break;
        default: kquant_rows_r(type, src, &rows, 4, out + r);
        }
    }
}

/* Rows of 32-element blocks (Q4_0, Q4_1, Q8_0) meet activation rows B32_ROWS at a time, their
 * accumulators in registers (with all R rows in memory, Q8_0 was 30% slower than fp32
 * activations at 8 rows). */
#define B32_ROWS 4
#define Q4_0_BYTES (2 + QK / 2)
#define Q4_1_BYTES (4 + QK / 2)
#define Q8_0_BYTES (2 + QK)

/* 16 bytes of nibbles as 32 codes 0..15 in element order (element j < 16: the low nibble of
 * byte j, element j + 16 its high nibble). */
static inline __m256i nibbles_avx2(const uint8_t* q) {
    const __m128i b = _mm_loadu_si128((const __m128i*)q);
    return _mm256_set_m128i(_mm_srli_epi16(b, 4), b) & _mm256_set1_epi8(15);
}

/* acc[r] plus the dot of block b (at `block`, of `type`) with block b of activation row r,
 * r < R; Q4_1's offsets m (w = d q + m) into off[r], as m times x's block sum. Q8_0's and
 * Q4_0's signed codes (Q4_0's nibbles - 8) meet vpmaddubsw as |w| times x with w's sign; Q4_1's
 * unsigned nibbles as they are. */
static inline __attribute__((always_inline)) void block32(const int type, const uint8_t* block,
                                                          int64_t b, const xcodes* x, int64_t K,
                                                          const int R, __m256* acc, float* off) {
    const float dw = load_half(block), m = type == GGUF_Q4_1 ? load_half(block + 2) : 0.0f;
    __m256i w;
    if (type == GGUF_Q8_0)
        w = _mm256_loadu_si256((const __m256i*)(block + 2));
    else if (type == GGUF_Q4_0)
        w = _mm256_sub_epi8(nibbles_avx2(block + 2), _mm256_set1_epi8(8));
    else
        w = nibbles_avx2(block + 4);
    const __m256i magnitude = type == GGUF_Q4_1 ? w : _mm256_abs_epi8(w); /* |w| <= 128 */
    for (int r = 0; r < R; r++) {
        __m256i xs = _mm256_loadu_si256((const __m256i*)(x->codes + r * K + b * QK));
        if (type != GGUF_Q4_1) xs = _mm256_sign_epi8(xs, w);
        const __m256i dot =
            _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), _mm256_set1_epi16(1));
        const float dx = x->scales[r * (K / QK) + b];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx), acc[r]);
        if (type == GGUF_Q4_1) off[r] = fmaf(m, x->block_sums[r * (K / QK) + b], off[r]);
    }
}
/* out[r] = dot(row src of `type`, activation row r of x) for r < R <= B32_ROWS: each block
 * loaded once for the R rows, two accumulators per row (even and odd blocks: the FMA latency
 * would bound one), the weight stream prefetched a pair of blocks at a time. */
static inline __attribute__((always_inline)) void block32_rows_r(const int type,
                                                                 const uint8_t* src, int64_t K,
                                                                 const xcodes* x, const int R,
                                                                 float* out) {
    const int bytes = type == GGUF_Q8_0 ? Q8_0_BYTES : type == GGUF_Q4_0 ? Q4_0_BYTES
                                                                        : Q4_1_BYTES;
    const int64_t blocks = K / QK;
    __m256 even[B32_ROWS], odd[B32_ROWS];
    float off[B32_ROWS];
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps(), off[r] = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        prefetch_ahead(src + b * bytes, 2 * bytes);
        block32(type, src + b * bytes, b, x, K, R, even, off);
        block32(type, src + (b + 1) * bytes, b + 1, x, K, R, odd, off);
    }
    if (b < blocks) block32(type, src + b * bytes, b, x, K, R, even, off);
    for (int r = 0; r < R; r++) out[r] = hsum_avx2(even[r] + odd[r]) + off[r];
}
/* The same for activation rows m0 .. m0 + R - 1 (any R), B32_ROWS at a time. */
static void block32_rows(int64_t type, const uint8_t* src, int64_t K, const xcodes* x,
                         int64_t m0, int64_t R, float* out) {
#define ROWS_OF(t)                                                                               \
    switch (min64(B32_ROWS, R - r)) {                                                           \
    case 1: block32_rows_r(t, src, K, &rows, 1, out + r); break;                                \
    case 2: block32_rows_r(t, src, K, &rows, 2, out + r); break;                                \
    case 3: block32_rows_r(t, src, K, &rows, 3, out + r); break;                                \
    default: block32_rows_r(t, src, K, &rows, 4, out + r);                                      \
    }
    for (int64_t r = 0; r < R; r += B32_ROWS) {
        const int64_t m = m0 + r;
        const xcodes rows = {x->codes + m * K, x->scales + m * (K / QK), 0,
                             x->block_sums + m * (K / QK)};
        if (type == GGUF_Q8_0) {
            ROWS_OF(GGUF_Q8_0)
        } else if (type == GGUF_Q4_0) {
            ROWS_OF(GGUF_Q4_0)
        } else {
            ROWS_OF(GGUF_Q4_1)
        }
    }
#undef ROWS_OF
}

#define AVX2_ROWS 16 /* activation rows per call of the row kernels (their outputs on the stack) */

/* Items [begin, end) of RG weight rows each, dotted with every activation row (up to AVX2_ROWS
 * at a time). Returns 0 when out of memory. */
static int avx2_range(const linear_args* a, int64_t begin, int64_t end) {
    const int q8_k = x_kind(a) == X_Q8_K;
    const xcodes x = quantized_x_avx2(a, q8_k ? QK_K : QK);
    if (!x.codes) return 0;
    for (int64_t n0 = begin * RG; n0 < min64(a->N, end * RG); n0 += RG) {
        const uint8_t* src[RG];
        int64_t types[RG];
        const int64_t rows = min64(RG, a->N - n0);
        quant_weight_rows(a->w, a->K, n0, rows, src, types);
        for (int64_t i = 0, n = n0; i < rows; i++, n++) {
            for (int64_t m0 = 0; m0 < a->M; m0 += AVX2_ROWS) {
                const int64_t R = min64(AVX2_ROWS, a->M - m0);
                float out[AVX2_ROWS];
                if (q8_k)
                    kquant_rows(types[i], src[i], a->K, &x, m0, R, out);
                else
                    block32_rows(types[i], src[i], a->K, &x, m0, R, out);
                for (int64_t r = 0; r < R; r++)
                    a->y[(m0 + r) * a->ldy + n] = out[r] + (a->bias ? a->bias[n] : 0.0f);
            }
        }
    }
    return 1;
}

/* Rows [begin, end) of x rounded to their int8 values (codes times dx), into a->y ([M, K]). */
static void round_rows(const void* args, int64_t begin, int64_t end) {
    const linear_args* a = args;
    const int q8_k = x_kind(a) == X_Q8_K;
    const int64_t block = q8_k ? QK_K : QK;
    int8_t codes[QK_K];
    for (int64_t m = begin; m < end; m++)
        for (int64_t k = 0; k < a->K; k += block) {
            const float dx = quantize_avx2(a->x + m * a->ldx + k, block, q8_k, codes);
            for (int64_t e = 0; e < block; e++) a->y[m * a->K + k + e] = (float)codes[e] * dx;
        }
}
#endif

/* ---- which path ---------------------------------------------------------------------------- */
static int x_kind(const linear_args* a) {
    if (!int8_on || a->x_rounded || !a->w->num_segments) return X_FP32;
    int k_quants = 1, blocks = 1;
    for (int64_t s = 0; s < a->w->num_segments; s++) {
        const int64_t t = a->w->types[s];
        k_quants &= t == GGUF_Q4_K || t == GGUF_Q6_K;
        blocks &= t == GGUF_Q8_0 || t == GGUF_Q4_0 || t == GGUF_Q4_1;
    }
    if (k_quants) return X_Q8_K; /* (K is a multiple of 256) */
    return blocks && a->K % (INT8_VNNI ? 64 : 32) == 0 ? X_Q8_0 : X_FP32;
}

int quant_int8_path(const linear_args* a) { return x_kind(a) != X_FP32; }

int quant_int8_range(const linear_args* a, int64_t begin, int64_t end) {
#if INT8_VNNI
    if (x_kind(a) == X_Q8_0) return vnni_range(a, begin, end);
#endif
#if INT8_AVX2
    return avx2_range(a, begin, end);
#else
    (void)a, (void)begin, (void)end;
    return 0;
#endif
}

float* quant_round_x(const linear_args* a, int nthreads) {
    if (!INT8_AVX2 || !quant_int8_path(a) || a->M <= INT8_MAX_ROWS) return 0;
    float* out = malloc((size_t)(a->M * a->K) * sizeof(float));
    (void)nthreads;
#if INT8_AVX2
    if (out) {
        linear_args r = *a;
        r.y = out;
        run_parallel(&r, round_rows, a->M, 1, nthreads);
    }
#endif
    return out;
}

/* Turns the int8 path on (where the CPU has AVX2) or off; returns whether it is on. */
int mg_set_int8_activations(int on) {
    int8_on = on && INT8_AVX2;
    return int8_on;
}
