/* y = x @ W.T for a few rows of x, with W kept in its GGUF blocks (Q4_1 or Q8_0), for CPUs.
 *
 * Decoding a few sequences is bound by the bytes of weights read per step: Q4_1 is 5 bits a weight
 * and Q8_0 8.5, against fp32's 32. Each block is widened to fp32 in registers and multiplied with
 * fp32 activations (no activation quantization, unlike llama.cpp), so the products are those of the
 * dequantized fp32 weights the rest of the engine uses; only the summation order differs.
 *
 * Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j < 16 is the low nibble of byte
 * j, weight j + 16 its high nibble; value d * q + m. Q8_0 block (34 bytes): fp16 d, 32 int8; d * q.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define USE_AVX2 1
#endif

#include "kernels.h"

#define MAX_ROWS BLOCK_GEMV_MAX_ROWS

#ifndef USE_AVX2
static float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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

int64_t block_bytes(int qtype)
{
    return qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

void block_sums(const float *x, int64_t rows, int64_t in, float *xsum)
{
    const int64_t nblocks = in / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nblocks; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++)
                s += x[r * in + b * QK + j];
            xsum[r * nblocks + b] = s;
        }
}

void block_gemv_row(const float *x, const float *xsum, int64_t rows, int64_t in, const uint8_t *w, int qtype,
                    float *acc)
{
    const int64_t stride = block_bytes(qtype);
    const int64_t nblocks = in / QK;
    float msum[MAX_ROWS] = {0};
#ifdef USE_AVX2
    /* One row keeps four FMA chains in registers (else each block waits on one chain's latency);
     * several rows are independent chains already. */
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    __m256 vacc[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++)
        vacc[r] = c0;
#else
    float sacc[MAX_ROWS] = {0};
#endif
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *block = w + b * stride;
        uint16_t dh, mh = 0;
        memcpy(&dh, block, 2);
        if (qtype == Q4_1)
            memcpy(&mh, block + 2, 2);
#ifdef USE_AVX2
        __m256 q0, q1, q2, q3;
        if (qtype == Q4_1) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4));
            const __m128i mask = _mm_set1_epi8(0x0f);
            const __m128i lo = _mm_and_si128(bytes, mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
            q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        } else {
            const __m128i a = _mm_loadu_si128((const __m128i *)(block + 2));
            const __m128i c = _mm_loadu_si128((const __m128i *)(block + 18));
            q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
            q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
            q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
            q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
        }
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
        const float m = qtype == Q4_1 ? _cvtsh_ss(mh) : 0.0f;
        q0 = _mm256_mul_ps(q0, d);
        q1 = _mm256_mul_ps(q1, d);
        q2 = _mm256_mul_ps(q2, d);
        q3 = _mm256_mul_ps(q3, d);
        if (rows == 1) {
            const float *xb = x + b * QK;
            c0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xb), c0);
            c1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), c1);
            c2 = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), c2);
            c3 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), c3);
            msum[0] += m * xsum[b];
            continue;
        }
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * in + b * QK;
            __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), t);
            vacc[r] = _mm256_add_ps(vacc[r], t);
            msum[r] += m * xsum[r * nblocks + b];
        }
#else
        float q[QK];
        unpack(block, qtype, q);
        const float d = half_to_float(dh), m = qtype == Q4_1 ? half_to_float(mh) : 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            const float *xb = x + r * in + b * QK;
            float t = 0.0f;
            for (int j = 0; j < QK; j++)
                t += q[j] * xb[j];
            sacc[r] += d * t;
            msum[r] += m * xsum[r * nblocks + b];
        }
#endif
    }
    for (int64_t r = 0; r < rows; r++) {
#ifdef USE_AVX2
        const __m256 v = rows == 1 ? _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)) : vacc[r];
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        acc[r] = _mm_cvtss_f32(s) + msum[r];
#else
        acc[r] = sacc[r] + msum[r];
#endif
    }
}

/* x: [rows, in] fp32 (rows <= MAX_ROWS, in a multiple of 32); w: [out, in / 32] blocks; y: [rows, out].
 * Returns 0, or -1 for an unsupported type or shape, -2 when out of memory. */
int block_gemv(const float *x, int64_t rows, int64_t in, const uint8_t *w, int64_t out, int qtype,
               float *y, int num_threads)
{
    if ((qtype != Q4_1 && qtype != Q8_0) || rows < 1 || rows > MAX_ROWS || in % QK != 0)
        return -1;
    const int64_t row_bytes = in / QK * block_bytes(qtype);
    float *xsum = malloc(sizeof(float) * rows * (in / QK)); /* per-block sums of x: the m terms */
    if (xsum == NULL)
        return -2;
    block_sums(x, rows, in, xsum);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t o = 0; o < out; o++) {
        float acc[MAX_ROWS];
        block_gemv_row(x, xsum, rows, in, w + o * row_bytes, qtype, acc);
        for (int64_t r = 0; r < rows; r++)
            y[r * out + o] = acc[r];
    }
    free(xsum);
    return 0;
}
