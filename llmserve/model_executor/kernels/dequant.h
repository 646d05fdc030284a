/* 32 stored weights at a time widened to two vectors of 16 fp32: what dequant.c stores and weight_gemm.c
 * multiplies straight from registers.
 *
 * The values are exactly those of `gguf.quants.dequantize` (which Hugging Face uses to read a GGUF too):
 * the same float operations in the same order, and no multiply fused with the add that follows it, so
 * every file that includes this compiles with fp-contract off. A product over these values is then the
 * dequantized fp32 product, up to summation order.
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
#ifndef LLMSERVE_DEQUANT_H
#define LLMSERVE_DEQUANT_H

#include "kernels.h"

/* GCC notes (-Wpsabi) that returning a 64-byte vector without AVX-512 passes it differently from an
 * AVX-512 build. These helpers are static and always inlined, so no call crosses a library boundary. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* Sixteen lanes, whatever the build: one AVX-512 register, two AVX2 ones, four SSE ones. Integers are
 * widened to 32 bits before the conversion to float, which the compiler then vectorises. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

INLINE u8x16 load16(const uint8_t *p)
{
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

INLINE i32x16 widen(u8x16 v)
{
    return __builtin_convertvector(v, i32x16);
}

INLINE f32x16 to_float(i32x16 v)
{
    return __builtin_convertvector(v, f32x16);
}

/* Q4_K's and Q5_K's 6-bit scales and minimums of their 8 sub-blocks, from 12 bytes: sub-block i < 4
 * has its scale in the low 6 bits of byte i and its minimum in those of byte i + 4; sub-block i >= 4
 * the low and high nibbles of byte i + 4, with the top 2 bits of bytes i - 4 and i above them. Four
 * sub-blocks at a time, as the bytes of 32-bit words. */
INLINE void scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    const uint32_t words[4] = {a & low6, (c & low4) | (((a >> 6) & top2) << 4), b & low6,
                               ((c >> 4) & low4) | (((b >> 6) & top2) << 4)};
    memcpy(sc, words, 8);
    memcpy(mn, words + 2, 8);
}

/* out[i] = d * (float)v[i] for 8 bytes v. */
INLINE void scale8(const uint8_t v[8], float d, float out[8])
{
    for (int i = 0; i < 8; i++)
        out[i] = d * (float)v[i];
}

#ifdef USE_AVX2
/* Bits [16 half, 16 half + 16) of qh as 16 bytes of 16 or 0, added to q. */
INLINE __m128i add_fifth_bits(__m128i q, uint32_t qh, int half)
{
    const uint32_t bits = qh >> (16 * half);
#ifdef USE_AVX512
    return _mm_mask_add_epi8(q, (__mmask16)bits, q, _mm_set1_epi8(16));
#else
    /* byte i takes byte i / 8 of the bits, keeps bit i % 8, and becomes 16 if it was set */
    const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi32((int)bits), _mm_set_epi64x(0x0101010101010101, 0));
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ull);
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
    return _mm_add_epi8(q, _mm_and_si128(set, _mm_set1_epi8(16)));
#endif
}

/* d * v (+ m, with add_m) for v's 16 int8 (is_signed) or uint8 values, as fp32: the multiply and the
 * add separate, as everywhere here. The scale is applied on the build's own vectors: GCC keeps a 64-byte
 * vector in memory on AVX2, and built d's broadcast there one float at a time, stalling every load. */
INLINE f32x16 scaled16(__m128i v, int is_signed, float d, float m, int add_m)
{
#ifdef USE_AVX512
    __m512 f = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    f = _mm512_mul_ps(_mm512_set1_ps(d), f);
    return (f32x16)(add_m ? _mm512_add_ps(f, _mm512_set1_ps(m)) : f);
#else
    typedef float f32x8 __attribute__((vector_size(32)));
    const __m128i halves[2] = {v, _mm_unpackhi_epi64(v, v)};
    f32x8 f[2];
    for (int h = 0; h < 2; h++) {
        const __m128i b = halves[h];
        __m256 x = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
        x = _mm256_mul_ps(_mm256_set1_ps(d), x);
        f[h] = (f32x8)(add_m ? _mm256_add_ps(x, _mm256_set1_ps(m)) : x);
    }
    return __builtin_shufflevector(f[0], f[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
#endif

#ifdef USE_AVX512
/* On AVX-512 a 4-bit weight (Q4_0, Q4_1, Q4_K) is read through a table: the 16 values its nibble can
 * stand for, computed in one register by the operations that compute one weight in the other builds,
 * then one permute per 16 weights by their nibbles (vpermps reads the low 4 bits of each lane only), in
 * place of a conversion, a multiply and an add; a 5-bit one (Q5_0, Q5_1) through two: fewer instructions a
 * weight, where widening bounds a row's rate. The table's lanes:
 * the nibbles 0..15 less the type's centre, as floats. */
INLINE __m512 nibble_lanes(int centre)
{
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_sub_ps(nibbles, _mm512_set1_ps((float)centre));
}

/* The weights of the 16 bytes at p: their low nibbles, or (high) their high ones, looked up in table. */
INLINE f32x16 nibbles16(const uint8_t *p, int high, __m512 table)
{
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return (f32x16)_mm512_permutexvar_ps(high ? _mm512_srli_epi32(bytes, 4) : bytes, table);
}
#endif

/* legacy32 reads one whole block of Q4_0 and Q4_1 (with_min), Q5_0 and Q5_1 (with high bits); q8_0_32
 * one of Q8_0. AVX-512 looks the values up (above). With AVX2 the bytes stay bytes until one widening to
 * int32, and the fifth bits are spread to bytes at once: the generic code's per-lane shifts of qh made
 * Q5_0 cost twice Q4_0. The values are the same either way. */
INLINE void legacy32(const uint8_t *block, int with_min, int with_high, f32x16 w[2])
{
    const int offset = with_high ? 16 : 8; /* what the unsigned value is centred on, without a minimum */
    const uint8_t *qs = block + 2 + 2 * with_min + 4 * with_high;
    const float d = read_half(block), m = with_min ? read_half(block + 2) : 0.0f;
    uint32_t qh = 0;
    if (with_high)
        memcpy(&qh, block + 2 + 2 * with_min, 4);
#ifdef USE_AVX512
    {
        /* with fifth bits, a second table for the values 16..31, looked up where the bit is set */
        const int centre = with_min ? 0 : offset;
        const __m512 dq = _mm512_mul_ps(_mm512_set1_ps(d), nibble_lanes(centre));
        const __m512 dq16 = _mm512_mul_ps(_mm512_set1_ps(d), nibble_lanes(centre - 16));
        const __m512 table = with_min ? _mm512_add_ps(dq, _mm512_set1_ps(m)) : dq;
        const __m512 table16 = with_min ? _mm512_add_ps(dq16, _mm512_set1_ps(m)) : dq16;
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        for (int half = 0; half < 2; half++) {
            const __m512i nibbles = half ? _mm512_srli_epi32(bytes, 4) : bytes;
            const __m512 low = _mm512_permutexvar_ps(nibbles, table);
            const __mmask16 fifth = (__mmask16)(qh >> (16 * half));
            w[half] = (f32x16)(with_high ? _mm512_mask_permutexvar_ps(low, fifth, nibbles, table16) : low);
        }
        return;
    }
#endif
#ifdef USE_AVX2
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
    __m128i q[2] = {_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)};
    for (int half = 0; half < 2; half++) {
        if (with_high)
            q[half] = add_fifth_bits(q[half], qh, half);
        w[half] = with_min ? scaled16(q[half], 0, d, m, 1)
                           : scaled16(_mm_sub_epi8(q[half], _mm_set1_epi8((char)offset)), 1, d, 0.0f, 0);
    }
#else
    static const u32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const u8x16 bytes = load16(qs);
    i32x16 q[2] = {widen(bytes & 0x0f), widen(bytes >> 4)};
    for (int half = 0; half < 2; half++) {
        if (with_high)
            q[half] |= (i32x16)((((qh >> (16 * half)) >> lane) & 1) << 4);
        w[half] = with_min ? d * to_float(q[half]) + m : d * to_float(q[half] - offset);
    }
#endif
}

INLINE void q8_0_32(const uint8_t *block, f32x16 w[2])
{
    const float d = read_half(block);
    for (int half = 0; half < 2; half++)
#ifdef USE_AVX2
        w[half] = scaled16(_mm_loadu_si128((const __m128i *)(block + 2 + 16 * half)), 1, d, 0.0f, 0);
#else /* unsigned bytes offset by 128: those widen in vectors */
        w[half] = d * to_float(widen(load16(block + 2 + 16 * half) ^ 0x80) - 128);
#endif
}

/* A K super-block's scales: d * sc and, for Q4_K/Q5_K, dmin * m, per group of 32 weights (8 of them) or,
 * for Q6_K, per 16 (16 of them): one super-block's worth, computed once for its 256 weights. */
typedef struct {
    float d[16], m[8];
} KScales;

INLINE void k_scales(int qtype, const uint8_t *block, KScales *out)
{
    if (qtype == Q6_K) {
        const float d = read_half(block + 208);
#ifdef USE_AVX2
        for (int h = 0; h < 2; h++) {
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 192 + 8 * h)));
            _mm256_storeu_ps(out->d + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc)));
        }
#else
        for (int i = 0; i < 16; i++)
            out->d[i] = d * (float)(int8_t)block[192 + i];
#endif
        return;
    }
#ifdef USE_AVX2
    /* scales_mins on the words a, b, c of one vector (a decode step reads a super-block in ~100
     * instructions; the scalar words and their moves into vectors took a third of them) */
    const __m128i v = _mm_loadu_si128((const __m128i *)block);       /* d and dmin, a, b, c */
    const __m128i ab = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 3, 2, 1)); /* a, b in lanes 0, 1 */
    const __m128i c = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 3, 3, 3)), _mm_setr_epi32(0, 4, 0, 0));
    const __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(ab, 6), _mm_set1_epi8(3)), 4);
    const __m128i low = _mm_and_si128(ab, _mm_set1_epi8(0x3f));                  /* sub-blocks 0-3 */
    const __m128i high = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi8(0x0f)), top); /* sub-blocks 4-7 */
    const __m128i sc_mn = _mm_unpacklo_epi32(low, high); /* the 8 scales, then the 8 minimums */
    const __m256 d = _mm256_castps128_ps256(_mm_cvtph_ps(v));  /* d, dmin in lanes 0, 1 */
    _mm256_storeu_ps(out->d, _mm256_mul_ps(_mm256_permutevar8x32_ps(d, _mm256_set1_epi32(0)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc_mn))));
    _mm256_storeu_ps(out->m, _mm256_mul_ps(_mm256_permutevar8x32_ps(d, _mm256_set1_epi32(1)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sc_mn, sc_mn)))));
#else
    uint8_t sc[8], mn[8];
    scales_mins(block + 4, sc, mn);
    scale8(sc, read_half(block), out->d);
    scale8(mn, read_half(block + 2), out->m);
#endif
}

/* Sub-block i of a Q4_K (or, with_high, Q5_K) super-block, its scales given. */
INLINE void k32(const uint8_t *block, int i, int with_high, const KScales *k, f32x16 w[2])
{
    const uint8_t *qh = block + 16, *qs = block + 16 + 32 * with_high;
#ifdef USE_AVX512
    if (!with_high) {
        const __m512 dq = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), nibble_lanes(0));
        const __m512 table = _mm512_sub_ps(dq, _mm512_set1_ps(k->m[i])); /* gguf's d * q - m */
        for (int half = 0; half < 2; half++)
            w[half] = nibbles16(qs + 32 * (i / 2) + 16 * half, i % 2, table);
        return;
    }
#endif
    for (int half = 0; half < 2; half++) {
        const u8x16 bytes = load16(qs + 32 * (i / 2) + 16 * half);
        u8x16 q = i % 2 ? bytes >> 4 : bytes & 0x0f;
        if (with_high)
            q |= ((load16(qh + 16 * half) >> i) & 1) << 4;
#ifdef USE_AVX2
        w[half] = scaled16((__m128i)q, 0, k->d[i], -k->m[i], 1);
#else
        w[half] = k->d[i] * to_float(widen(q)) - k->m[i];
#endif
    }
}

/* Weights 32 g .. 32 g + 31 of a Q6_K super-block (g < 8), its scales given. */
INLINE void q6_k32(const uint8_t *block, int g, const KScales *k, f32x16 w[2])
{
    const int h = g / 4, t = g % 4;
#ifdef USE_AVX2
    /* the 32 values in one vector of bytes, then widened by halves (by halves throughout was 1.4 times
     * the instructions) */
    const __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * (t % 2)));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
    const __m256i nibble = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(low, 4) : low, _mm256_set1_epi8(0x0f));
    const __m256i top = _mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t));
    const __m256i top2 = _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(3)), 4);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibble, top2), _mm256_set1_epi8(32));
    w[0] = scaled16(_mm256_castsi256_si128(q), 1, k->d[2 * g], 0.0f, 0);
    w[1] = scaled16(_mm256_extracti128_si256(q, 1), 1, k->d[2 * g + 1], 0.0f, 0);
#else
    for (int half = 0; half < 2; half++) {
        const u8x16 low = load16(block + 64 * h + 32 * (t % 2) + 16 * half);
        const u8x16 high = load16(block + 128 + 32 * h + 16 * half);
        const u8x16 q = ((t / 2 ? low >> 4 : low) & 0x0f) | (((high >> (2 * t)) & 3) << 4);
        w[half] = k->d[2 * g + half] * to_float(widen(q) - 32);
    }
#endif
}

INLINE void f16_32(const uint8_t *src, f32x16 w[2])
{
    float v[32];
#ifdef USE_AVX2
    for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(v + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#else
    for (int i = 0; i < 32; i++)
        v[i] = read_half(src + 2 * i);
#endif
    memcpy(w, v, sizeof v);
}

INLINE void bf16_32(const uint8_t *src, f32x16 w[2])
{
    for (int half = 0; half < 2; half++) {
        uint16_t h[16];
        memcpy(h, src + 32 * half, 32);
        u32x16 bits;
        for (int j = 0; j < 16; j++)
            bits[j] = (uint32_t)h[j] << 16;
        memcpy(&w[half], &bits, 64);
    }
}

INLINE int is_k_type(int qtype)
{
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
}

/* Stored bytes of 32 weights of a type that is not a K type. */
INLINE int64_t bytes32(int qtype)
{
    return 32 / block_weights(qtype) * block_bytes(qtype);
}

/* Weights 32 g .. 32 g + 31 (g < 8) of a K type's super-block, its scales given. */
INLINE void k_decode32(int qtype, const uint8_t *block, int g, const KScales *k, f32x16 w[2])
{
    if (qtype == Q6_K)
        q6_k32(block, g, k, w);
    else
        k32(block, g, qtype == Q5_K, k, w);
}

/* Weights 32 s .. 32 s + 31 of a row of `qtype` (a constant after inlining) starting at `row`; for a K
 * type, `k` holds the scales of the super-block they lie in (k_scales). */
INLINE void decode32(int qtype, const uint8_t *row, int64_t s, const KScales *k, f32x16 w[2])
{
    switch (qtype) {
    case F32: memcpy(w, row + bytes32(F32) * s, 128); break;
    case F16: f16_32(row + bytes32(F16) * s, w); break;
    case BF16: bf16_32(row + bytes32(BF16) * s, w); break;
    case Q4_0: legacy32(row + bytes32(Q4_0) * s, 0, 0, w); break;
    case Q4_1: legacy32(row + bytes32(Q4_1) * s, 1, 0, w); break;
    case Q5_0: legacy32(row + bytes32(Q5_0) * s, 0, 1, w); break;
    case Q5_1: legacy32(row + bytes32(Q5_1) * s, 1, 1, w); break;
    case Q8_0: q8_0_32(row + bytes32(Q8_0) * s, w); break;
    case Q4_K: k32(row + block_bytes(Q4_K) * (s / 8), (int)(s % 8), 0, k, w); break;
    case Q5_K: k32(row + block_bytes(Q5_K) * (s / 8), (int)(s % 8), 1, k, w); break;
    case Q6_K: q6_k32(row + block_bytes(Q6_K) * (s / 8), (int)(s % 8), k, w); break;
    }
}

/* Applies MACRO(type) for each type decode32 reads, as the cases of a switch on a runtime type: each
 * expansion compiles its own copy of the caller's loop for that type. */
#define FOR_EACH_TYPE(MACRO)                                                                                  \
    MACRO(F32) MACRO(F16) MACRO(BF16) MACRO(Q4_0) MACRO(Q4_1) MACRO(Q5_0) MACRO(Q5_1) MACRO(Q8_0) MACRO(Q4_K) \
        MACRO(Q5_K) MACRO(Q6_K)

#endif
