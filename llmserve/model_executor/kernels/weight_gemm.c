/* y = x @ W.T for fp32 rows against a weight kept in its stored format (GGUF blocks, fp16, bf16, fp32),
 * at any number of rows, for CPUs.
 *
 * The weight is never widened whole: for each MC rows of x, each thread takes its groups of NB output
 * rows GROUPS at a time and widens their columns KC at a time, one group after another, into a scratch
 * buffer that stays in L1 (dequant.c; fp32 rows are read in place), multiplying them with those rows in
 * tiles of MR x NB dot products, whose chains are kept from one slice to the next. A single row reads the
 * weight's stored bytes once, so a decode step streams 4.5-8.5 bits a weight, not 32; for many rows the
 * widening is amortised over MC rows.
 *
 * Up to FUSED_ROWS rows take a shorter way to the same sums: each 32 weights are widened in registers
 * and multiplied there (dequant.h), never stored and loaded back. At one row the widening can bound a
 * step before memory does: `python -m benchmarks.latency` reports the share of the read bandwidth used.
 * Up to FUSED_MAX rows (a small batch's decode step, or a sequence with its speculated tokens) are read
 * the same way, but each slice of a group's weights is widened once, into L1, for all of them, and
 * multiplied from there in tiles.
 *
 * Every y[r, o] is the same computation whatever the batch: VL lanes of fused multiply-add chains over
 * all of k in order, summed in one fixed tree, then the tail of k past the vectors, then the bias. A
 * row's result depends on neither its batch, nor its tile, nor the number of threads, nor the slices.
 *
 * The vector width is the build's (vec.h's VL): 16 floats on AVX-512, 8 on AVX2, 4 elsewhere; MR and
 * NB are chosen so that the MR * NB accumulators, MR rows of x and one row of W fill the registers.
 */
#pragma GCC optimize("fp-contract=off") /* dequant.h's exact values; the products' FMAs are explicit */

#include <omp.h>
#include <stdint.h>

#include "dequant.h"

/* MC rows of x per pass over a group of W's rows, KC of its columns widened at a time (the last slice up
 * to LAST_KC: a short one would cost a pass of the tiles for few columns). The chains carried between
 * slices (MC x NB vectors a group) let a slice be short enough for its widened weight (NB x KC fp32: 24
 * KiB on AVX-512, 16 on AVX2; up to 36 and 24 for the last) to stay in L1 while the tiles pass over it:
 * 1,024 columns measured best, 2,048 (a whole L1) worst, and 64 rows of x per pass were slower than 128
 * (docs/performance/kernel-measurements.md). KC is a multiple of every block (32 or 256 weights) and vector: only the last slice has a
 * tail, and each slice starts on a whole block. The GROUPS groups taken together pass over each slice in
 * turn, so that x's slice (MC x KC: 512 KiB on AVX-512, the last up to 768, beside their 192 KiB of
 * chains in a 1 MiB L2) comes from L3 once and from L2 for each of them, where one group at a time read
 * x's MC rows whole (2 MiB at k = 4,096) from L3 for every group (groups of 8 were no faster). */
#define KC 1024
#define LAST_KC (KC + KC / 2)
_Static_assert(KC % 256 == 0, "slices start on whole blocks and vectors");
#ifdef USE_AVX512
#define MR 4
#define NB 6
#define MC 128
#else
#define MR 3
#define NB 4
#define MC 64
#endif
#define GROUPS 4 /* groups of W's rows per pass over x's slices */
#define FUSED_ROWS 4 /* up to here the weights are multiplied from registers */
#define FUSED_MAX 16 /* up to here a group's weights are widened as they are read, with its prefetch */

/* acc + a * b, rounded once where the CPU has fused multiply-adds. */
INLINE vf vfma(vf a, vf b, vf acc)
{
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif VL == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return a * b + acc;
#endif
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

/* The chains acc[r][j] of x[r] . w[j], lane by lane, over kc more columns, x's rows ldx apart, for
 * r < rows and j < cols (constants after inlining, as are the flags): started at zero on the `first`
 * slice, else from acc; on the `last`, summed with the tail of columns [kv, kc) past the vectors into out,
 * else left in acc. The chains run in a local copy that nothing can alias, in registers. */
INLINE void tile(const float *x, int64_t ldx, int64_t kv, int64_t kc, int rows, const float *const *w,
                 int cols, vf acc[MR][NB], int first, int last, float out[MR][NB])
{
    vf a[MR][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            a[r][j] = first ? (vf){0} : acc[r][j];
    for (int64_t kk = 0; kk < kv; kk += VL) {
        vf xr[MR];
        for (int r = 0; r < rows; r++)
            xr[r] = vload(x + r * ldx + kk);
        for (int j = 0; j < cols; j++) {
            const vf b = vload(w[j] + kk);
            for (int r = 0; r < rows; r++)
                a[r][j] = vfma(xr[r], b, a[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            if (!last) {
                acc[r][j] = a[r][j];
                continue;
            }
            float sum = vsum(a[r][j]);
            for (int64_t t = kv; t < kc; t++)
                sum = fmaf(x[r * ldx + t], w[j][t], sum);
            out[r][j] = sum;
        }
}

/* tile() with its row count, its group's width and its flags made constants. */
#define TILE_FLAGS(R, C)                                             \
    if (first && last)                                               \
        tile(x, ldx, kv, kc, R, w, C, acc, 1, 1, out);               \
    else if (first)                                                  \
        tile(x, ldx, kv, kc, R, w, C, acc, 1, 0, out);               \
    else if (last)                                                   \
        tile(x, ldx, kv, kc, R, w, C, acc, 0, 1, out);               \
    else                                                             \
        tile(x, ldx, kv, kc, R, w, C, acc, 0, 0, out);

static void tile_full(const float *x, int64_t ldx, int64_t kv, int64_t kc, int rows, const float *const *w,
                      vf acc[MR][NB], int first, int last, float out[MR][NB])
{
    switch (rows) {
#if MR >= 4
    case 4: TILE_FLAGS(4, NB) break;
#endif
    case 3: TILE_FLAGS(3, NB) break;
    case 2: TILE_FLAGS(2, NB) break;
    default: TILE_FLAGS(1, NB) break;
    }
}

static void tile_any(const float *x, int64_t ldx, int64_t kv, int64_t kc, int rows, const float *const *w,
                     int cols, vf acc[MR][NB], int first, int last, float out[MR][NB])
{
    TILE_FLAGS(rows, cols)
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

/* 32 widened weights as the build's vectors, cut from w's lanes in registers (a copy through memory made
 * AVX2 builds store halves and reload them whole, stalling every load). */
INLINE void cut32(const f32x16 w[2], vf b[32 / VL])
{
#if VL == 16
    b[0] = w[0];
    b[1] = w[1];
#elif VL == 8
    b[0] = __builtin_shufflevector(w[0], w[0], 0, 1, 2, 3, 4, 5, 6, 7);
    b[1] = __builtin_shufflevector(w[0], w[0], 8, 9, 10, 11, 12, 13, 14, 15);
    b[2] = __builtin_shufflevector(w[1], w[1], 0, 1, 2, 3, 4, 5, 6, 7);
    b[3] = __builtin_shufflevector(w[1], w[1], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    memcpy(b, w, 32 * sizeof(float));
#endif
}

/* acc[r][j] += x[r][0:32] * w, lane by lane, for r < rows. */
INLINE void multiply32(const f32x16 w[2], const float *x, int64_t ldx, int rows, vf acc[FUSED_ROWS][NB], int j)
{
    vf b[32 / VL];
    cut32(w, b);
    _Pragma("GCC unroll 4") for (int p = 0; p < 32 / VL; p++)
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
            acc[r][j] = vfma(vload(x + r * ldx + VL * p), b[p], acc[r][j]);
}

/* out[r][j] = x[r] . W's row j over its `runs` runs of 32 weights, for r < rows and j < cols (constants
 * after inlining), in the lanes and order of tile(): each 32 weights widened in registers only. The
 * cols rows' chains are independent, so the multiply-adds of one row do not wait on each other.
 *
 * The bytes `ahead` of those read (the same place in the next group's rows) are prefetched: a row of a
 * narrow weight is a few cache lines, too few for the hardware's stream prefetchers to learn before it
 * ends; with it a row runs about as fast as when the weight sits in the cache. They go to L2 (locality 2,
 * prefetcht1), not L1, which was faster for the largest weights (the logits') and alike for the others
 * (docs/performance/kernel-measurements.md). */
INLINE void fused_group(int qtype, const uint8_t *const *w, int64_t ahead, int cols, int64_t runs,
                        const float *x, int64_t ldx, int rows, float out[FUSED_ROWS][NB])
{
    vf acc[FUSED_ROWS][NB];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++)
            acc[r][j] = (vf){0};
    if (is_k_type(qtype)) /* whole super-blocks: their scales once, then sub-blocks at constant offsets */
        for (int64_t sb = 0; sb < runs / 8; sb++) {
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
        for (int64_t s = 0; s < runs; s++)
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

/* dst[0:32] = w, vector by vector, from registers (through memcpy GCC made a copy on the stack). */
INLINE void store32(float *dst, const f32x16 w[2])
{
    vf b[32 / VL];
    cut32(w, b);
    _Pragma("GCC unroll 8") for (int p = 0; p < 32 / VL; p++)
        *(vf *)(dst + VL * p) = b[p];
}

/* A group's runs [s0, s1) of 32 weights widened into fp32 rows 32 * (s1 - s0) apart in `wide` (aligned:
 * every store a whole vector), as fused_group widens them, with its prefetch of the next group's bytes. */
INLINE void widen_group(int qtype, const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1,
                        float *wide)
{
    if (is_k_type(qtype))
        for (int j = 0; j < cols; j++)
            for (int64_t sb = s0 / 8; sb < s1 / 8; sb++) {
                const uint8_t *block = w[j] + block_bytes(qtype) * sb;
                for (int l = 0; l < block_bytes(qtype); l += 64)
                    __builtin_prefetch(block + ahead + l, 0, 2);
                KScales ks;
                k_scales(qtype, block, &ks);
                _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++)
                {
                    f32x16 v[2];
                    k_decode32(qtype, block, g, &ks, v);
                    store32(wide + j * 32 * (s1 - s0) + 32 * (8 * sb + g - s0), v);
                }
            }
    else
        for (int j = 0; j < cols; j++)
            for (int64_t s = s0; s < s1; s++) {
                __builtin_prefetch(w[j] + ahead + bytes32(qtype) * s, 0, 2);
                f32x16 v[2];
                decode32(qtype, w[j], s, NULL, v);
                store32(wide + j * 32 * (s1 - s0) + 32 * (s - s0), v);
            }
}

typedef void Widen(const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1, float *wide);

/* out[r][j] for FUSED_ROWS < rows <= FUSED_MAX. Widening, not multiplying, is most of a register pass's
 * work, so rather than widening each weight again for every FUSED_ROWS rows, each KC of a group's columns
 * is widened once, into L1, and multiplied from there in tile()'s tiles: the same sums, their chains
 * carried from slice to slice. Unlike the tiled path's, the widening prefetches the next group's bytes and
 * threads take groups as they finish: at this many rows reading and widening the weight, not multiplying,
 * bounds the product. */
static void widened_group(Widen *widen, const uint8_t *const *w, int64_t ahead, int cols, int64_t runs,
                          const float *x, int64_t ldx, int rows, float out[FUSED_MAX][NB])
{
    float wide[NB * KC] __attribute__((aligned(64)));
    vf acc[(FUSED_MAX + MR - 1) / MR][MR][NB];
    for (int64_t s0 = 0; s0 < runs; s0 += KC / 32) {
        const int64_t s1 = runs - s0 < KC / 32 ? runs : s0 + KC / 32, kc = 32 * (s1 - s0);
        const int first = s0 == 0, last = s1 == runs;
        const float *wrows[NB];
        for (int j = 0; j < cols; j++)
            wrows[j] = wide + j * kc;
        widen(w, ahead, cols, s0, s1, wide);
        for (int r0 = 0; r0 < rows; r0 += MR) {
            const int n = rows - r0 < MR ? rows - r0 : MR;
            float tiled[MR][NB];
            if (cols == NB)
                tile_full(x + r0 * ldx + 32 * s0, ldx, kc, kc, n, wrows, acc[r0 / MR], first, last, tiled);
            else
                tile_any(x + r0 * ldx + 32 * s0, ldx, kc, kc, n, wrows, cols, acc[r0 / MR], first, last, tiled);
            for (int r = 0; last && r < n; r++)
                for (int j = 0; j < cols; j++)
                    out[r0 + r][j] = tiled[r][j];
        }
    }
}

typedef void FusedGroup(const uint8_t *const *w, int64_t ahead, int cols, int64_t runs,
                        const float *x, int64_t ldx, int rows, float out[FUSED_MAX][NB]);

/* fused_group for one type, its row count and a whole group (or a single row) made constants. */
#define FUSED_ROWS_CASE(T, R)                                         \
    case R:                                                           \
        if (cols == NB)                                               \
            fused_group(T, w, ahead, NB, runs, x, ldx, R, out);       \
        else                                                          \
            for (int j = 0; j < cols; j++) {                          \
                float one[FUSED_ROWS][NB];                            \
                fused_group(T, w + j, ahead, 1, runs, x, ldx, R, one);   \
                for (int r = 0; r < R; r++)                           \
                    out[r][j] = one[r][0];                            \
            }                                                         \
        break;
#define FUSED_FOR_TYPE(T)                                                                                  \
    static void widen_##T(const uint8_t *const *w, int64_t ahead, int cols, int64_t s0, int64_t s1,       \
                          float *wide)                                                                     \
    {                                                                                                      \
        if (cols == NB)                                                                                    \
            widen_group(T, w, ahead, NB, s0, s1, wide);                                                    \
        else                                                                                               \
            widen_group(T, w, ahead, cols, s0, s1, wide);                                                  \
    }                                                                                                      \
    static void fused_##T(const uint8_t *const *w, int64_t ahead, int cols, int64_t runs,                  \
                          const float *x, int64_t ldx, int rows, float out[FUSED_MAX][NB])                 \
    {                                                                                                      \
        switch (rows) {                                                                                    \
            FUSED_ROWS_CASE(T, 1) FUSED_ROWS_CASE(T, 2) FUSED_ROWS_CASE(T, 3) FUSED_ROWS_CASE(T, 4)        \
        default: widened_group(widen_##T, w, ahead, cols, runs, x, ldx, rows, out);                        \
        }                                                                                                  \
    }
FOR_EACH_TYPE(FUSED_FOR_TYPE)
_Static_assert(FUSED_ROWS == 4, "FUSED_FOR_TYPE has a case for each row count up to FUSED_ROWS");

#define FUSED_CASE(T) \
    case T: return fused_##T;

static FusedGroup *fused_for(int qtype)
{
    switch (qtype) {
        FOR_EACH_TYPE(FUSED_CASE)
    }
    return NULL;
}

/* One group of W's rows (columns col0.. of y) times x's rows [0, m) over the slice [k0, k0 + kc) of k's
 * columns, the chains carried from slice to slice in acc (one tile's for each MR rows); after the last
 * slice the results are stored, plus the bias (or added to y, with `accumulate`). KC is a multiple of
 * VL: only the last slice has a tail. */
static void group_slice(const float *x, int64_t m, int64_t k, int64_t k0, int64_t kc, const float *const *w,
                        int cols, vf (*acc)[MR][NB], int64_t col0, const float *bias, float *y, int64_t n,
                        int accumulate)
{
    const int first = k0 == 0, last = k0 + kc == k;
    const int64_t kv = last ? kc - kc % VL : kc;
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
        const int rows = m - r0 < MR ? (int)(m - r0) : MR;
        float out[MR][NB];
        if (cols == NB)
            tile_full(x + r0 * k + k0, k, kv, kc, rows, w, acc[r0 / MR], first, last, out);
        else
            tile_any(x + r0 * k + k0, k, kv, kc, rows, w, cols, acc[r0 / MR], first, last, out);
        if (!last)
            continue;
        for (int j = 0; j < cols; j++) {
            float column[MR];
            for (int r = 0; r < rows; r++)
                column[r] = out[r][j];
            store_column(y + r0 * n, n, rows, col0 + j, column, bias, accumulate);
        }
    }
}

#define TILES ((MC + MR - 1) / MR) /* tiles of a group's MC rows */

/* This thread's chains for the MC rows of GROUPS groups, kept between slices. */
static vf (*accumulators(void))[MR][NB]
{
    static __thread vf buffer[GROUPS * TILES][MR][NB] __attribute__((aligned(64)));
    return buffer;
}

/* This thread's scratch for one group's widened slice, kept between calls. */
static float *scratch(void)
{
    static __thread float buffer[NB * LAST_KC] __attribute__((aligned(64))); /* whole lines per vector */
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

/* The rows of the groups for m <= FUSED_MAX rows of x, widened as they are read: the tiled path's sums.
 * Threads take groups as they finish, in shares as block_q8.c's (share_rows), without waiting for each
 * other. */
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
        float out[FUSED_MAX][NB];
        fused_for((int)part->qtype)(rows, NB * bytes, cols, k / 32, x, k, (int)m, out);
        for (int j = 0; j < cols; j++) {
            float column[FUSED_MAX];
            for (int r = 0; r < m; r++)
                column[r] = out[r][j];
            store_column(y, n, (int)m, col0 + j, column, w->bias, accumulate);
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
    if (m <= FUSED_MAX && k % 32 == 0) {
        fused_share(x, m, k, w, n, groups, y, accumulate);
        return;
    }
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t rows = m - i0 < MC ? m - i0 : MC;
        for (int64_t b0 = g0; b0 < g1; b0 += GROUPS) {
            const int64_t b1 = b0 + GROUPS < g1 ? b0 + GROUPS : g1;
            for (int64_t k0 = 0; k0 < k;) {
                const int64_t kc = k - k0 <= LAST_KC ? k - k0 : KC;
                for (int64_t g = b0; g < b1; g++) {
                    int64_t row0, col0;
                    const WeightPart *part = group_part(w, g, &row0, &col0);
                    const int cols = part->rows - row0 < NB ? (int)(part->rows - row0) : NB;
                    const float *wrows[NB];
                    group_rows(part, row0, cols, k, k0, kc, scratch(), wrows);
                    vf(*acc)[MR][NB] = accumulators() + (g - b0) * TILES;
                    group_slice(x + i0 * k, rows, k, k0, kc, wrows, cols, acc, col0, w->bias, y + i0 * n, n,
                                accumulate);
                }
                k0 += kc;
            }
        }
    }
}

/* y [m, n] = x [m, k] @ W.T (+ bias). Returns KERNEL_OK, or KERNEL_UNSUPPORTED for a part of a type or
 * width we do not read. */
int weight_gemm(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int num_threads)
{
    if (w->num_parts < 1 || w->num_parts > MAX_WEIGHT_PARTS)
        return KERNEL_UNSUPPORTED;
    for (int64_t p = 0; p < w->num_parts; p++)
        if (row_bytes((int)w->parts[p].qtype, k) == 0)
            return KERNEL_UNSUPPORTED;
#pragma omp parallel num_threads(num_threads)
    weight_gemm_share(x, m, k, w, y, 0);
    return KERNEL_OK;
}
