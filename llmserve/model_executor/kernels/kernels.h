/* What the kernels share: GGUF block products (block_gemv.c with fp32 activations, block_q8.c with int8
 * ones), the packed fp32 product (gemm.c) and one (sequence, KV head) of decode attention
 * (paged_attention.c), which decoder_step.c strings together. */
#ifndef LLMSERVE_KERNELS_H
#define LLMSERVE_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define USE_AVX2 1
/* gemm.c: W [n, k] as panels of GEMM_PANEL rows, [ceil(n / GEMM_PANEL)][k][GEMM_PANEL], zero-padded. */
#define GEMM_PANEL 16
void pack_weight(const float *w, int64_t n, int64_t k, float *packed);

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ y when `accumulate`), for this thread's share of the panels:
 * called by every thread of a parallel region. */
void gemm_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                float *y, int accumulate);

#endif

#define QK 32 /* weights per GGUF block */
#define BLOCK_GEMV_MAX_ROWS 16
enum { Q4_1 = 3, Q8_0 = 8 }; /* GGML type ids */

/* The fp16 at p (a block's scale or minimum) as a float. */
static inline float read_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef USE_AVX2
    return _cvtsh_ss(h);
#else
    const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    const float magnitude = exp == 0 ? ldexpf((float)mant, -24) : ldexpf((float)(mant | 0x400), exp - 25);
    const float value = exp == 0x1f ? (mant ? NAN : INFINITY) : magnitude;
    return h & 0x8000 ? -value : value;
/* gemm.c: W [n, k] as panels of GEMM_PANEL rows, [ceil(n / GEMM_PANEL)][k][GEMM_PANEL], zero-padded. */
#define GEMM_PANEL 16
void pack_weight(const float *w, int64_t n, int64_t k, float *packed);

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ y when `accumulate`), for this thread's share of the panels:
 * called by every thread of a parallel region. */
void gemm_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                float *y, int accumulate);

#endif
}

#ifdef USE_AVX2
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
/* gemm.c: W [n, k] as panels of GEMM_PANEL rows, [ceil(n / GEMM_PANEL)][k][GEMM_PANEL], zero-padded. */
#define GEMM_PANEL 16
void pack_weight(const float *w, int64_t n, int64_t k, float *packed);

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ y when `accumulate`), for this thread's share of the panels:
 * called by every thread of a parallel region. */
void gemm_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                float *y, int accumulate);

#endif

/* Bytes of one block of this type, or 0 for a type we do not read. Inline, so that the kernels
 * specialised per type see a constant stride. */
static inline int64_t block_bytes(int qtype)
{
    return qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* Rows x [rows, in] as a block product reads them: with sums[r, b], the sum of block b of row r (the
 * Q4_1 minimum's term); or, when q is set, rounded to int8 per block (q [rows, in], scales and sums
 * [rows, in / 32], see block_q8.c). */
typedef struct {
    const float *x, *sums;
    const int8_t *q;
    const float *scales;
    int64_t rows, in;
} BlockInput;

/* Fills what `in` needs besides x: the sums, and the int8 rounding when in->q is set. */
void prepare_input(BlockInput *in, float *sums, int8_t *q, float *scales);

/* sums[r, b] = the sum of x[r]'s block b. x: [rows, in]. */
void block_sums(const float *x, int64_t rows, int64_t in, float *sums);

/* x rounded to int8 per block of 32: q, the blocks' scales, and scale * sum(q) for each. */
void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *q, float *scales, float *sums);

/* x rounded to int8 per block of 32 and back to fp32 (what the int8 blocks multiply), for the products
 * of more rows than the blocks take: out [rows, in]. */
void round_rows(const float *x, int64_t rows, int64_t in, float *out);

/* acc[r] = x[r] . w for one output row w of in / 32 blocks, for rows <= BLOCK_GEMV_MAX_ROWS. */
void block_gemv_row(const BlockInput *in, const uint8_t *w, int qtype, float *acc);

/* The same with int8 activations (in->q set). */
void q8_dot_rows(const BlockInput *in, const uint8_t *w, int qtype, float *acc);

/* One sequence's query heads that share KV head `head_stride / (num_blocks * block_size * head_dim)`:
 * q, out [group, head_dim]; scores: scratch of group * len floats. */
void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t len,
                float *out, int64_t group, int64_t head_dim, int64_t block_size, int64_t head_stride, float scale,
                float *scores);

/* gemm.c: W [n, k] as panels of GEMM_PANEL rows, [ceil(n / GEMM_PANEL)][k][GEMM_PANEL], zero-padded. */
#define GEMM_PANEL 16
void pack_weight(const float *w, int64_t n, int64_t k, float *packed);

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ y when `accumulate`), for this thread's share of the panels:
 * called by every thread of a parallel region. */
void gemm_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                float *y, int accumulate);

#endif
