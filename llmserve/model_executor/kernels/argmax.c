/* The index of each row's largest value, as torch.argmax(dim=-1) gives it: the first of equal maxima,
 * and the first NaN where a row has one (NaN counts as the largest).
 *
 * PyTorch's CPU argmax compares one value at a time: 12 ms for a step's 64 rows of Gemma 3's 262,144
 * logits, where reading them takes 2.5. Here each vector lane keeps its own maximum and index (strictly
 * greater: the lane's first), and the lanes' winners are compared last, the smaller index on a tie.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "kernels.h"

static int64_t argmax_scalar(const float *x, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n && !isnan(x[best]); i++)
        if (x[i] > x[best] || isnan(x[i]))
            best = i;
    return best;
}

#ifdef USE_AVX2 /* the AVX2 and AVX-512 builds */
/* The winner of `lanes` lanes' maxima and indices, then of x[i..n); -1 at a NaN. */
static int64_t finish(const float *values, const int32_t *indices, int lanes, const float *x, int64_t i,
                      int64_t n)
{
    int64_t winner = indices[0];
    float top = values[0];
    for (int k = 1; k < lanes; k++)
        if (values[k] > top || (values[k] == top && indices[k] < winner)) {
            top = values[k];
            winner = indices[k];
        }
    for (; i < n; i++) {
        if (isnan(x[i]))
            return -1;
        if (x[i] > top) {
            top = x[i];
            winner = i;
        }
    }
    return winner;
}
#endif

#ifdef USE_AVX512
#define LANES 16
/* The row's argmax, or -1 if it holds a NaN (argmax_scalar then finds the first); n >= LANES. */
static int64_t argmax_vector(const float *x, int64_t n)
{
    __m512 best = _mm512_loadu_ps(x);
    __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), at = index;
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = LANES;
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(LANES));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, greater, v);
        index = _mm512_mask_mov_epi32(index, greater, at);
    }
    float values[LANES];
    int32_t indices[LANES];
    _mm512_storeu_ps(values, best);
    _mm512_storeu_si512((void *)indices, index);
    return nan ? -1 : finish(values, indices, LANES, x, i, n);
}
#elif defined(USE_AVX2)
#define LANES 8
static int64_t argmax_vector(const float *x, int64_t n)
{
    __m256 best = _mm256_loadu_ps(x);
    __m256i index = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), at = index;
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    int64_t i = LANES;
    for (; i + LANES <= n; i += LANES) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        at = _mm256_add_epi32(at, _mm256_set1_epi32(LANES));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, greater);
        index = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(at), greater));
    }
    float values[LANES];
    int32_t indices[LANES];
    _mm256_storeu_ps(values, best);
    _mm256_storeu_si256((__m256i *)indices, index);
    return _mm256_movemask_ps(nan) ? -1 : finish(values, indices, LANES, x, i, n);
}
#else
#define LANES 1
static int64_t argmax_vector(const float *x, int64_t n)
{
    (void)x, (void)n;
    return -1;
}
#endif

/* out[r] = the argmax of x's row r, x: [rows, n], 1 <= n < 2^31; rows split between the threads. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        const int64_t found = n >= LANES ? argmax_vector(row, n) : -1;
        out[r] = found >= 0 ? found : argmax_scalar(row, n);
    }
}
