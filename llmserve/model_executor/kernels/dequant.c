/* Rows of stored weights widened to fp32: every GGUF block type of the common Q4_K_M, Q5_K_M, Q6_K,
 * Q8_0, Q4_0 and Q4_1 files, and the 2-byte floats of Hugging Face checkpoints.
 *
 * The values are exactly those of `gguf.quants.dequantize` (which Hugging Face uses to read a GGUF too):
 * the same float operations in the same order, and no multiply fused with the add that follows it. So
 * a product over these rows is the dequantized fp32 product, up to summation order. The loops run over
 * whole blocks with constant bounds, for the compiler to vectorise at the build's width.
 *
 * Layouts (llama.cpp's ggml-common.h), little-endian, fp16 scales:
 * Q4_0 (18 B / 32): d, 16 B nibbles; weight j < 16 is the low nibble of byte j, j + 16 its high one;
 *   d * (q - 8). Q4_1 (20 B): d, m, nibbles; d * q + m. Q5_0 (22 B): d, 32 high bits qh, nibbles;
 *   d * (q - 16). Q5_1 (24 B): d, m, qh, nibbles; d * q + m. Q8_0 (34 B): d, 32 int8; d * q.
 * Q4_K (144 B / 256): d, dmin, 12 B of 6-bit scales and minimums for 8 sub-blocks of 32, 128 B
 *   nibbles (sub-block 2c the low nibbles of bytes 32c.., 2c + 1 the high ones); (d * sc) * q - dmin * m.
 * Q5_K (176 B): as Q4_K with 32 B of fifth bits before the nibbles (bit i of byte l for sub-block i).
 * Q6_K (210 B): 128 B low nibbles, 64 B high 2 bits, 16 int8 scales (one per 16), d; (d * sc) * (q - 32).
 */
#pragma GCC optimize("fp-contract=off")

#include <omp.h>
#include <stdint.h>

#include "kernels.h"

int64_t row_bytes(int qtype, int64_t k)
{
    int64_t block = QK, bytes;
    switch (qtype) {
    case F32: block = 1, bytes = 4; break;
    case F16: case BF16: block = 1, bytes = 2; break;
    case Q4_0: bytes = 18; break;
    case Q4_1: bytes = 20; break;
    case Q5_0: bytes = 22; break;
    case Q5_1: bytes = 24; break;
    case Q8_0: bytes = 34; break;
    case Q4_K: block = QK_K, bytes = 144; break;
    case Q5_K: block = QK_K, bytes = 176; break;
    case Q6_K: block = QK_K, bytes = 210; break;
    default: return 0;
    }
    return k > 0 && k % block == 0 ? k / block * bytes : 0;
}

static inline uint32_t read_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Inlined into each caller, so that each type's loops are compiled for its constant flags. */
#define INLINE static inline __attribute__((always_inline))

/* Q4_0 and Q4_1 (with_min), Q5_0 and Q5_1 (with high bits). */
INLINE void legacy_row(const uint8_t *src, int64_t k, float *dst, int with_min, int with_high)
{
    const int64_t stride = 18 + 2 * with_min + 4 * with_high;
    const int offset = with_high ? 16 : 8; /* what the unsigned value is centred on, without a minimum */
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *block = src + b * stride, *qs = block + 2 + 2 * with_min + 4 * with_high;
        const float d = read_half(block), m = with_min ? read_half(block + 2) : 0.0f;
        const uint32_t qh = with_high ? read_u32(block + 2 + 2 * with_min) : 0;
        float *y = dst + b * QK;
        int q[QK];
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
            q[j + 16] = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        }
        if (with_min)
            for (int j = 0; j < QK; j++)
                y[j] = d * (float)q[j] + m;
        else
            for (int j = 0; j < QK; j++)
                y[j] = d * (float)(q[j] - offset);
    }
}

static void q8_0_row(const uint8_t *src, int64_t k, float *dst)
{
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *block = src + b * 34;
        const float d = read_half(block);
        const int8_t *qs = (const int8_t *)(block + 2);
        for (int j = 0; j < QK; j++)
            dst[b * QK + j] = d * (float)qs[j];
    }
}

/* Q4_K's and Q5_K's 6-bit scale and minimum of sub-block i. */
static inline void scale_min(const uint8_t *s, int i, int *sc, int *mn)
{
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 0x0f) | ((s[i - 4] >> 6) << 4);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

/* Q4_K, and Q5_K with fifth bits. */
INLINE void k_row(const uint8_t *src, int64_t k, float *dst, int with_high)
{
    const int64_t stride = with_high ? 176 : 144;
    for (int64_t b = 0; b < k / QK_K; b++) {
        const uint8_t *block = src + b * stride, *scales = block + 4;
        const uint8_t *qh = block + 16, *qs = block + 16 + 32 * with_high;
        const float d = read_half(block), dmin = read_half(block + 2);
        for (int i = 0; i < 8; i++) {
            int sc, mn;
            scale_min(scales, i, &sc, &mn);
            const float d1 = d * (float)sc, m1 = dmin * (float)mn;
            const uint8_t *nibbles = qs + 32 * (i / 2);
            const int shift = 4 * (i % 2);
            float *y = dst + b * QK_K + 32 * i;
            for (int l = 0; l < 32; l++) {
                const int high = with_high ? ((qh[l] >> i) & 1) << 4 : 0;
                y[l] = d1 * (float)(((nibbles[l] >> shift) & 0x0f) | high) - m1;
            }
        }
    }
}

static void q6_k_row(const uint8_t *src, int64_t k, float *dst)
{
    for (int64_t b = 0; b < k / QK_K; b++) {
        const uint8_t *block = src + b * 210, *ql = block, *qh = block + 128;
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = read_half(block + 208);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                const uint8_t *low = ql + 64 * h + 32 * (t % 2), *high = qh + 32 * h;
                const int shift = 4 * (t / 2);
                const int pos = 128 * h + 32 * t;
                for (int half = 0; half < 2; half++) {
                    const float d1 = d * (float)scales[pos / 16 + half];
                    float *y = dst + b * QK_K + pos + 16 * half;
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int q = (((low[l] >> shift) & 0x0f) | (((high[l] >> (2 * t)) & 3) << 4)) - 32;
                        y[l - 16 * half] = d1 * (float)q;
                    }
                }
            }
    }
}

void dequantize_row(int qtype, const uint8_t *src, int64_t k, float *dst)
{
    switch (qtype) {
    case F32: memcpy(dst, src, sizeof(float) * k); break;
    case F16:
        for (int64_t i = 0; i < k; i++)
            dst[i] = read_half(src + 2 * i);
        break;
    case BF16:
        for (int64_t i = 0; i < k; i++) {
            const uint32_t bits = (uint32_t)(src[2 * i] | src[2 * i + 1] << 8) << 16;
            memcpy(dst + i, &bits, 4);
        }
        break;
    case Q4_0: legacy_row(src, k, dst, 0, 0); break;
    case Q4_1: legacy_row(src, k, dst, 1, 0); break;
    case Q5_0: legacy_row(src, k, dst, 0, 1); break;
    case Q5_1: legacy_row(src, k, dst, 1, 1); break;
    case Q8_0: q8_0_row(src, k, dst); break;
    case Q4_K: k_row(src, k, dst, 0); break;
    case Q5_K: k_row(src, k, dst, 1); break;
    case Q6_K: q6_k_row(src, k, dst); break;
    }
}

/* out[i] = row ids[i] of W [rows, k] (stored as qtype) in fp32: an embedding lookup, or a whole weight
 * dequantized. Returns 0, or -1 for a type or width we do not read. */
int dequantize_rows(const uint8_t *w, int qtype, int64_t k, const int64_t *ids, int64_t n, float *out,
                    int num_threads)
{
    const int64_t bytes = row_bytes(qtype, k);
    if (bytes == 0)
        return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++)
        dequantize_row(qtype, w + ids[i] * bytes, k, out + i * k);
    return 0;
}
