/* Shared by the GGUF block files: quant.c (blocks decoded to fp32, the linear op and embedding
 * lookups) and quant_int8.c (blocks times int8 activations, opt-in). */
#ifndef MINISGL_QUANT_H
#define MINISGL_QUANT_H

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

enum {
    GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8, GGUF_Q4_K = 12,
    GGUF_Q6_K = 14, GGUF_BF16 = 30
};

#define QK 32    /* elements per Q4_0 / Q4_1 / Q8_0 block */
#define QK_K 256 /* elements per K-quant super-block */
#define RG 16    /* weight rows per work item of a small batch */

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    bits = sign | (exp == 31 ? 0x7F800000 | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float load_half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

/* Bytes per block of a type served as blocks; 0 for any other type. */
int64_t mg_quant_block_bytes(int64_t type);
/* Output row n of w: its bytes, and its type in *type. */
const uint8_t* quant_weight_row(const mg_weight* w, int64_t K, int64_t n, int64_t* type);
/* The same for rows n .. n + count - 1 (type -1 past the last segment). */
void quant_weight_rows(const mg_weight* w, int64_t K, int64_t n, int64_t count,
                       const uint8_t** src, int64_t* type);
/* *buffer (64-byte aligned) grown to at least `bytes`, never shrunk: the kernels' per-thread
 * scratches (threads live as long as the process's OpenMP pool). NULL when out of memory. */
char* quant_grow(char** buffer, int64_t* capacity, int64_t bytes);

/* quant_int8.c: whether op a takes the int8 path (asked for, and every segment of a type it
 * serves), and its items [begin, end) of RG weight rows (0 when out of memory: the caller falls
 * back to the fp32 path). */
int quant_int8_path(const linear_args* a);
int quant_int8_range(const linear_args* a, int64_t begin, int64_t end);

#endif
