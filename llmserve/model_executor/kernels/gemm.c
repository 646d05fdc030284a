/* y = x @ W.T for fp32 rows against a weight packed once, for CPUs.
 *
 * The projections of a batched decode step (9 to ~128 rows) and of prefill. oneDNN reached about half
 * of this machine's FMA peak at 16-64 rows (its per-call blocking is made for larger products); this
 * computes a 6 x 16 tile of y in twelve AVX2 registers while one panel of 16 weight rows streams past,
 * and prefetches the next panel during the panel's first tile, so the weights of a decode step arrive
 * from memory while the previous panel is being used.
 *
 * Every y[r, o] is one fused multiply-add chain over k in order, whatever the number of rows, the
 * tile a row lands in and the number of threads: a row's result does not depend on its batch.
 *
 * Packed weight: panels of GEMM_PANEL output rows, [ceil(n / 16)][k][16], the last zero-padded.
 */
#include <omp.h>
#include <stdint.h>

#include "kernels.h"

#define MR 6          /* rows of x per tile */
#define NR GEMM_PANEL /* outputs per tile */
#define MC 96         /* rows of x per pass over the panels: 96 x k fp32 stay in the L2 cache */

void pack_weight(const float *w, int64_t n, int64_t k, float *packed)
{
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t o = p * NR + j;
                packed[(p * k + kk) * NR + j] = o < n ? w[o * k + kk] : 0.0f;
            }
}

/* y[r, j] = t[r][j] (+ bias[j]) (+ y[r, j]) for the tile's valid rows and columns. */
static inline void store_tile(float t[MR][NR], int rows, int64_t cols, const float *bias, int accumulate,
                              float *y, int64_t ldy)
{
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++)
            y[r * ldy + j] = t[r][j] + (bias ? bias[j] : 0.0f) + (accumulate ? y[r * ldy + j] : 0.0f);
}

#ifdef USE_AVX2
#define INLINE static inline __attribute__((always_inline))

/* `rows` (<= MR, a constant after inlining) rows of x times one panel b. */
INLINE void tile(const float *x, int64_t k, const float *b, const float *next, int rows, int64_t cols,
                 const float *bias, int accumulate, float *y, int64_t ldy)
{
    __m256 acc[MR][2];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 b0 = _mm256_loadu_ps(b + kk * NR), b1 = _mm256_loadu_ps(b + kk * NR + 8);
        if (next != NULL)
            _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T0);
        _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++)
        {
            const __m256 a = _mm256_broadcast_ss(x + r * k + kk);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    float t[MR][NR];
    _Pragma("GCC unroll 6") for (int r = 0; r < rows; r++)
    {
        _mm256_storeu_ps(t[r], acc[r][0]);
        _mm256_storeu_ps(t[r] + 8, acc[r][1]);
    }
    store_tile(t, rows, cols, bias, accumulate, y, ldy);
}

/* Every tile of one panel down `rows` rows of x; the first prefetches the next panel. */
static void panel_tiles(const float *x, int64_t rows, int64_t k, const float *b, const float *next,
                        int64_t cols, const float *bias, int accumulate, float *y, int64_t ldy)
{
    int64_t r = 0;
    for (; r + MR <= rows; r += MR, next = NULL)
        tile(x + r * k, k, b, next, MR, cols, bias, accumulate, y + r * ldy, ldy);
    const float *at = x + r * k;
    float *out = y + r * ldy;
    switch (rows - r) {
    case 1: tile(at, k, b, next, 1, cols, bias, accumulate, out, ldy); break;
    case 2: tile(at, k, b, next, 2, cols, bias, accumulate, out, ldy); break;
    case 3: tile(at, k, b, next, 3, cols, bias, accumulate, out, ldy); break;
    case 4: tile(at, k, b, next, 4, cols, bias, accumulate, out, ldy); break;
    case 5: tile(at, k, b, next, 5, cols, bias, accumulate, out, ldy); break;
    }
}
#else
static void panel_tiles(const float *x, int64_t rows, int64_t k, const float *b, const float *next,
                        int64_t cols, const float *bias, int accumulate, float *y, int64_t ldy)
{
    (void)next;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int n = rows - r0 < MR ? (int)(rows - r0) : MR;
        float t[MR][NR] = {{0.0f}};
        for (int r = 0; r < n; r++)
            for (int64_t kk = 0; kk < k; kk++)
                for (int j = 0; j < NR; j++)
                    t[r][j] += x[(r0 + r) * k + kk] * b[kk * NR + j];
        store_tile(t, n, cols, bias, accumulate, y + r0 * ldy, ldy);
    }
}
#endif

static void gemm_panels(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                 float *y, int64_t p0, int64_t p1, int accumulate)
{
    for (int64_t i = 0; i < m; i += MC) {
        const int64_t rows = m - i < MC ? m - i : MC;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const float *next = p + 1 < p1 ? packed + (p + 1) * k * NR : NULL;
            panel_tiles(x + i * k, rows, k, packed + p * k * NR, next, cols, bias ? bias + p * NR : NULL,
                        accumulate, y + i * n + p * NR, n);
        }
    }
}

void gemm_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                float *y, int accumulate)
{
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    gemm_panels(x, m, k, packed, n, bias, y, panels * t / threads, panels * (t + 1) / threads, accumulate);
}

void gemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *y,
          int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    gemm_share(x, m, k, packed, n, bias, y, 0);
}
