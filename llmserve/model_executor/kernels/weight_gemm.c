/* y = x @ W.T for fp32 rows against a weight kept in its stored format (GGUF blocks, fp16, bf16, fp32),
 * at any number of rows, for CPUs.
 *
 * The weight is never widened whole: each thread takes groups of NB output rows, widens one group into
 * a scratch buffer that stays in its cache (dequant.c; fp32 rows are read in place) and multiplies it
 * with every row of x in tiles of MR x NB dot products. A single row reads the weight's stored bytes
 * once, so a decode step streams 4.5-8.5 bits a weight, not 32; for many rows the widening is
 * amortised over a chunk of x sized to stay in cache (CHUNK_BYTES), and the tiles keep the FMA units
 * busy.
 *
 * Every y[r, o] is the same computation whatever the batch: VL lanes of fused multiply-add chains over
 * k in order, summed in one fixed tree, then the tail of k, then the bias. A row's result depends on
 * neither its batch, nor its tile, nor the number of threads.
 *
 * The vector width is the build's (see native.py): 16 floats on AVX-512, 8 on AVX2, 4 elsewhere; MR and
 * NB are chosen so that the MR * NB accumulators, MR rows of x and one row of W fill the registers.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VL 16
#define MR 4
#define NB 6
#elif defined(__AVX__)
#define VL 8
#define MR 3
#define NB 4
#else
#define VL 4
#define MR 3
#define NB 4
#endif
#define CHUNK_BYTES (256 << 10) /* of x per pass over the weight: well inside a core's L2 cache */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
#define INLINE static inline __attribute__((always_inline))

INLINE vf vload(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE float vsum(vf v)
{
    float t[VL];
    memcpy(t, &v, sizeof t);
    for (int width = VL / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++)
            t[i] += t[i + width];
    return t[0];
}

/* out[r][j] = x[r] . w[j] for r < rows, j < cols; constants after inlining for full tiles. */
INLINE void tile(const float *x, int64_t k, int rows, const float *const *w, int cols, float out[MR][NB])
{
    vf acc[MR][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            acc[r][j] = (vf){0};
    int64_t kk = 0;
    for (; kk + VL <= k; kk += VL) {
        vf a[MR];
        for (int r = 0; r < rows; r++)
            a[r] = vload(x + r * k + kk);
        for (int j = 0; j < cols; j++) {
            const vf b = vload(w[j] + kk);
            for (int r = 0; r < rows; r++)
                acc[r][j] += a[r] * b;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            float s = vsum(acc[r][j]);
            for (int64_t t = kk; t < k; t++)
                s += x[r * k + t] * w[j][t];
            out[r][j] = s;
        }
}

static void tile_full(const float *x, int64_t k, int rows, const float *const *w, float out[MR][NB])
{
    switch (rows) {
#if MR >= 4
    case 4: tile(x, k, 4, w, NB, out); break;
#endif
    case 3: tile(x, k, 3, w, NB, out); break;
    case 2: tile(x, k, 2, w, NB, out); break;
    default: tile(x, k, 1, w, NB, out); break;
    }
}

static void tile_any(const float *x, int64_t k, int rows, const float *const *w, int cols, float out[MR][NB])
{
    tile(x, k, rows, w, cols, out);
}

/* The fp32 rows [row0, row0 + cols) of one part: in place for fp32, else widened into scratch. */
static void group_rows(const WeightPart *p, int64_t row0, int cols, int64_t k, float *scratch,
                       const float *rows[NB])
{
    const int64_t bytes = row_bytes((int)p->qtype, k);
    for (int j = 0; j < cols; j++) {
        const uint8_t *src = p->data + (row0 + j) * bytes;
        if (p->qtype == F32) {
            rows[j] = (const float *)src;
        } else {
            dequantize_row((int)p->qtype, src, k, scratch + j * k);
            rows[j] = scratch + j * k;
        }
    }
}

/* One group of W's rows (columns col0.. of y) times x's rows [0, m). */
static void group_product(const float *x, int64_t m, int64_t k, const float *const *w, int cols, int64_t col0,
                          const float *bias, float *y, int64_t n, int accumulate)
{
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        const int rows = m - r0 < MR ? (int)(m - r0) : MR;
        float out[MR][NB];
        if (cols == NB)
            tile_full(x + r0 * k, k, rows, w, out);
        else
            tile_any(x + r0 * k, k, rows, w, cols, out);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < cols; j++) {
                float *at = y + (r0 + r) * n + col0 + j;
                const float v = out[r][j] + (bias ? bias[col0 + j] : 0.0f);
                *at = accumulate ? *at + v : v;
            }
    }
}

/* This thread's scratch for one group of widened rows, kept between calls. */
static float *scratch_for(int64_t k)
{
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (capacity < NB * k) {
        free(buffer);
        buffer = malloc(sizeof(float) * NB * k);
        capacity = buffer ? NB * k : 0;
    }
    return buffer;
}

void weight_gemm_share(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int accumulate)
{
    int64_t n = 0, groups = 0;
    for (int64_t p = 0; p < w->num_parts; p++) {
        n += w->parts[p].rows;
        groups += (w->parts[p].rows + NB - 1) / NB;
    }
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    float *scratch = scratch_for(k);
    if (scratch == NULL)
        abort(); /* a few hundred KB; the caller's own buffers are far larger */
    int64_t chunk = CHUNK_BYTES / (int64_t)sizeof(float) / k / MR * MR;
    chunk = chunk < MR ? MR : chunk;
    for (int64_t i0 = 0; i0 < m; i0 += chunk) {
        const int64_t rows = m - i0 < chunk ? m - i0 : chunk;
        int64_t g = 0, col0 = 0;
        for (int64_t p = 0; p < w->num_parts; p++) {
            const WeightPart *part = &w->parts[p];
            for (int64_t row0 = 0; row0 < part->rows; row0 += NB, g++) {
                if (g < g0 || g >= g1)
                    continue;
                const int cols = part->rows - row0 < NB ? (int)(part->rows - row0) : NB;
                const float *wrows[NB];
                group_rows(part, row0, cols, k, scratch, wrows);
                group_product(x + i0 * k, rows, k, wrows, cols, col0 + row0, w->bias, y + i0 * n, n, accumulate);
            }
            col0 += part->rows;
        }
    }
}

/* y [m, n] = x [m, k] @ W.T (+ bias). Returns 0, or -1 for a part of a type or width we do not read. */
int weight_gemm(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int num_threads)
{
    if (w->num_parts < 1 || w->num_parts > MAX_WEIGHT_PARTS)
        return -1;
    for (int64_t p = 0; p < w->num_parts; p++)
        if (row_bytes((int)w->parts[p].qtype, k) == 0)
            return -1;
#pragma omp parallel num_threads(num_threads)
    weight_gemm_share(x, m, k, w, y, 0);
    return 0;
}
