/* A GGUF row read 32 weights (a chunk) at a time as small integers and scales: what the integer products
 * with int8 activations multiply (block_q8.c, int8_gemm.c). */
#ifndef LLMSERVE_BLOCK_CHUNKS_H
#define LLMSERVE_BLOCK_CHUNKS_H

#include "dequant.h"

/* Every block type reads as chunks of 32 weights w = scale[h] * v + offset, v integers (h: which 16 of
 * the 32): unsigned below 64 for most types, whose minimum or centre goes to `offset` and meets x's
 * sum(q) term; int8 for Q8_0 and Q6_K (their centre is inside v; block_q8.c's VNNI products read Q6_K
 * unsigned and take the centre off in integers). For Q4_K/Q5_K a chunk is a sub-block,
 * for Q6_K two of its sub-blocks of 16, and the scales are the super-block's (dequant.h's k_scales). */
INLINE int is_signed(int qtype)
{
    return qtype == Q8_0 || qtype == Q6_K;
}

/* A chunk's weight scales, per 16 weights, and its offset. */
typedef struct {
    float scale[2], offset;
} Chunk;

INLINE Chunk chunk_scales(int qtype, const uint8_t *row, int64_t s, const KScales *k)
{
    const uint8_t *block = row + bytes32(qtype) * s; /* legacy types only */
    const int i = (int)(s % 8);
    switch (qtype) {
    case Q4_0: { const float d = read_half(block); return (Chunk){{d, d}, -8.0f * d}; }
    case Q5_0: { const float d = read_half(block); return (Chunk){{d, d}, -16.0f * d}; }
    case Q4_1: case Q5_1: { const float d = read_half(block); return (Chunk){{d, d}, read_half(block + 2)}; }
    case Q8_0: { const float d = read_half(block); return (Chunk){{d, d}, 0.0f}; }
    case Q6_K: return (Chunk){{k->d[2 * i], k->d[2 * i + 1]}, 0.0f};
    default: return (Chunk){{k->d[i], k->d[i]}, -k->m[i]}; /* Q4_K, Q5_K */
    }
}

/* The start of the group of 8 chunks that chunk s of a row lies in (a K type's super-block): where
 * chunk_values reads chunk s % 8 of it from. */
INLINE const uint8_t *chunk_group(int qtype, const uint8_t *row, int64_t s)
{
    return row + (is_k_type(qtype) ? block_bytes(qtype) * (s / 8) : bytes32(qtype) * (s - s % 8));
}

#ifdef USE_AVX2
/* Chunk i of a group's 32 values v as bytes. */
INLINE __m256i chunk_values(int qtype, const uint8_t *group, int i)
{
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i low4x2 = _mm256_set1_epi8(0x0f);
    if (qtype == Q8_0)
        return _mm256_loadu_si256((const __m256i *)(group + bytes32(Q8_0) * i + 2));
    if (!is_k_type(qtype)) {
        const int with_min = qtype == Q4_1 || qtype == Q5_1, with_high = qtype == Q5_0 || qtype == Q5_1;
        const uint8_t *block = group + bytes32(qtype) * i, *qs = block + 2 + 2 * with_min + 4 * with_high;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        if (with_high) {
            uint32_t qh;
            memcpy(&qh, block + 2 + 2 * with_min, 4);
            lo = add_fifth_bits(lo, qh, 0);
            hi = add_fifth_bits(hi, qh, 1);
        }
        return _mm256_set_m128i(hi, lo);
    }
    const uint8_t *block = group;
    if (qtype == Q6_K) {
        const int h = i / 4, t = i % 4;
        const __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * (t % 2)));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        const __m256i nibble = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(low, 4) : low, low4x2);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(nibble, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
    }
    const int with_high = qtype == Q5_K;
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * with_high + 32 * (i / 2)));
    __m256i v = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low4x2);
    if (with_high) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(i)), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    return v;
}

#else
/* Chunk i of a group's 32 values v. */
INLINE void chunk_values(int qtype, const uint8_t *group, int i, int8_t v[32])
{
    if (!is_k_type(qtype)) {
        const uint8_t *block = group + bytes32(qtype) * i;
        if (qtype == Q8_0) {
            memcpy(v, block + 2, 32);
            return;
        }
        const int with_min = qtype == Q4_1 || qtype == Q5_1, with_high = qtype == Q5_0 || qtype == Q5_1;
        const uint8_t *qs = block + 2 + 2 * with_min + 4 * with_high;
        uint32_t qh = 0;
        if (with_high)
            memcpy(&qh, block + 2 + 2 * with_min, 4);
        for (int j = 0; j < 32; j++)
            v[j] = (int8_t)(((qs[j % 16] >> (j < 16 ? 0 : 4)) & 0x0f) | (((qh >> j) & 1) << 4));
        return;
    }
    const uint8_t *block = group;
    for (int j = 0; j < 32; j++) {
        if (qtype == Q6_K) {
            const int h = i / 4, t = i % 4;
            const int low = (block[64 * h + 32 * (t % 2) + j] >> (4 * (t / 2))) & 0x0f;
            const int top = (block[128 + 32 * h + j] >> (2 * t)) & 3;
            v[j] = (int8_t)((low | top << 4) - 32);
        } else {
            const int with_high = qtype == Q5_K;
            const int low = (block[16 + 32 * with_high + 32 * (i / 2) + j] >> (4 * (i % 2))) & 0x0f;
            v[j] = (int8_t)(low | (with_high ? ((block[16 + j] >> i) & 1) << 4 : 0));
        }
    }
}

#endif

#endif
