/* y = x @ W.T for a few rows of x, with W kept in its GGUF blocks (Q4_1 or Q8_0), for CPUs.
 *
 * Decoding a few sequences is bound by the bytes of weights read per step: Q4_1 is 5 bits a weight
 * and Q8_0 8.5, against fp32's 32. Each block is widened to fp32 in registers and multiplied with
 * fp32 activations (no activation quantization, unlike llama.cpp), so the products are those of the
 * dequantized fp32 weights the rest of the engine uses; only the summation order differs. With int8
 * activations (`--quantization int8|int4`) the rows go to block_q8.c instead.
 *
 * Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j < 16 is the low nibble of byte
 * j, weight j + 16 its high nibble; value d * q + m. Q8_0 block (34 bytes): fp16 d, 32 int8; d * q.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define MAX_ROWS BLOCK_GEMV_MAX_ROWS

#ifndef USE_AVX2
/* The 32 quantized values of one block, as floats (q, without d and m). */
static void unpack(const uint8_t *block, int qtype, float *q)
{
    if (qtype == Q4_1) {
        const uint8_t *qs = block + 4;
        for (int j = 0; j < 16; j++) {
            q[j] = (float)(qs[j] & 0x0f);
            q[j + 16] = (float)(qs[j] >> 4);
        }
    } else {
        const int8_t *qs = (const int8_t *)(block + 2);
        for (int j = 0; j < QK; j++)
            q[j] = (float)qs[j];
    }
}
#endif

void block_sums(const float *x, int64_t rows, int64_t in, float *sums)
{
    for (int64_t blk = 0; blk < rows * in / QK; blk++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++)
            s += x[blk * QK + j];
        sums[blk] = s;
    }
}

void prepare_input(BlockInput *in, float *sums, int8_t *q, float *scales)
{
    in->sums = sums;
    in->q = q;
    in->scales = scales;
    if (q != NULL)
        quantize_rows(in->x, in->rows, in->in, q, scales, sums);
    else
        block_sums(in->x, in->rows, in->in, sums);
}

#ifdef USE_AVX2
#define INLINE static inline __attribute__((always_inline))

/* The block's 32 quantized values as floats (q, without d and m), eight to a vector. */
INLINE void widen(const uint8_t *block, int qtype, __m256 q[4])
{
    __m128i a, c;
    if (qtype == Q4_1) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4)), mask = _mm_set1_epi8(0x0f);
        a = _mm_and_si128(bytes, mask);
        c = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(a, a)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(c, c)));
    } else {
        a = _mm_loadu_si128((const __m128i *)(block + 2));
        c = _mm_loadu_si128((const __m128i *)(block + 18));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(c, c)));
    }
}

/* q . x over one block: the scale d multiplies the block's sum once, not each weight. */
INLINE __m256 block_dot(const __m256 q[4], const float *xb)
{
    __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
    return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
}

/* One row of x against one output row of blocks: the decode of a single sequence. Two accumulators
 * alternate so that no block waits on the previous one's sum. */
INLINE float dot_one(const float *x, const float *xsum, int64_t nblocks, const uint8_t *w, int qtype)
{
    const int64_t stride = block_bytes(qtype);
    __m256 even = _mm256_setzero_ps(), odd = even;
    float msum = 0.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        __m256 q[4];
        widen(block, qtype, q);
        const __m256 t = block_dot(q, x + b * QK), d = _mm256_set1_ps(read_half(block));
        if (b & 1)
            odd = _mm256_fmadd_ps(t, d, odd);
        else
            even = _mm256_fmadd_ps(t, d, even);
        if (qtype == Q4_1)
            msum += read_half(block + 2) * xsum[b];
    }
    return hsum(_mm256_add_ps(even, odd)) + msum;
}

/* Several rows: each block is widened once for all of them. */
INLINE void dot_rows(const float *x, const float *xsum, int64_t rows, int64_t in, const uint8_t *w, int qtype,
                     float *acc)
{
    const int64_t stride = block_bytes(qtype), nblocks = in / QK;
    __m256 vacc[MAX_ROWS];
    float msum[MAX_ROWS] = {0};
    for (int64_t r = 0; r < rows; r++)
        vacc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        __m256 q[4];
        widen(block, qtype, q);
        const __m256 d = _mm256_set1_ps(read_half(block));
        const float m = qtype == Q4_1 ? read_half(block + 2) : 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            vacc[r] = _mm256_fmadd_ps(block_dot(q, x + r * in + b * QK), d, vacc[r]);
            msum[r] += m * xsum[r * nblocks + b];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        acc[r] = hsum(vacc[r]) + msum[r];
}

void block_gemv_row(const BlockInput *in, const uint8_t *w, int qtype, float *acc)
{
    const float *x = in->x, *xsum = in->sums;
    const int64_t rows = in->rows, n = in->in;
    if (in->q != NULL)
        q8_dot_rows(in, w, qtype, acc);
    else if (rows == 1)
        acc[0] = qtype == Q4_1 ? dot_one(x, xsum, n / QK, w, Q4_1) : dot_one(x, xsum, n / QK, w, Q8_0);
    else if (qtype == Q4_1)
        dot_rows(x, xsum, rows, n, w, Q4_1, acc);
    else
        dot_rows(x, xsum, rows, n, w, Q8_0, acc);
}
#else
void block_gemv_row(const BlockInput *input, const uint8_t *w, int qtype, float *acc)
{
    if (input->q != NULL) {
        q8_dot_rows(input, w, qtype, acc);
        return;
    }
    const float *x = input->x, *xsum = input->sums;
    const int64_t rows = input->rows, in = input->in, stride = block_bytes(qtype), nblocks = in / QK;
    float sacc[MAX_ROWS] = {0}, msum[MAX_ROWS] = {0};
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        float q[QK];
        unpack(block, qtype, q);
        const float d = read_half(block), m = qtype == Q4_1 ? read_half(block + 2) : 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * in + b * QK;
            float t = 0.0f;
            for (int j = 0; j < QK; j++)
                t += q[j] * xb[j];
            sacc[r] += d * t;
            msum[r] += m * xsum[r * nblocks + b];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        acc[r] = sacc[r] + msum[r];
}
#endif

/* x: [rows, in] fp32 (rows <= MAX_ROWS, in a multiple of 32); w: [out, in / 32] blocks; y: [rows, out];
 * int8_activations: round x as block_q8.c does. Returns 0, -1 for an unsupported type or shape, -2 when
 * out of memory. */
int block_gemv(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out, int qtype,
               int int8_activations, float *y, int num_threads)
{
    if ((qtype != Q4_1 && qtype != Q8_0) || rows < 1 || rows > MAX_ROWS || in % QK != 0)
        return -1;
    const int64_t row_bytes = in / QK * block_bytes(qtype), nblocks = rows * in / QK;
    float *sums = malloc(sizeof(float) * nblocks * 2);
    int8_t *q = int8_activations ? malloc((size_t)(rows * in)) : NULL;
    BlockInput input = {.x = x, .rows = rows, .in = in};
    const int status = sums == NULL || (int8_activations && q == NULL) ? -2 : 0;
    if (status == 0) {
        prepare_input(&input, sums, q, sums + nblocks);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t o = 0; o < out; o++) {
            float acc[MAX_ROWS];
            block_gemv_row(&input, w + o * row_bytes, qtype, acc);
            for (int64_t r = 0; r < rows; r++)
                y[r * out + o] = acc[r];
        }
    }
    free(sums);
    free(q);
    return status;
}
