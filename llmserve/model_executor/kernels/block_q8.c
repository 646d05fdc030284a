/* y = x @ W.T for a few rows of x rounded to int8 per block of 32, against Q4_1/Q8_0 blocks, as llama.cpp
 * computes them: `--quantization int8|int4`, which round the weights into those blocks at load.
 *
 * Rounded to int8, 32 activations meet 32 weights in two integer multiply-adds instead of 32 widened
 * floats. Decode steps of up to `block_rows` rows take this path (decoder_step.c); larger batches round
 * their activations the same way (`round_rows`) before weight_gemm.c, so that outputs do not depend on
 * the batch size. The default keeps fp32 activations (weight_gemm.c at every size).
 *
 * A row block: scale s = max |x| / 127, q = round-half-even(x / s) (as x * (1 / s)), and s * sum(q) for the
 * Q4_1 minimum's term. Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j < 16 is the
 * low nibble of byte j, weight j + 16 its high nibble; d * q + m. Q8_0 block (34 bytes): fp16 d, 32 int8.
 */
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>

#include "kernels.h"

/* A block's int8 scale, max|x| / 127, and the factor that rounds to it (0 for an all-zero block). */
static inline float block_scale(const float *xb, float *inverse)
{
    float amax = 0.0f;
    for (int j = 0; j < QK; j++)
        amax = fmaxf(amax, fabsf(xb[j]));
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
        for (int j = 0; j < QK; j++) {
            q[blk * QK + j] = (int8_t)nearbyintf(xb[j] * inv);
            sum += q[blk * QK + j];
        }
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
        for (int j = 0; j < QK; j++)
            out[blk * QK + j] = nearbyintf(xb[j] * inv) * s;
    }
}

#ifdef USE_AVX2
/* The block's weights as unsigned bytes (Q4_1: 0..15; Q8_0: magnitudes, their signs in *signs), so that
 * one unsigned-by-signed multiply-add takes both types. */
static inline __attribute__((always_inline)) __m256i unpack(const uint8_t *block, int qtype, __m256i *signs)
{
    if (qtype == Q4_1) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0f));
    }
    *signs = _mm256_loadu_si256((const __m256i *)(block + 2));
    return _mm256_sign_epi8(*signs, *signs);
}

static inline __attribute__((always_inline)) __m256 int_dot(__m256i weights, __m256i signs, const int8_t *q,
                                                            int qtype)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
    if (qtype == Q8_0)
        x = _mm256_sign_epi8(x, signs);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(weights, x), _mm256_set1_epi16(1)));
}

/* One row: the decode of a single sequence, accumulators in registers. */
static inline __attribute__((always_inline)) float dot_one(const BlockInput *in, const uint8_t *w, int qtype)
{
    const int64_t stride = block_bytes(qtype), nblocks = in->in / QK;
    __m256 vacc = _mm256_setzero_ps();
    float msum = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        __m256i signs = _mm256_setzero_si256();
        const __m256i weights = unpack(block, qtype, &signs);
        const float scale = read_half(block) * in->scales[b];
        vacc = _mm256_fmadd_ps(int_dot(weights, signs, in->q + b * QK, qtype), _mm256_set1_ps(scale), vacc);
        if (qtype == Q4_1)
            msum += read_half(block + 2) * in->sums[b];
    }
    return hsum(vacc) + msum;
}

/* Blocks outer, rows inner: each block is loaded and unpacked once for all the rows. */
static inline __attribute__((always_inline)) void dot_rows(const BlockInput *in, const uint8_t *w, int qtype,
                                                           float *acc)
{
    const int64_t stride = block_bytes(qtype), nblocks = in->in / QK, rows = in->rows;
    __m256 vacc[BLOCK_GEMV_MAX_ROWS];
    float msum[BLOCK_GEMV_MAX_ROWS] = {0};
    for (int64_t r = 0; r < rows; r++)
        vacc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        const float d = read_half(block), m = qtype == Q4_1 ? read_half(block + 2) : 0.0f;
        __m256i signs = _mm256_setzero_si256();
        const __m256i weights = unpack(block, qtype, &signs);
        for (int64_t r = 0; r < rows; r++) {
            const __m256 dot = int_dot(weights, signs, in->q + r * in->in + b * QK, qtype);
            vacc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * in->scales[r * nblocks + b]), vacc[r]);
            if (qtype == Q4_1)
                msum[r] += m * in->sums[r * nblocks + b];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        acc[r] = hsum(vacc[r]) + msum[r];
}

void q8_dot_rows(const BlockInput *in, const uint8_t *w, int qtype, float *acc)
{
    if (in->rows == 1)
        acc[0] = qtype == Q4_1 ? dot_one(in, w, Q4_1) : dot_one(in, w, Q8_0);
    else if (qtype == Q4_1)
        dot_rows(in, w, Q4_1, acc);
    else
        dot_rows(in, w, Q8_0, acc);
}
#else
void q8_dot_rows(const BlockInput *in, const uint8_t *w, int qtype, float *acc)
{
    const int64_t stride = block_bytes(qtype), nblocks = in->in / QK;
    for (int64_t r = 0; r < in->rows; r++) {
        const int8_t *q = in->q + r * in->in;
        float sacc = 0.0f, msum = 0.0f;
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *block = w + b * stride;
            int dot = 0;
            for (int j = 0; j < QK; j++) {
                const int wq = qtype == Q4_1 ? (block[4 + j % 16] >> (j < 16 ? 0 : 4)) & 0x0f
                                             : (int)(int8_t)block[2 + j];
                dot += wq * q[b * QK + j];
            }
            sacc += read_half(block) * in->scales[r * nblocks + b] * (float)dot;
            if (qtype == Q4_1)
                msum += read_half(block + 2) * in->sums[r * nblocks + b];
        }
        acc[r] = sacc + msum;
    }
}
#endif

void prepare_input(BlockInput *in, int8_t *q, float *scales, float *sums)
{
    in->q = q;
    in->scales = scales;
    in->sums = sums;
    quantize_rows(in->x, in->rows, in->in, q, scales, sums);
}

/* x: [rows, in] fp32 (rows <= BLOCK_GEMV_MAX_ROWS, in a multiple of 32), rounded here; w: [out, in / 32]
 * blocks; y: [rows, out]. Returns 0, -1 for an unsupported type or shape, -2 when out of memory. */
int block_gemv(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out, int qtype, float *y,
               int num_threads)
{
    if ((qtype != Q4_1 && qtype != Q8_0) || rows < 1 || rows > BLOCK_GEMV_MAX_ROWS || in % QK != 0)
        return -1;
    const int64_t row_bytes = in / QK * block_bytes(qtype), nblocks = rows * in / QK;
    float *scales = malloc(sizeof(float) * nblocks * 2);
    int8_t *q = malloc((size_t)(rows * in));
    BlockInput input = {.x = x, .rows = rows, .in = in};
    const int status = scales == NULL || q == NULL ? -2 : 0;
    if (status == 0) {
        prepare_input(&input, q, scales, scales + nblocks);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t o = 0; o < out; o++) {
            float acc[BLOCK_GEMV_MAX_ROWS];
            q8_dot_rows(&input, w + o * row_bytes, qtype, acc);
            for (int64_t r = 0; r < rows; r++)
                y[r * out + o] = acc[r];
        }
    }
    free(scales);
    free(q);
    return status;
}
