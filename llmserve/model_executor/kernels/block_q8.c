/* y = x @ W.T for a few rows of x rounded to int8 per block of 32, against a weight's GGUF blocks of any
 * type we read, as llama.cpp computes them: `--quantization gguf` keeps a GGUF's blocks and multiplies
 * them so; `int8|int4` first round the weights into Q8_0/Q4_1 blocks at load.
 *
 * Rounded to int8, 32 activations meet 32 weights in two integer multiply-adds instead of 32 widened
 * floats; with AVX-512 VNNI in one (Q6_K: two and a subtract), whose sums equal the two's: x lies in
 * [-127, 127], so no pair of products reaches the int16 bound. Decode steps of up to `block_rows` rows
 * take this path (decoder_step.c); larger batches round their activations the same way (`round_rows`)
 * before weight_gemm.c, so that outputs do not depend on the batch size. The default keeps fp32
 * activations (weight_gemm.c at every size).
 *
 * A row block: scale s = max |x| / 127, q = round-half-even(x / s) (as x * (1 / s)), and s * sum(q) for
 * the terms of the weights' minimums and centres. The weights' layouts are dequant.h's.
 */
#pragma GCC optimize("fp-contract=off") /* dequant.h's scales; the products' FMAs are explicit */

#include <omp.h>
#include <stdlib.h>
#include <stdint.h>

#include "block_chunks.h"

/* A block's int8 scale, max|x| / 127, and the factor that rounds to it (0 for an all-zero block). */
static inline float block_scale(const float *xb, float *inverse)
{
#ifdef USE_AVX2
    /* eight lanes of the same maximum (exact in any order; a NaN never wins, as below) */
    __m256 lanes = _mm256_setzero_ps();
    for (int j = 0; j < QK; j += 8)
        lanes = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + j)), lanes);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(xb[j]);
        amax = a > amax ? a : amax; /* a max instruction; fmaxf, which must order NaNs, is a libm call */
    }
#endif
    const float s = amax / 127.0f;
    *inverse = s != 0.0f ? 1.0f / s : 0.0f;
    return s;
}

void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *q, float *scales, float *sums)
{
    for (int64_t blk = 0; blk < rows * in / QK; blk++) {
        const float *xb = x + blk * QK;
        float inv;
        const float s = block_scale(xb, &inv);
        int sum = 0;
#ifdef USE_AVX2
        /* cvtps rounds half to even, as nearbyintf does in the default rounding mode; |x * inv| <= 127 */
        __m256i r[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(inv)));
            total = _mm256_add_epi32(total, r[i]);
        }
        const __m256i low = _mm256_packs_epi32(r[0], r[1]), high = _mm256_packs_epi32(r[2], r[3]);
        /* the packs interleave 128-bit halves; the permute puts the 32 bytes back in order */
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + blk * QK), bytes);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_srli_si128(t, 8));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_srli_si128(t, 4)));
#else
        for (int j = 0; j < QK; j++) {
            q[blk * QK + j] = (int8_t)nearbyintf(xb[j] * inv);
            sum += q[blk * QK + j];
        }
#endif
        scales[blk] = s;
        sums[blk] = s * (float)sum;
    }
}

void round_rows(const float *x, int64_t rows, int64_t in, float *out)
{
    for (int64_t blk = 0; blk < rows * in / QK; blk++) {
        const float *xb = x + blk * QK;
        float inv;
        const float s = block_scale(xb, &inv);
#ifdef USE_AVX2
        for (int j = 0; j < QK; j += 8) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j), _mm256_set1_ps(inv)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_storeu_ps(out + blk * QK + j, _mm256_mul_ps(r, _mm256_set1_ps(s)));
        }
#else
        for (int j = 0; j < QK; j++)
            out[blk * QK + j] = nearbyintf(xb[j] * inv) * s;
#endif
    }
}

#ifdef USE_AVX2
/* The eight int32 sums of four products each of the chunk's values v with x's 32 int8 (lanes 0-3: the
 * first 16): one unsigned-by-signed multiply-add, the signs of signed v moved onto x. */
INLINE __m256i chunk_dot(int qtype, __m256i v, const int8_t *q)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
    if (is_signed(qtype)) {
        x = _mm256_sign_epi8(x, v);
        v = _mm256_sign_epi8(v, v);
    }
#ifdef USE_AVX512_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), _mm256_set1_epi16(1));
#endif
}

#ifdef USE_AVX512
/* Chunks i and i + 1 (i even) of the group of 8 that starts at `group` (a K type's super-block) as one
 * vector: i in the low half. With VNNI, Q6_K's come unsigned (0-63; pair_dot takes the centre off). */
INLINE __m512i pair_values(int qtype, const uint8_t *group, int i)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    if (qtype == Q8_0) {
        const uint8_t *block = group + bytes32(Q8_0) * i;
        const __m256i first = _mm256_loadu_si256((const __m256i *)(block + 2));
        return _mm512_inserti64x4(_mm512_castsi256_si512(first),
                                  _mm256_loadu_si256((const __m256i *)(block + bytes32(Q8_0) + 2)), 1);
    }
    if (!is_k_type(qtype)) {
        const int with_min = qtype == Q4_1 || qtype == Q5_1, with_high = qtype == Q5_0 || qtype == Q5_1;
        const uint8_t *first = group + bytes32(qtype) * i, *second = first + bytes32(qtype);
        const int64_t qs = 2 + 2 * with_min + 4 * with_high;
        const __m128i a = _mm_loadu_si128((const __m128i *)(first + qs));
        const __m128i b = _mm_loadu_si128((const __m128i *)(second + qs));
        const __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(a, a)), _mm256_set_m128i(b, b), 1);
        /* the second 16 bytes of each block take the high nibbles */
        __m512i v = _mm512_and_si512(_mm512_mask_srli_epi16(bytes, 0xff00ff00u, bytes, 4), low4);
        if (with_high) {
            uint32_t qh[2];
            memcpy(&qh[0], first + 2 + 2 * with_min, 4);
            memcpy(&qh[1], second + 2 + 2 * with_min, 4);
            v = _mm512_mask_add_epi8(v, _cvtu64_mask64(qh[0] | (uint64_t)qh[1] << 32), v, _mm512_set1_epi8(16));
        }
        return v;
    }
    const uint8_t *block = group;
    if (qtype == Q6_K) {
        const int h = i / 4, t = i % 4;
        const __m512i low = _mm512_loadu_si512((const void *)(block + 64 * h));
        const __m512i nibble = _mm512_and_si512(t / 2 ? _mm512_srli_epi16(low, 4) : low, low4);
        const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        const __m512i top = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t))),
                                               _mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t + 2)), 1);
        const __m512i v = _mm512_or_si512(nibble, _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(3)), 4));
#ifdef USE_AVX512_VNNI
        return v; /* pair_dot takes the centre off */
#else
        return _mm512_sub_epi8(v, _mm512_set1_epi8(32));
#endif
    }
    const int with_high = qtype == Q5_K;
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * with_high + 32 * (i / 2)));
    __m512i v = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1), low4);
    if (with_high) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(i))),
                                                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(i + 1)), 1);
        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(bits, _mm512_set1_epi8(1)), 4));
    }
    return v;
}

/* chunk_dot for two chunks: sixteen int32 sums of four products, lanes 0-7 the first chunk's. */
INLINE __m512i pair_dot(int qtype, __m512i v, const int8_t *q)
{
    __m512i x = _mm512_loadu_si512((const void *)q);
#ifdef USE_AVX512_VNNI
    if (qtype == Q6_K) { /* v unsigned, 0-63: its centre 32 comes off as 32 times x's sums, in integers */
        const __m512i centre = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(32), x);
        return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v, x), centre);
    }
#endif
    if (is_signed(qtype)) {
        x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v), _mm512_setzero_si512(), x);
        v = _mm512_abs_epi8(v);
    }
#ifdef USE_AVX512_VNNI
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(v, x), _mm512_set1_epi16(1));
#endif
}
#endif

/* p[0 : n] (n <= 8), zeros past n. */
INLINE __m256 load_first(const float *p, int n)
{
    if (n == 8)
        return _mm256_loadu_ps(p);
#ifdef USE_AVX512
    return _mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), p);
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
#endif
}

/* The weight scales of chunks s .. s + n - 1 (n <= 8; a K type's: its super-block, n = 8) in registers:
 * per chunk in *w8, or for Q6_K per 16 weights in w16[0] (chunks 0-3) and w16[1]; and their offsets in
 * *offsets (zero for the signed types and past n). */
INLINE void group_scales(int qtype, const uint8_t *row, int64_t s, int n, __m256 *w8, __m256 w16[2], __m256 *offsets)
{
    if (qtype == Q6_K) {
        const uint8_t *block = row + block_bytes(Q6_K) * (s / 8);
        const __m128i sc = _mm_loadu_si128((const __m128i *)(block + 192));
        const __m256 d = _mm256_set1_ps(read_half(block + 208));
        w16[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        w16[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))));
        *offsets = _mm256_setzero_ps();
        return;
    }
    if (is_k_type(qtype)) {
        KScales k;
        k_scales(qtype, row + block_bytes(qtype) * (s / 8), &k);
        *w8 = _mm256_loadu_ps(k.d); /* stored as one vector */
        *offsets = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(k.m));
        return;
    }
    const int with_min = qtype == Q4_1 || qtype == Q5_1;
    __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
    /* Written out per lane: _mm_insert_epi16 needs a constant lane, which a loop gives only once the
     * optimiser has unrolled it (not at -O1, as the sanitizer builds compile). */
#define SCALE_LANE(i)                                                   \
    if (i < n) {                                                        \
        uint16_t h[2];                                                  \
        memcpy(h, row + bytes32(qtype) * (s + i), 4);                   \
        d = _mm_insert_epi16(d, h[0], i);                               \
        if (with_min)                                                   \
            m = _mm_insert_epi16(m, h[1], i);                           \
    }
    SCALE_LANE(0) SCALE_LANE(1) SCALE_LANE(2) SCALE_LANE(3) SCALE_LANE(4) SCALE_LANE(5) SCALE_LANE(6)
    SCALE_LANE(7)
#undef SCALE_LANE
    *w8 = _mm256_cvtph_ps(d);
    const float centre = qtype == Q4_0 ? -8.0f : qtype == Q5_0 ? -16.0f : 0.0f;
    *offsets = with_min ? _mm256_cvtph_ps(m) : _mm256_mul_ps(_mm256_set1_ps(centre), *w8);
}

/* Asks for the `bytes` at `at` + PREFETCH_AHEAD, into L2. A weight's rows are one run of memory, but the
 * hardware prefetchers lose the stream in some layouts, reading from DRAM at a fraction of the rate the
 * same rows go at from L2; 8 KiB ahead brings most of it back. Into L2, not L1: a long row's int8 x (14
 * KiB at 14336 inputs, with its scales 18) and 8 KiB of weights in flight do not fit beside each other in
 * a 32 KiB L1 (docs/performance/kernel-measurements.md has the rates). */
#define PREFETCH_AHEAD 8192
INLINE void prefetch_ahead(const uint8_t *at, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(at + PREFETCH_AHEAD + b, 0, 2);
}

#define GROUP_ROWS 4 /* rows of x per pass over a weight row */

/* acc[r] = x[r0 + r] . row for R (1 to GROUP_ROWS, a constant after inlining) rows of x, 8 chunks (a K
 * type's super-block) at a time: their weight scales times x's in one vector per row, the offsets' terms
 * in one multiply-add, each chunk (AVX-512: each pair) decoded once for the R rows. With fewer rows,
 * successive chunks go to up to 4 accumulators per row, so that the multiply-adds do not wait on each
 * other. Everything stays in registers. */
INLINE void dot_group(const BlockInput *in, const uint8_t *row, int qtype, int R, int64_t r0, float *acc)
{
    const int A = R == 1 ? 4 : R == 2 ? 2 : 1;
    const int64_t chunks = in->in / QK;
    const int8_t *q = in->q + r0 * in->in;
    const float *x_scales = in->scales + r0 * chunks, *x_sums = in->sums + r0 * chunks;
#ifdef USE_AVX512
#define WIDE 1
    __m512 vacc[GROUP_ROWS][4];
#else
    __m256 vacc[GROUP_ROWS][4];
#endif
    __m256 offsets_acc[GROUP_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        offsets_acc[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int a = 0; a < A; a++)
            vacc[r][a] = (__typeof__(vacc[r][a])){0};
    }
    for (int64_t s = 0; s < chunks; s += 8) {
        /* below 8 only for a legacy type's last */
        const int n = is_k_type(qtype) || chunks - s >= 8 ? 8 : (int)(chunks - s);
        const uint8_t *group = chunk_group(qtype, row, s);
        if (r0 == 0) /* once per weight row, whatever the rows of x */
            prefetch_ahead(group, is_k_type(qtype) ? block_bytes(qtype) : 8 * bytes32(qtype));
        __m256 w8 = _mm256_setzero_ps(), w16[2] = {w8, w8}, offsets;
        group_scales(qtype, row, s, n, &w8, w16, &offsets);
        __m256 scales[GROUP_ROWS][2]; /* times x's: per chunk in [0], or Q6_K's per 16 weights */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 x8 = load_first(x_scales + r * chunks + s, n);
            if (qtype == Q6_K) {
                const __m256i low = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), high = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
                scales[r][0] = _mm256_mul_ps(w16[0], _mm256_permutevar8x32_ps(x8, low));
                scales[r][1] = _mm256_mul_ps(w16[1], _mm256_permutevar8x32_ps(x8, high));
            } else {
                scales[r][0] = _mm256_mul_ps(w8, x8);
            }
            if (!is_signed(qtype))
                offsets_acc[r] = _mm256_fmadd_ps(offsets, load_first(x_sums + r * chunks + s, n), offsets_acc[r]);
        }
#ifdef WIDE
        /* pairs of chunks in 512-bit vectors; a last odd chunk (legacy types) alone */
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            if (2 * p + 1 >= n)
                break;
            const __m512i v = pair_values(qtype, group, 2 * p);
            const int u = qtype == Q6_K ? 4 * (p % 2) : 0; /* Q6_K: the first unit of 16 in scales[r][p / 2] */
            const __m512i lanes = qtype == Q6_K
                ? _mm512_setr_epi32(u, u, u, u, u + 1, u + 1, u + 1, u + 1, u + 2, u + 2, u + 2, u + 2, u + 3, u + 3, u + 3, u + 3)
                : _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1,
                                    2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i dot = pair_dot(qtype, v, q + r * in->in + QK * (s + 2 * p));
                const __m256 from = scales[r][qtype == Q6_K ? p / 2 : 0];
                const __m512 scale = _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(from));
                vacc[r][p % A] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, vacc[r][p % A]);
            }
        }
        if (n % 2) { /* a legacy type's: one scale per chunk */
            const int i = n - 1;
            const __m256i v = chunk_values(qtype, group, i);
            for (int r = 0; r < R; r++) {
                const __m256i dot = chunk_dot(qtype, v, q + r * in->in + QK * (s + i));
                const __m256 scale = _mm256_permutevar8x32_ps(scales[r][0], _mm256_set1_epi32(i));
                const __m512 product = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale));
                vacc[r][0] = _mm512_add_ps(vacc[r][0], _mm512_insertf32x8(product, _mm256_setzero_ps(), 1));
            }
        }
#else
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            if (i >= n)
                break;
            const __m256i v = chunk_values(qtype, group, i);
            const int u = 2 * (i % 4);
            const __m256i lanes = qtype == Q6_K ? _mm256_setr_epi32(u, u, u, u, u + 1, u + 1, u + 1, u + 1)
                                                : _mm256_set1_epi32(i);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i dot = chunk_dot(qtype, v, q + r * in->in + QK * (s + i));
                const __m256 scale = _mm256_permutevar8x32_ps(scales[r][qtype == Q6_K ? i / 4 : 0], lanes);
                vacc[r][i % A] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, vacc[r][i % A]);
            }
        }
#endif
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int a = 1; a < A; a++)
            vacc[r][0] += vacc[r][a];
#ifdef WIDE
        const __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(vacc[r][0]), _mm512_extractf32x8_ps(vacc[r][0], 1));
#else
        const __m256 sum = vacc[r][0];
#endif
        acc[r] = hsum(_mm256_add_ps(sum, offsets_acc[r]));
    }
#undef WIDE
}

INLINE void dot_rows(const BlockInput *in, const uint8_t *row, int qtype, int64_t rows, float *acc)
{
    int64_t r0 = 0;
    for (; r0 + GROUP_ROWS <= rows; r0 += GROUP_ROWS)
        dot_group(in, row, qtype, GROUP_ROWS, r0, acc + r0);
    switch (rows - r0) {
    case 1: dot_group(in, row, qtype, 1, r0, acc + r0); break;
    case 2: dot_group(in, row, qtype, 2, r0, acc + r0); break;
    case 3: dot_group(in, row, qtype, 3, r0, acc + r0); break;
    }
}
#else
static void dot_rows(const BlockInput *in, const uint8_t *row, int qtype, int64_t rows, float *acc)
{
    const int64_t chunks = in->in / QK;
    for (int64_t r = 0; r < rows; r++)
        acc[r] = 0.0f;
    KScales k;
    for (int64_t s = 0; s < chunks; s++) {
        if (is_k_type(qtype) && s % 8 == 0)
            k_scales(qtype, row + block_bytes(qtype) * (s / 8), &k);
        const Chunk c = chunk_scales(qtype, row, s, &k);
        int8_t v[32];
        chunk_values(qtype, chunk_group(qtype, row, s), (int)(s % 8), v);
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *q = in->q + r * in->in + QK * s;
            int dot[2] = {0, 0};
            for (int j = 0; j < 32; j++)
                dot[j / 16] += v[j] * q[j];
            const float x_scale = in->scales[r * chunks + s];
            acc[r] += x_scale * (c.scale[0] * (float)dot[0] + c.scale[1] * (float)dot[1]) +
                      c.offset * in->sums[r * chunks + s];
        }
    }
}
#endif

int is_block_type(int qtype)
{
    switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return 1;
    default: return 0;
    }
}

/* One type's copy of dot_rows. */
#define DOT_CASE(T)                            \
    case T: dot_rows(in, w, T, in->rows, acc); break;

void q8_dot_rows(const BlockInput *in, const uint8_t *w, int qtype, float *acc)
{
    switch (qtype) {
        DOT_CASE(Q4_0) DOT_CASE(Q4_1) DOT_CASE(Q5_0) DOT_CASE(Q5_1) DOT_CASE(Q8_0) DOT_CASE(Q4_K)
        DOT_CASE(Q5_K) DOT_CASE(Q6_K)
    }
}

const uint8_t *block_row(const Weight *w, int64_t o, int64_t in, int *qtype)
{
    int64_t p = 0;
    while (o >= w->parts[p].rows)
        o -= w->parts[p++].rows;
    *qtype = (int)w->parts[p].qtype;
    return w->parts[p].data + o * row_bytes(*qtype, in);
}

void prepare_input(BlockInput *in, int8_t *q, float *scales, float *sums)
{
    in->q = q;
    in->scales = scales;
    in->sums = sums;
    quantize_rows(in->x, in->rows, in->in, q, scales, sums);
}

int reads_blocks(const Weight *w, int64_t in)
{
    for (int64_t p = 0; p < w->num_parts; p++)
        if (!is_block_type((int)w->parts[p].qtype) || row_bytes((int)w->parts[p].qtype, in) == 0)
            return 0;
    return w->num_parts > 0;
}

int64_t share_rows(const Weight *w, int64_t in, int64_t per_output, int64_t out, int threads)
{
    const int64_t bytes = per_output * row_bytes((int)w->parts[0].qtype, in);
    const int64_t rows = bytes > 0 ? (SHARE_BYTES + bytes - 1) / bytes : 1, each = (out + threads - 1) / threads;
    return rows < each ? rows : each > 0 ? each : 1;
}

/* x: [rows, in] fp32 (rows <= BLOCK_GEMV_MAX_ROWS), rounded here; W: [out, in] in GGUF blocks; y [rows,
 * out] = x @ W.T + bias. Returns KERNEL_OK, KERNEL_UNSUPPORTED for a type or shape it cannot take, or
 * KERNEL_NO_MEMORY. */
int block_gemv(const float *x, int64_t rows, int64_t in, const Weight *w, int64_t out, float *y, int num_threads)
{
    if (rows < 1 || rows > BLOCK_GEMV_MAX_ROWS || in % QK != 0 || !reads_blocks(w, in))
        return KERNEL_UNSUPPORTED;
    const int64_t nblocks = rows * in / QK;
    float *scales = malloc(sizeof(float) * nblocks * 2);
    int8_t *q = malloc((size_t)(rows * in));
    BlockInput input = {.x = x, .rows = rows, .in = in};
    const int status = scales == NULL || q == NULL ? KERNEL_NO_MEMORY : KERNEL_OK;
    if (status == KERNEL_OK) {
        prepare_input(&input, q, scales, scales + nblocks);
        const int64_t chunk = share_rows(w, in, 1, out, num_threads);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
        for (int64_t o = 0; o < out; o++) {
            float acc[BLOCK_GEMV_MAX_ROWS];
            int qtype;
            const uint8_t *row = block_row(w, o, in, &qtype);
            q8_dot_rows(&input, row, qtype, acc);
            for (int64_t r = 0; r < rows; r++)
                y[r * out + o] = acc[r] + (w->bias ? w->bias[o] : 0.0f);
        }
    }
    free(scales);
    free(q);
    return status;
}
