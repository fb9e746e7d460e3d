/* GGUF block-quantized linear weights (llama.cpp's formats) times fp32 activations.
 *
 * A weight holds its GGUF blocks as the file stores them (ggml-common.h): every output row is
 * K / block elements blocks, and runs of rows may differ in type (mg_weight's segments,
 * common.h). Served as blocks: F32, F16, BF16, Q4_0, Q4_1, Q8_0 (blocks of 32) and Q4_K, Q6_K
 * (super-blocks of 256); the loader dequantizes every other type (minisgl/kernels/weights.py).
 *
 * Asked for (MINISGL_INT8_ACTIVATIONS=1, AVX2), Q4_0, Q4_1, Q8_0, Q4_K and Q6_K rows take the
 * int8 path of quant_int8.c instead: activations quantized to int8 and integer dot products,
 * llama.cpp's numerics (its header says why that is not the default; past 64 rows,
 * i.e. prefill, mg_linear rounds the activations to their int8 values and multiplies by the fp32
 * panels below, the same result up to rounding). Everything else (and everything by default) is
 * decoded to fp32 (gguf's dequantize, up to a fused multiply-add's rounding) and multiplied with
 * the fp32 activations in fp32: a result is the dequantized model's up to summation order. Up to
 * 20 activation rows (48 with AVX2): each weight row is decoded in registers, 32 elements at a
 * time, and dotted with every activation row, a read stream of the blocks (a fifth to a half of
 * the fp32 weights' bytes), each row's sum in one order whatever the batch (dot_rows). More rows
 * (prefill, large decode batches): the weight rows of one panel are decoded into the fp32 panel
 * layout (linear.c) in a per-thread scratch and multiplied by linear.c's register tiles; work
 * items run panel by panel (MC activation rows each), so a panel is decoded once per batch and
 * thread. */
#include <stdlib.h>

#include "quant.h"

/* Sixteen rows are read side by side when decoding a panel: too many streams for the hardware
 * prefetchers, so each is fetched this far ahead. */
#define PREFETCH_BYTES 512

/* Bytes per block of a type served as blocks; 0 for any other type. */
int64_t mg_quant_block_bytes(int64_t type) {
    switch (type) {
    case GGUF_F32: return 4;
    case GGUF_F16: case GGUF_BF16: return 2;
    case GGUF_Q4_0: return 2 + QK / 2;
    case GGUF_Q4_1: return 4 + QK / 2;
    case GGUF_Q8_0: return 2 + QK;
    case GGUF_Q4_K: return 4 + 12 + QK_K / 2;
    case GGUF_Q6_K: return QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    default: return 0;
    }
}

/* ---- decoding blocks to fp32 ------------------------------------------------------------------
 * A row of type t is blocks of ELEMS_t elements (32; 256 for the K-quants; F32 / F16 / BF16 rows
 * are read as blocks of 32 elements) of BYTES_t bytes. read_t(block) reads what the block's
 * 32-element groups share (its scales), once per block; group_t(&head, j, out) decodes group j
 * (elements [32 j, 32 j + 32) of the block) into PIECES vectors of VW floats, in order.
 * Native-width vectors only: gcc 12 lowers wider generic vectors on AVX2 through the stack, and
 * byte-to-float conversions element by element (block matmuls were ~20x slower there). */
#define PIECES (32 / VW)

/* VW bytes at p as floats, signed or not (a constant at every call: one branch folds away). */
static inline vf bytes_vf(const uint8_t* p, int is_signed) {
#if VW == 16
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return (vf)_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif VW == 8 && defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i*)p);
    return (vf)_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = is_signed ? (float)(int8_t)p[i] : (float)p[i];
    return v;
#endif
}


/* 32 4-bit codes, elements 0-15 in bits shift0 .. shift0 + 3 of bytes0[0..16) and 16-31 in bits
 * shift1 .. of bytes1[0..16), each code q as scale * q + offset. With AVX-512 through a table:
 * the block's 16 possible values computed once (one FMA) and each 16 codes pick theirs with one
 * `vpermps` (it reads only an index's low 4 bits): the same bits as converting and scaling each
 * code, with one FMA per block instead of two plus two conversions on the FP pipes the dot
 * products need (batch-1 matmuls 8-27% faster, RESULTS.md, 23). Narrower vectors convert and
 * scale each code (a 16-entry table takes two permutes and a blend there). */
static inline void decode_nibbles(const uint8_t* bytes0, int shift0, const uint8_t* bytes1,
                                  int shift1, float scale, float offset, vf* out) {
#if VW == 16
    const vf table = (vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * scale + offset;
    for (int h = 0; h < 2; h++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(h ? bytes1 : bytes0));
        const __m512i q = _mm512_srli_epi32(_mm512_cvtepu8_epi32(bytes), h ? shift1 : shift0);
        out[h] = (vf)_mm512_permutexvar_ps(q, (__m512)table);
    }
#else
    for (int i = 0; i < PIECES; i++) {
        const uint8_t* p = (i * VW < 16 ? bytes0 : bytes1) + i * VW % 16;
        const int shift = i * VW < 16 ? shift0 : shift1;
#if VW == 8 && defined(__AVX2__)
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
        const __m256i q = _mm256_srli_epi32(bytes, shift);
        const vf codes = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
#else
        vf codes;
        for (int j = 0; j < VW; j++) codes[j] = (float)((p[j] >> shift) & 15);
#endif
        out[i] = codes * scale + offset;
    }
#endif
}

/* Q4_0, Q4_1, Q8_0 and the float types: one scale and offset per block (unused by some). */
typedef struct {
    const uint8_t* b;
    float d, m;
} head_q4_0, head_q4_1, head_q8_0, head_f32, head_f16, head_bf16;

/* Q4_0: d (f16), 16 bytes of nibbles: element j < 16 is the low nibble of byte j, element
 * 16 + j its high nibble; w = d * (q - 8) (= d q - 8 d: the same rounding, -8 d is exact). */
#define ELEMS_q4_0 QK
#define BYTES_q4_0 (2 + QK / 2)
static inline head_q4_0 read_q4_0(const uint8_t* b) {
    const float d = load_half(b);
    return (head_q4_0){b, d, -8.0f * d};
}
static inline void group_q4_0(const head_q4_0* h, int j, vf* out) {
    (void)j;
    decode_nibbles(h->b + 2, 0, h->b + 2, 4, h->d, h->m, out);
}

/* Q4_1: d, m (f16), nibbles as Q4_0; w = d * q + m. */
#define ELEMS_q4_1 QK
#define BYTES_q4_1 (4 + QK / 2)
static inline head_q4_1 read_q4_1(const uint8_t* b) {
    return (head_q4_1){b, load_half(b), load_half(b + 2)};
}
static inline void group_q4_1(const head_q4_1* h, int j, vf* out) {
    (void)j;
    decode_nibbles(h->b + 4, 0, h->b + 4, 4, h->d, h->m, out);
}

/* Q8_0: d (f16), 32 int8; w = d * q. */
#define ELEMS_q8_0 QK
#define BYTES_q8_0 (2 + QK)
static inline head_q8_0 read_q8_0(const uint8_t* b) { return (head_q8_0){b, load_half(b), 0}; }
static inline void group_q8_0(const head_q8_0* h, int j, vf* out) {
    (void)j;
    for (int i = 0; i < PIECES; i++) out[i] = bytes_vf(h->b + 2 + i * VW, 1) * h->d;
}

/* Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of nibbles:
 * bytes [32 i, 32 i + 32) hold group 2 i in their low nibbles and 2 i + 1 in their high ones;
 * w = d * scale * q - dmin * min. */
#define ELEMS_q4_k QK_K
#define BYTES_q4_k (4 + 12 + QK_K / 2)
typedef struct {
    const uint8_t* b;
    float d[8], m[8]; /* d * scale, dmin * min per group */
} head_q4_k;
static inline head_q4_k read_q4_k(const uint8_t* b) {
    head_q4_k h = {b, {0}, {0}};
    const float d = load_half(b), dmin = load_half(b + 2);
    const uint8_t* s = b + 4;
    for (int j = 0; j < 8; j++) {
        const int scale = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        const int min = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        h.d[j] = d * (float)scale, h.m[j] = dmin * (float)min;
    }
    return h;
}
static inline void group_q4_k(const head_q4_k* h, int j, vf* out) {
    const uint8_t* qs = h->b + 16 + 32 * (j / 2);
    decode_nibbles(qs, 4 * (j % 2), qs + 16, 4 * (j % 2), h->d[j], -h->m[j], out);
}

/* Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (f16). Group j
 * lies in half j / 4 (128 elements) of the block, at i = j % 4 of that half: its low 4 bits
 * are bits 4 (i / 2) .. of bytes [32 (i % 2), +32) of the half's 64 low-nibble bytes, its high
 * 2 bits bits 2 i, 2 i + 1 of the half's 32 high bytes; w = d * scale[element / 16] * (q - 32)
 * (= q ds - 32 ds with one rounding: the same bits). */
#define ELEMS_q6_k QK_K
#define BYTES_q6_k (QK_K / 2 + QK_K / 4 + QK_K / 16 + 2)
typedef struct {
    const uint8_t* b;
    float ds[16]; /* d * scale per 16 elements */
} head_q6_k;
static inline head_q6_k read_q6_k(const uint8_t* b) {
    head_q6_k h = {b, {0}};
    const int8_t* scales = (const int8_t*)(b + QK_K / 2 + QK_K / 4);
    const float d = load_half(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (int i = 0; i < 16; i++) h.ds[i] = d * (float)scales[i];
    return h;
}
static inline void group_q6_k(const head_q6_k* h, int j, vf* out) {
    const int i = j % 4, lshift = 4 * (i / 2), hshift = 2 * i;
    const uint8_t* ql = h->b + 64 * (j / 4) + 32 * (i % 2);
    const uint8_t* qh = h->b + QK_K / 2 + 32 * (j / 4);
    const float* ds = h->ds + 2 * j;
#if defined(__AVX2__)
    /* the 32 codes as bytes (16-bit shifts: the masks drop what crosses from the next byte) */
    const __m256i l = _mm256_loadu_si256((const __m256i*)ql);
    const __m256i hb = _mm256_loadu_si256((const __m256i*)qh);
    const __m256i high = hshift <= 4 ? _mm256_slli_epi16(hb, 4 - hshift)
                                     : _mm256_srli_epi16(hb, hshift - 4);
    const __m256i q = (_mm256_srli_epi16(l, lshift) & _mm256_set1_epi8(15)) |
                      (high & _mm256_set1_epi8(0x30));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
#if VW == 16
    out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)) * ds[0] - 32.0f * ds[0];
    out[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)) * ds[1] - 32.0f * ds[1];
#else
    const __m128i bytes[PIECES] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
    for (int p = 0; p < PIECES; p++)
        out[p] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes[p])) * ds[p / 2] -
                 32.0f * ds[p / 2];
#endif
#else
    for (int p = 0; p < PIECES; p++)
        for (int e = 0; e < VW; e++) {
            const int n = p * VW + e, q = ((ql[n] >> lshift) & 15) | (((qh[n] >> hshift) & 3) << 4);
            out[p][e] = (float)q * ds[n / 16] - 32.0f * ds[n / 16];
        }
#endif
}

/* F16 / BF16 / F32 rows as blocks of 32 elements (rows of them whose length is a multiple of
 * 32: others take decode_row's element loop). */
#define ELEMS_f16 32
#define BYTES_f16 64
static inline head_f16 read_f16(const uint8_t* b) { return (head_f16){b, 0, 0}; }
static inline void group_f16(const head_f16* h, int j, vf* out) {
    (void)j;
    for (int p = 0; p < PIECES; p++) {
        const uint8_t* half = h->b + 2 * VW * p;
#if VW == 16
        out[p] = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)half));
#elif VW == 8 && defined(__F16C__)
        out[p] = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)half));
#else
        for (int e = 0; e < VW; e++) out[p][e] = load_half(half + 2 * e);
#endif
    }
}
#define ELEMS_bf16 32
#define BYTES_bf16 64
static inline head_bf16 read_bf16(const uint8_t* b) { return (head_bf16){b, 0, 0}; }
static inline void group_bf16(const head_bf16* h, int j, vf* out) {
    (void)j;
    for (int p = 0; p < PIECES; p++) {
        uint16_t raw[VW];
        memcpy(raw, h->b + 2 * VW * p, sizeof raw);
        vi bits;
        for (int e = 0; e < VW; e++) bits[e] = (int32_t)((uint32_t)raw[e] << 16);
        out[p] = (vf)bits;
    }
}
#define ELEMS_f32 32
#define BYTES_f32 128
static inline head_f32 read_f32(const uint8_t* b) { return (head_f32){b, 0, 0}; }
static inline void group_f32(const head_f32* h, int j, vf* out) {
    (void)j;
    for (int p = 0; p < PIECES; p++) out[p] = vload((const float*)h->b + VW * p);
}

/* Calls BODY(t) with the type's name (every type mg_quant_block_bytes serves), so each loop is
 * compiled with its decoder inlined. */
#define SWITCH_TYPE(type, BODY)                                                                  \
    switch (type) {                                                                             \
    case GGUF_F32: BODY(f32); break;                                                            \
    case GGUF_F16: BODY(f16); break;                                                            \
    case GGUF_BF16: BODY(bf16); break;                                                          \
    case GGUF_Q4_0: BODY(q4_0); break;                                                          \
    case GGUF_Q4_1: BODY(q4_1); break;                                                          \
    case GGUF_Q8_0: BODY(q8_0); break;                                                          \
    case GGUF_Q4_K: BODY(q4_k); break;                                                          \
    case GGUF_Q6_K: BODY(q6_k); break;                                                          \
    }

/* For every 32 elements of row `src` (K elements of type t, a multiple of its block): `k`, the
 * first one's index, and `w`, them decoded; then the statements. A block's scales are read once,
 * and its groups' loop is unrolled (their offsets and shifts constants). */
#define FOR_GROUPS(t, src, K, ...)                                                               \
    for (int64_t k0_ = 0; k0_ < (K); k0_ += ELEMS_##t) {                                        \
        const head_##t head_ = read_##t((src) + k0_ / ELEMS_##t * BYTES_##t);                   \
        _Pragma("GCC unroll 8") for (int j_ = 0; j_ < ELEMS_##t / 32; j_++) {                   \
            const int64_t k = k0_ + 32 * j_;                                                    \
            vf w[PIECES];                                                                       \
            group_##t(&head_, j_, w);                                                           \
            __VA_ARGS__                                                                         \
        }                                                                                       \
    }

/* Elements [k, k + 32) of row `src` (a multiple of 32 elements of `type`). */
static void decode_any(int64_t type, const uint8_t* src, int64_t k, vf* out) {
#define DECODE_ANY(t)                                                                            \
    {                                                                                           \
        const head_##t head = read_##t(src + k / ELEMS_##t * BYTES_##t);                        \
        group_##t(&head, (int)(k % ELEMS_##t / 32), out);                                       \
    }
    SWITCH_TYPE(type, DECODE_ANY)
#undef DECODE_ANY
}

/* Row `src` (K elements of `type`) in fp32: decoded into `out`, or src itself for aligned F32. */
static const float* decode_row(int64_t type, const uint8_t* src, int64_t K, float* out) {
    if (type == GGUF_F32 && (uintptr_t)src % sizeof(float) == 0) return (const float*)src;
    if (K % 32 != 0) { /* F32 / F16 / BF16 rows of odd lengths */
        for (int64_t k = 0; k < K; k++) {
            uint32_t bits = 0;
            float f = 0.0f;
            memcpy(type == GGUF_F32 ? (void*)&f : (void*)&bits, src + (type == GGUF_F32 ? 4 : 2) * k,
                   type == GGUF_F32 ? 4 : 2);
            if (type == GGUF_F16) f = half_to_float((uint16_t)bits);
            if (type == GGUF_BF16) bits <<= 16, memcpy(&f, &bits, sizeof f);
            out[k] = f;
        }
        return out;
    }
#define DECODE_ROW(t) FOR_GROUPS(t, src, K, for (int p = 0; p < PIECES; p++) vstore(out + k + p * VW, w[p]);)
    SWITCH_TYPE(type, DECODE_ROW)
#undef DECODE_ROW
    return out;
}

/* Up to this many rows the weight rows are decoded in registers (in even chunks of at most
 * QDIRECT), not into panels: with AVX-512, at 17-20 rows (a 16-row decode step plus a few
 * speculative drafts) three passes cost about what the panels do and keep each row's sum in
 * dot_rows' order, and from ~24 on the panels win (RESULTS.md, 20 and 23); with AVX2 the passes
 * still win at 48 rows (14%; at 21-24 rows 1.8x: RESULTS.md, 24). */
#if VW == 16
#define DIRECT_MAX_ROWS 20
#else
#define DIRECT_MAX_ROWS 48
#endif
#define QDIRECT 8 /* x rows per pass: 16 accumulators, the decoded block and x's (AVX-512) */
#define ACCS 2    /* accumulators per x row: two FMA chains (the latency would bound one) */
#define X_L1_BYTES (36 << 10) /* larger x chunks are walked in slices of X_SLICE (2+ rows) */
#define X_SLICE 1024          /* elements (a multiple of every block): 32 KiB of 8 rows */
/* out[m] = dot(row, x row m) for M <= QDIRECT rows of x, the row decoded in registers 32
 * elements at a time (K a multiple of its block): elements 0-15 of each 32 into one accumulator
 * per x row, 16-31 into another, then one sum. Every row adds in this one order whatever M and
 * however K is sliced, so a row's result does not depend on its batch (a verify step's rows
 * equal plain decoding's, bit for bit). A slice of K starts from the accumulators in `carry`
 * unless `first`, and leaves them there unless `last`. (With AVX2's 16 registers 8 rows spill a
 * little, but one pass of a 5-row verify still beats two of 3 + 2 rows: 30% faster, RESULTS.md,
 * 24. Tried and not kept: two or four weight rows side by side, for more FMA chains per x row:
 * in L2 2x faster at 1 row with AVX2, but a model's 1-row matmuls from memory 1.7-2.6x slower.) */
static inline __attribute__((always_inline)) void dot_rows(int64_t type, const uint8_t* src,
                                                           int64_t K, const float* x, int64_t ldx,
                                                           const int M, vf (*carry)[ACCS],
                                                           int first, int last, float* out) {
    vf acc[QDIRECT][ACCS];
    for (int m = 0; m < M; m++)
        for (int a = 0; a < ACCS; a++) acc[m][a] = first ? (vf){0} : carry[m][a];
#define DOT_ROWS(t)                                                                              \
    FOR_GROUPS(t, src, K, for (int m = 0; m < M; m++) for (int p = 0; p < PIECES; p++)         \
                              acc[m][p * ACCS / PIECES] += w[p] * vload(x + m * ldx + k + p * VW);)
    SWITCH_TYPE(type, DOT_ROWS)
#undef DOT_ROWS
    for (int m = 0; m < M; m++) {
        if (!last) {
            for (int a = 0; a < ACCS; a++) carry[m][a] = acc[m][a];
            continue;
        }
        out[m] = vsum(acc[m][0] + acc[m][1]);
    }
}
#define DEFINE_DOT_ROWS(M)                                                                       \
    static void dot_rows_##M(int64_t t, const uint8_t* s, int64_t K, const float* x,             \
                             int64_t ldx, vf (*carry)[ACCS], int first, int last, float* out) { \
        dot_rows(t, s, K, x, ldx, M, carry, first, last, out);                                  \
    }
DEFINE_DOT_ROWS(1)
DEFINE_DOT_ROWS(2)
DEFINE_DOT_ROWS(3)
DEFINE_DOT_ROWS(4)
DEFINE_DOT_ROWS(5)
DEFINE_DOT_ROWS(6)
DEFINE_DOT_ROWS(7)
DEFINE_DOT_ROWS(8)
typedef void (*dot_rows_fn)(int64_t, const uint8_t*, int64_t, const float*, int64_t,
                            vf (*)[ACCS], int, int, float*);
static const dot_rows_fn DOT_ROWS_FNS[QDIRECT + 1] = {
    0, dot_rows_1, dot_rows_2, dot_rows_3, dot_rows_4,
    dot_rows_5, dot_rows_6, dot_rows_7, dot_rows_8,
};

/* Bytes of the first K elements of a row of `type` (K a multiple of its block). */
static inline int64_t row_bytes(int64_t type, int64_t K) {
    const int64_t elems = type == GGUF_Q4_K || type == GGUF_Q6_K ? QK_K
                          : type == GGUF_F32 || type == GGUF_F16 || type == GGUF_BF16 ? 1
                                                                                      : QK;
    return K / elems * mg_quant_block_bytes(type);
}

/* Output rows n .. n + count - 1 of w: their bytes and types (-1 past the last segment). A
 * division per segment, not per row: at batch 1 two per row were ~13 cycles of a 576-element
 * row's ~110. */
void quant_weight_rows(const mg_weight* w, int64_t K, int64_t n, int64_t count,
                       const uint8_t** src, int64_t* type) {
    const uint8_t* p = w->data; /* where segment s starts */
    int64_t s = 0, stride = w->num_segments ? row_bytes(w->types[0], K) : 0;
    for (int64_t r = 0; r < count; r++, n++) {
        while (s < w->num_segments && n >= w->rows[s]) {
            p += w->rows[s] * stride, n -= w->rows[s++];
            stride = s < w->num_segments ? row_bytes(w->types[s], K) : 0;
        }
        type[r] = s < w->num_segments ? w->types[s] : -1;
        src[r] = p + n * stride;
    }
}

const uint8_t* quant_weight_row(const mg_weight* w, int64_t K, int64_t n, int64_t* type) {
    const uint8_t* src;
    quant_weight_rows(w, K, n, 1, &src, type);
    return src;
}

char* quant_grow(char** buffer, int64_t* capacity, int64_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}
/* A per-thread buffer of at least `floats`. */
static float* thread_scratch(int64_t floats) {
    static __thread char* buffer;
    static __thread int64_t capacity;
    return (float*)quant_grow(&buffer, &capacity, floats * (int64_t)sizeof(float));
}

/* ---- batches: rows decoded into a panel --------------------------------------------------------
 * Rows [n0, n0 + ncols) decoded into linear.c's panel layout [K, NB] (columns past ncols zero),
 * so a batch runs the fp32 path's register tiles. VW rows at a time, 32 elements of each are
 * decoded and transposed in registers (log2 VW rounds of two-source shuffles per VW x VW tile). */
/* Stage b of the transpose pairs rows i and i + b (bit b of i clear): row i takes its own
 * elements where bit b of the index is clear and row i + b's (shifted down by b) elsewhere,
 * row i + b the rest. Indices VW.. name the second row's elements. */
static inline void transpose_stage(vf* r, int B) {
    vi lo, hi;
    for (int e = 0; e < VW; e++) {
        lo[e] = e & B ? VW + e - B : e;
        hi[e] = e & B ? VW + e : e + B;
    }
    for (int i = 0; i < VW; i++)
        if (!(i & B)) {
            const vf a = r[i], b = r[i + B];
            r[i] = __builtin_shuffle(a, b, lo);
            r[i + B] = __builtin_shuffle(a, b, hi);
        }
}
static inline void transpose(vf r[VW]) {
    for (int B = VW / 2; B > 0; B /= 2) transpose_stage(r, B);
}

/* panel: [K, NB] floats, then K more (a row's scratch) */
static void decode_panel(const mg_weight* w, int64_t K, int64_t n0, int64_t ncols, float* panel) {
    if (NB % VW != 0 || K % 32 != 0 || VW < 8) { /* odd F32 / F16 rows, or SSE: one by one */
        float* row = panel + (int64_t)NB * K;
        memset(panel, 0, (size_t)(K * NB) * sizeof(float));
        for (int64_t j = 0; j < ncols; j++) {
            int64_t type;
            const uint8_t* src = quant_weight_row(w, K, n0 + j, &type);
            const float* decoded = decode_row(type, src, K, row);
            for (int64_t k = 0; k < K; k++) panel[k * NB + j] = decoded[k];
        }
        return;
    }
    for (int64_t g = 0; g < NB; g += VW) {
        const uint8_t* src[VW];
        int64_t types[VW];
        int same = 1; /* one type for the VW rows: its decoder inlined in the loop */
        for (int i = 0; i < VW; i++) { /* columns past ncols repeat the last: never stored */
            src[i] = quant_weight_row(w, K, n0 + min64(g + i, ncols - 1), &types[i]);
            same &= types[i] == types[0];
        }
        /* the VW rows' groups at k transposed into the panel's rows k .. k + 31 */
#define STORE_TILES                                                                              \
    for (int p = 0; p < PIECES; p++) {                                                          \
        vf tile[VW];                                                                            \
        for (int i = 0; i < VW; i++) tile[i] = w[i][p];                                         \
        transpose(tile);                                                                        \
        for (int e = 0; e < VW; e++) vstore(panel + (k + p * VW + e) * NB + g, tile[e]);        \
    }
        if (!same) { /* a segment boundary inside the VW rows */
            for (int64_t k = 0; k < K; k += 32) {
                vf w[VW][PIECES];
                for (int i = 0; i < VW; i++) decode_any(types[i], src[i], k, w[i]);
                STORE_TILES
            }
            continue;
        }
#define PANEL_LOOP(t)                                                                            \
    for (int64_t k0 = 0; k0 < K; k0 += ELEMS_##t) {                                             \
        head_##t heads[VW];                                                                     \
        for (int i = 0; i < VW; i++) {                                                          \
            const uint8_t* b = src[i] + k0 / ELEMS_##t * BYTES_##t;                             \
            __builtin_prefetch(b + PREFETCH_BYTES);                                             \
            heads[i] = read_##t(b);                                                             \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < ELEMS_##t / 32; j++) {                      \
            const int64_t k = k0 + 32 * j;                                                      \
            vf w[VW][PIECES];                                                                   \
            for (int i = 0; i < VW; i++) group_##t(&heads[i], j, w[i]);                         \
            STORE_TILES                                                                         \
        }                                                                                       \
    }
        SWITCH_TYPE(types[0], PANEL_LOOP)
#undef PANEL_LOOP
#undef STORE_TILES
    }
}


/* ---- the linear op ------------------------------------------------------------------------------
 * The int8 path, or up to DIRECT_MAX_ROWS rows of x: items of RG weight rows, each row decoded
 * in registers and dotted with every x row. More: items of one panel (NB weight rows) times up
 * to MC rows of x, in panel-major order. */
static int direct(const linear_args* a) { return a->M <= DIRECT_MAX_ROWS && a->K % 32 == 0; }

int64_t quant_items(const linear_args* a) {
    if (quant_int8_path(a) || direct(a)) return (a->N + RG - 1) / RG;
    return ((a->N + NB - 1) / NB) * ((a->M + MC - 1) / MC);
}

/* Items [begin, end) of RG weight rows each, each row decoded in registers and dotted with the
 * activation rows, up to QDIRECT at a time (in even chunks). */
static void direct_range(const linear_args* a, int64_t begin, int64_t end) {
    const int64_t K = a->K;
    const int64_t passes = (a->M + QDIRECT - 1) / QDIRECT, chunk = (a->M + passes - 1) / passes;
    for (int64_t m0 = 0; m0 < a->M; m0 += chunk) {
        const int64_t M = min64(chunk, a->M - m0);
        const float* x = a->x + m0 * a->ldx;
        /* K in slices whose x rows stay in L1 across the item's weight rows (one row streams
         * from L2 as fast: slices would only make the item's 16 weight rows 16 jumping streams) */
        const int64_t slice = M == 1 || M * K * (int64_t)sizeof(float) <= X_L1_BYTES ? K : X_SLICE;
        for (int64_t n0 = begin * RG; n0 < min64(a->N, end * RG); n0 += RG) {
            const int64_t rows = min64(RG, a->N - n0);
            float sums[RG][QDIRECT];
            vf carry[RG][QDIRECT][ACCS]; /* the accumulators from slice to slice */
            const uint8_t* src[RG];
            int64_t types[RG];
            quant_weight_rows(a->w, K, n0, rows, src, types);
            for (int64_t k0 = 0; k0 < K; k0 += slice) {
                int64_t offset_type = -2, offset = 0; /* row_bytes(type, k0), for the last type */
                for (int64_t r = 0; r < rows; r++) {
                    if (types[r] != offset_type)
                        offset_type = types[r], offset = row_bytes(types[r], k0);
                    DOT_ROWS_FNS[M](types[r], src[r] + offset, min64(slice, K - k0), x + k0,
                                    a->ldx, carry[r], k0 == 0, k0 + slice >= K, sums[r]);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t m = 0; m < M; m++)
                    a->y[(m0 + m) * a->ldy + n0 + r] =
                        sums[r][m] + (a->bias ? a->bias[n0 + r] : 0.0f);
        }
    }
}

void quant_range(const void* args, int64_t begin, int64_t end) {
    const linear_args* a = args;
    const int64_t K = a->K;
    if (quant_int8_path(a) || direct(a)) { /* (the int8 path falls back if out of memory) */
        if (!quant_int8_path(a) || !quant_int8_range(a, begin, end)) direct_range(a, begin, end);
        return;
    }
    float* panel = thread_scratch((NB + 1) * K);
    int64_t decoded = -1; /* the panel in the scratch: consecutive items often share it */
    for (int64_t item = begin; item < end; item++) {
        const int64_t chunks = (a->M + MC - 1) / MC; /* panel-major: a panel decoded once */
        const int64_t p = item / chunks, m0 = (item % chunks) * MC, n0 = p * NB;
        if (p != decoded) decode_panel(a->w, K, n0, min64(NB, a->N - n0), panel);
        decoded = p;
        rows_times_panel(a->x + m0 * a->ldx, a->ldx, min64(MC, a->M - m0), panel, K,
                         a->bias ? a->bias + n0 : 0, a->y + m0 * a->ldy + n0, a->ldy,
                         min64(NB, a->N - n0));
    }
}

/* ---- embedding lookup ------------------------------------------------------------------------- */
typedef struct {
    const mg_weight* w;
    int64_t K;
    const int64_t* ids;
    float* out;
} embed_args;

static void embed_range(const void* args, int64_t begin, int64_t end) {
    const embed_args* a = args;
    for (int64_t r = begin; r < end; r++) {
        int64_t type;
        const uint8_t* src = quant_weight_row(a->w, a->K, a->ids[r], &type);
        float* out = a->out + r * a->K;
        const float* row = decode_row(type, src, a->K, out);
        if (row != out) memcpy(out, row, (size_t)a->K * sizeof(float));
    }
}

/* out[r] = row ids[r] of w in fp32, for n ids (rows of K elements). */
void mg_embed(const mg_weight* w, int64_t K, const int64_t* ids, int64_t n, float* out,
              int nthreads) {
    const embed_args a = {w, K, ids, out};
    run_parallel(&a, embed_range, n, max64(1, n / (2 * (int64_t)nthreads)), nthreads);
}
