/* y = x @ W.T for fp32 rows against a weight kept in its stored format (GGUF blocks, fp16, bf16, fp32),
 * at any number of rows, for CPUs.
 *
 * The weight is never widened whole: each thread takes groups of NB output rows and, KC columns at a
 * time, widens one group's slice into a scratch buffer that stays in cache (dequant.c; fp32 rows are
 * read in place), then multiplies it with up to MC rows of x in tiles of MR x NB dot products. A single
 * row reads the weight's stored bytes once, so a decode step streams 4.5-8.5 bits a weight, not 32; for
 * many rows the widening is amortised over MC rows.
 *
 * Up to FUSED_ROWS rows take a shorter way to the same sums: each 32 weights are widened in registers
 * and multiplied there (dequant.h), never stored and loaded back. At one row the widening can bound a
 * step before memory does: `python -m benchmarks.latency` reports the share of the read bandwidth used.
 *
 * Every y[r, o] is the same computation whatever the batch: for each slice of KC columns in order, VL
 * lanes of fused multiply-add chains, summed in one fixed tree, then the slice's tail, added to y (the
 * first slice to the bias). A row's result depends on neither its batch, nor its tile, nor the number
 * of threads.
 *
 * The vector width is the build's (see native.py): 16 floats on AVX-512, 8 on AVX2, 4 elsewhere; MR and
 * NB are chosen so that the MR * NB accumulators, MR rows of x and one row of W fill the registers.
 */
#pragma GCC optimize("fp-contract=off") /* dequant.h's exact values; the products' FMAs are explicit */

#include <omp.h>
#include <stdint.h>

#include "dequant.h"

/* KC columns per slice, MC rows of x per pass over it. Each tile pays fixed costs per slice (its
 * reductions, y's read and write, the first loads of its MR + NB streams), so on AVX-512 long slices win
 * although the widened slice (NB x KC fp32, 96 KiB) and x's (MC x KC, 2 MiB) then outgrow L1 and L2: on
 * a Zen 4 core a Q4_K [14336, 4096] weight times 512 rows went from 63-77 GFLOP/s at 1,024 x 64 to
 * 91-101 (peak 113), and [576, 1536] from 82 to 96. Measured on Zen 4 only. AVX2 builds measured no
 * clear gain; they and the portable build keep slices whose widened weight (16 KiB) stays in L1. */
#if defined(__AVX512F__)
#define VL 16
#define MR 4
#define NB 6
#define KC 4096
#define MC 128
#else
#if defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
#define MR 3
#define NB 4
#define KC 1024
#define MC 64
#endif
#define FUSED_ROWS 4 /* up to here the weights are multiplied from registers */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

/* acc + a * b, rounded once where the CPU has fused multiply-adds. */
INLINE vf vfma(vf a, vf b, vf acc)
{
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif VL == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return a * b + acc;
#endif
}

INLINE vf vload(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float f32x4 __attribute__((vector_size(16)));

/* The lanes' sum, halving the width at each step. */
INLINE float vsum(vf v)
{
#if VL == 16
    typedef float f32x8 __attribute__((vector_size(32)));
    const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif VL == 8
    const f32x4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    const f32x4 q = v;
#endif
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* out[r][j] = x[r] . w[j] over kc columns, x's rows ldx apart, for r < rows, j < cols; constants after
 * inlining for full tiles. */
INLINE void tile(const float *x, int64_t ldx, int64_t k, int rows, const float *const *w, int cols,
                 float out[MR][NB])
{
    vf acc[MR][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            acc[r][j] = (vf){0};
    int64_t kk = 0;
    for (; kk + VL <= k; kk += VL) {
        vf a[MR];
        for (int r = 0; r < rows; r++)
            a[r] = vload(x + r * ldx + kk);
        for (int j = 0; j < cols; j++) {
            const vf b = vload(w[j] + kk);
            for (int r = 0; r < rows; r++)
                acc[r][j] = vfma(a[r], b, acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            float s = vsum(acc[r][j]);
            for (int64_t t = kk; t < k; t++)
                s = fmaf(x[r * ldx + t], w[j][t], s);
            out[r][j] = s;
        }
}

static void tile_full(const float *x, int64_t ldx, int64_t k, int rows, const float *const *w,
                      float out[MR][NB])
{
    switch (rows) {
#if MR >= 4
    case 4: tile(x, ldx, k, 4, w, NB, out); break;
#endif
    case 3: tile(x, ldx, k, 3, w, NB, out); break;
    case 2: tile(x, ldx, k, 2, w, NB, out); break;
    default: tile(x, ldx, k, 1, w, NB, out); break;
    }
}

static void tile_any(const float *x, int64_t ldx, int64_t k, int rows, const float *const *w, int cols,
                     float out[MR][NB])
{
    tile(x, ldx, k, rows, w, cols, out);
}

/* Columns [k0, k0 + kc) of the fp32 rows [row0, row0 + cols) of one part, whose rows hold k weights: in
 * place for fp32, else widened into scratch. k0 is a multiple of the type's block. */
static void group_rows(const WeightPart *p, int64_t row0, int cols, int64_t k, int64_t k0, int64_t kc,
                       float *scratch, const float *rows[NB])
{
    const int qtype = (int)p->qtype;
    const int64_t bytes = row_bytes(qtype, k), skip = k0 ? row_bytes(qtype, k0) : 0;
    for (int j = 0; j < cols; j++) {
        const uint8_t *src = p->data + (row0 + j) * bytes + skip;
        if (qtype == F32) {
            rows[j] = (const float *)src;
        } else {
            dequantize_row(qtype, src, kc, scratch + j * kc);
            rows[j] = scratch + j * kc;
        }
    }
}

/* y[r, col] for r < rows from out[r]: stored, or added to y with `accumulate`; the bias added first. */
INLINE void store_column(float *y, int64_t n, int rows, int64_t col, const float *out, const float *bias,
                         int accumulate)
{
    for (int r = 0; r < rows; r++) {
        const float v = out[r] + (bias ? bias[col] : 0.0f);
        y[r * n + col] = accumulate ? y[r * n + col] + v : v;
    }
}

/* acc[r][j] += x[r][0:32] * w, lane by lane, for r < rows. */
INLINE void multiply32(const f32x16 w[2], const float *x, int64_t ldx, int rows, vf acc[FUSED_ROWS][NB], int j)
{
    /* The build's vectors cut from w's lanes in registers (a copy through memory made AVX2 builds store
     * halves and reload them whole, stalling every load). */
#if VL == 16
    const vf b[2] = {w[0], w[1]};
#elif VL == 8
    const vf b[4] = {__builtin_shufflevector(w[0], w[0], 0, 1, 2, 3, 4, 5, 6, 7),
                     __builtin_shufflevector(w[0], w[0], 8, 9, 10, 11, 12, 13, 14, 15),
                     __builtin_shufflevector(w[1], w[1], 0, 1, 2, 3, 4, 5, 6, 7),
                     __builtin_shufflevector(w[1], w[1], 8, 9, 10, 11, 12, 13, 14, 15)};
#else
    vf b[8];
    memcpy(b, w, sizeof b);
#endif
    _Pragma("GCC unroll 4") for (int p = 0; p < 32 / VL; p++)
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
            acc[r][j] = vfma(vload(x + r * ldx + VL * p), b[p], acc[r][j]);
}

/* out[r][j] = x[r] . W's row j over its 32-weight groups [s0, s1), for r < rows and j < cols (constants
 * after inlining), in the lanes and order of tile(): each 32 weights widened in registers only. The
 * cols rows' chains are independent, so the multiply-adds of one row do not wait on each other.
 *
 * The bytes `ahead` of those read (the same place in the next group's rows) are prefetched: a row of a
 * narrow weight is a few cache lines, too few for the hardware's stream prefetchers to learn before it
 * ends. One row of a [37984, 896] Q5_0 weight took 0.16 ns a weight on a Zen 4 core without, 0.08 with:
 * as fast as when it sits in the cache. They go to L2 (locality 2, prefetcht1), not L1: on two Zen 4
 * cores the product of one row with Qwen's [151936, 896] Q8_0 logits weight took 5.2 ms instead of 8.5;
 * other types ran alike. */
INLINE void fused_group(int qtype, const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1,
                        const float *x, int64_t ldx, int rows, float out[FUSED_ROWS][NB])
{
    vf acc[FUSED_ROWS][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            acc[r][j] = (vf){0};
    if (is_k_type(qtype)) /* whole super-blocks: their scales once, then sub-blocks at constant offsets */
        for (int64_t sb = s0 / 8; sb < s1 / 8; sb++) {
            _Pragma("GCC unroll 8") for (int j = 0; j < cols; j++)
                for (int l = 0; l < block_bytes(qtype); l += 64)
                    __builtin_prefetch(w[j] + ahead + block_bytes(qtype) * sb + l, 0, 2);
            KScales ks[NB];
            _Pragma("GCC unroll 8") for (int j = 0; j < cols; j++) k_scales(qtype, w[j] + block_bytes(qtype) * sb, &ks[j]);
            /* kept in memory, each scale is broadcast inside the AVX-512 instruction that uses it; kept
             * in registers, GCC spent 3-4 shuffles on extracting each (a fifth of Q4_K's instructions) */
            __asm__("" : "+m"(ks));
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++)
                _Pragma("GCC unroll 8") for (int j = 0; j < cols; j++)
                {
                    f32x16 wide[2];
                    k_decode32(qtype, w[j] + block_bytes(qtype) * sb, g, &ks[j], wide);
                    multiply32(wide, x + 32 * (8 * sb + g), ldx, rows, acc, j);
                }
        }
    else
        for (int64_t s = s0; s < s1; s++)
            _Pragma("GCC unroll 8") for (int j = 0; j < cols; j++)
            {
                __builtin_prefetch(w[j] + ahead + bytes32(qtype) * s, 0, 2);
                f32x16 wide[2];
                decode32(qtype, w[j], s, NULL, wide);
                multiply32(wide, x + 32 * s, ldx, rows, acc, j);
            }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            out[r][j] = vsum(acc[r][j]);
}

typedef void FusedGroup(const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1,
                        const float *x, int64_t ldx, int rows, float out[FUSED_ROWS][NB]);

/* fused_group for one type, its row count and a whole group (or a single row) made constants. */
#define FUSED_ROWS_CASE(T, R)                                         \
    case R:                                                           \
        if (cols == NB)                                               \
            fused_group(T, w, ahead, NB, s0, s1, x, ldx, R, out);     \
        else                                                          \
            for (int j = 0; j < cols; j++) {                          \
                float one[FUSED_ROWS][NB];                            \
                fused_group(T, w + j, ahead, 1, s0, s1, x, ldx, R, one);  \
                for (int r = 0; r < R; r++)                           \
                    out[r][j] = one[r][0];                            \
            }                                                         \
        break;
#define FUSED_FOR_TYPE(T)                                                                                  \
    static void fused_##T(const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1,       \
                          const float *x, int64_t ldx, int rows, float out[FUSED_ROWS][NB])                \
    {                                                                                                      \
        switch (rows) {                                                                                    \
            FUSED_ROWS_CASE(T, 1) FUSED_ROWS_CASE(T, 2) FUSED_ROWS_CASE(T, 3) FUSED_ROWS_CASE(T, 4)        \
        }                                                                                                  \
    }
FOR_EACH_TYPE(FUSED_FOR_TYPE)

#define FUSED_CASE(T) \
    case T: return fused_##T;

static FusedGroup *fused_for(int qtype)
{
    switch (qtype) {
        FOR_EACH_TYPE(FUSED_CASE)
    }
    return NULL;
}

/* One group of W's rows (columns col0.. of y) times x's rows [0, m), over one slice of kc columns: the
 * first slice stores (or adds to y, with `accumulate`) its sums plus the bias, later ones add theirs. */
static void group_product(const float *x, int64_t m, int64_t ldx, int64_t kc, const float *const *w, int cols,
                          int64_t col0, const float *bias, float *y, int64_t n, int accumulate)
{
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        const int rows = m - r0 < MR ? (int)(m - r0) : MR;
        float out[MR][NB];
        if (cols == NB)
            tile_full(x + r0 * ldx, ldx, kc, rows, w, out);
        else
            tile_any(x + r0 * ldx, ldx, kc, rows, w, cols, out);
        for (int j = 0; j < cols; j++) {
            float column[MR];
            for (int r = 0; r < rows; r++)
                column[r] = out[r][j];
            store_column(y + r0 * n, n, rows, col0 + j, column, bias, accumulate);
        }
    }
}

/* This thread's scratch for one group's widened slice, kept between calls. */
static float *scratch(void)
{
    static __thread float buffer[NB * KC] __attribute__((aligned(64))); /* whole cache lines per vector */
    return buffer;
}

/* Group g of NB rows of w's parts: its part, its first row in the part, and y's column of that row. */
static const WeightPart *group_part(const Weight *w, int64_t g, int64_t *row0, int64_t *col0)
{
    int64_t p = 0, col = 0;
    for (; p < w->num_parts - 1 && g >= (w->parts[p].rows + NB - 1) / NB; p++) {
        g -= (w->parts[p].rows + NB - 1) / NB;
        col += w->parts[p].rows;
    }
    *row0 = NB * g;
    *col0 = col + NB * g;
    return &w->parts[p];
}

/* The rows of the groups for m <= FUSED_ROWS rows of x, with the slices of the tiled path. Threads take
 * groups as they finish, in shares as block_q8.c's (share_rows), without waiting for each other. */
static void fused_share(const float *x, int64_t m, int64_t k, const Weight *w, int64_t n, int64_t groups,
                        float *y, int accumulate)
{
    const int64_t chunk = share_rows(w, k, NB, groups, omp_get_num_threads());
#pragma omp for schedule(guided, chunk) nowait
    for (int64_t g = 0; g < groups; g++) {
        int64_t row0, col0;
        const WeightPart *part = group_part(w, g, &row0, &col0);
        const int64_t bytes = row_bytes((int)part->qtype, k);
        const int cols = part->rows - row0 < NB ? (int)(part->rows - row0) : NB;
        const uint8_t *rows[NB];
        for (int j = 0; j < cols; j++)
            rows[j] = part->data + (row0 + j) * bytes;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            float out[FUSED_ROWS][NB];
            fused_for((int)part->qtype)(rows, NB * bytes, cols, k0 / 32, (k0 + kc) / 32, x, k, (int)m, out);
            for (int j = 0; j < cols; j++) {
                float column[FUSED_ROWS];
                for (int r = 0; r < m; r++)
                    column[r] = out[r][j];
                store_column(y, n, (int)m, col0 + j, column, k0 == 0 ? w->bias : NULL, accumulate || k0 > 0);
            }
        }
    }
}

void weight_gemm_share(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int accumulate)
{
    int64_t n = 0, groups = 0;
    for (int64_t p = 0; p < w->num_parts; p++) {
        n += w->parts[p].rows;
        groups += (w->parts[p].rows + NB - 1) / NB;
    }
    if (m <= FUSED_ROWS && k % 32 == 0) {
        fused_share(x, m, k, w, n, groups, y, accumulate);
        return;
    }
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        const float *bias = k0 == 0 ? w->bias : NULL;
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            const int64_t rows = m - i0 < MC ? m - i0 : MC;
            int64_t g = 0, col0 = 0;
            for (int64_t p = 0; p < w->num_parts; p++) {
                const WeightPart *part = &w->parts[p];
                for (int64_t row0 = 0; row0 < part->rows; row0 += NB, g++) {
                    if (g < g0 || g >= g1)
                        continue;
                    const int cols = part->rows - row0 < NB ? (int)(part->rows - row0) : NB;
                    const float *wrows[NB];
                    group_rows(part, row0, cols, k, k0, kc, scratch(), wrows);
                    group_product(x + i0 * k + k0, rows, k, kc, wrows, cols, col0 + row0, bias, y + i0 * n, n,
                                  accumulate || k0 > 0);
                }
                col0 += part->rows;
            }
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
