/* y = x @ W.T (+ bias) for many rows of x (a prefill, a large batch) rounded to int8 per block of 32, as
 * block_q8.c rounds them, against a weight's GGUF blocks, on CPUs with AVX-512 VNNI.
 *
 * Each thread unpacks a panel of NP output rows once into signed bytes, four consecutive weights of one
 * output per 32-bit lane (pack_panel: each row's values in a row of `rows`, then 16 rows' chunks at a
 * time transposed in registers), with a scale per 32 weights (per 16 in panels with a Q6_K row) and, for
 * the types with a minimum, an offset per 32; a type's centre (Q4_0's 8, Q5_0's 16) is taken out of the
 * bytes. Then every MR rows of x meet the panel in VNNI multiply-adds: one instruction takes 4 weights x
 * 16 outputs against 4 broadcast activations, 64 products where an fp32 multiply-add takes 16. VNNI
 * multiplies unsigned bytes by signed ones, so x goes in as q + 128 (Int8Rows.codes) and each sum starts
 * from -128 times its weights' sum (`corrections`), which leaves the exact integer q . w. The int32 sums
 * of each unit (32 weights, 16 in a Q6_K panel) are scaled into fp32 accumulators with one multiply and
 * one multiply-add, the offsets meeting x's sums per 32: on this kernel's CPUs a float multiply-add takes
 * the same unit as a VNNI instruction (on some, one 512-bit either per cycle), while a conversion does not.
 * Elsewhere int8_gemm_available() is 0 and the callers round x (round_rows) for weight_gemm.c: the same
 * values, summed in another order.
 */
#pragma GCC optimize("fp-contract=off") /* dequant.h's scales; the products' FMAs are explicit */

#include <omp.h>
#include <stdlib.h>

#include "block_chunks.h"

#ifdef USE_AVX512 /* the VNNI instructions by target attribute, where the CPU has them */
#define NP 32             /* output rows per panel: two vectors of 16 (int8_scratch_bytes) */
#define MR INT8_GEMM_ROWS /* rows of x per pass over the panel */

typedef struct {
    int8_t *values;       /* [in / 4][NP][4]: weights as signed bytes, centred */
    float *scales;        /* [in / unit][NP] */
    float *offsets;       /* [in / 32][NP]: the minimum of has_minimum types' rows, 0 for others */
    int32_t *corrections; /* [in / unit][NP]: -128 times the sum of the unit's values */
    int8_t *rows;         /* [NP][in]: the same bytes row by row, before the transpose */
    int unit;             /* weights per scale: 32, or 16 where a row is Q6_K */
    int has_offsets;      /* some row has_minimum */
} Panel;

/* Whether a type's weights are scale * v + minimum (the others' centre is taken out of v). */
INLINE int has_minimum(int qtype)
{
    return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K;
}

/* The sums of v's two halves of 16 signed bytes. */
INLINE void half_sums(__m256i v, int32_t sums[2])
{
    const __m256i wide = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    sums[0] = (int32_t)(_mm256_extract_epi64(wide, 0) + _mm256_extract_epi64(wide, 1)) - 128 * 16;
    sums[1] = (int32_t)(_mm256_extract_epi64(wide, 2) + _mm256_extract_epi64(wide, 3)) - 128 * 16;
}

/* Row j of the panel from a weight row of `qtype` (a constant after inlining). */
INLINE void pack_row(int qtype, const uint8_t *row, int64_t chunks, int j, Panel *p)
{
    const int centre = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0; /* Q8_0 and Q6_K come signed */
    KScales k;
    for (int64_t s = 0; s < chunks; s++) {
        if (is_k_type(qtype) && s % 8 == 0)
            k_scales(qtype, row + block_bytes(qtype) * (s / 8), &k);
        const Chunk c = chunk_scales(qtype, row, s, &k);
        __m256i v = chunk_values(qtype, chunk_group(qtype, row, s), (int)(s % 8));
        if (centre)
            v = _mm256_sub_epi8(v, _mm256_set1_epi8((char)centre));
        _mm256_storeu_si256((__m256i *)(p->rows + j * (chunks * QK) + s * QK), v);
        int32_t sums[2];
        half_sums(v, sums);
        if (p->unit == 16) {
            for (int h = 0; h < 2; h++) {
                p->scales[(2 * s + h) * NP + j] = c.scale[h];
                p->corrections[(2 * s + h) * NP + j] = -128 * sums[h];
            }
        } else {
            p->scales[s * NP + j] = c.scale[0];
            p->corrections[s * NP + j] = -128 * (sums[0] + sums[1]);
        }
        p->offsets[s * NP + j] = has_minimum(qtype) ? c.offset : 0.0f;
    }
}

/* Chunk s of rows[0..15] (stride `in` bytes) into the panel's values for outputs 16 h .. 16 h + 15: dword g
 * of row j goes to lane j of vector g. Rows k and k + 8 share a register; an 8 x 8 dword transpose runs
 * in each 256-bit half of the eight registers at once. */
INLINE void transpose_chunk(const int8_t *rows, int64_t in, int64_t s, int h, int8_t *values)
{
    __m512i z[8], t[8], u[8];
    for (int k = 0; k < 8; k++) {
        const __m256i low = _mm256_loadu_si256((const __m256i *)(rows + k * in + s * QK));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(rows + (k + 8) * in + s * QK));
        z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    }
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);     /* rows k, k+1: dwords 0, 1 (4, 5) */
        t[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]); /* dwords 2, 3 (6, 7) */
    }
    for (int k = 0; k < 8; k += 4) {
        u[k / 4] = _mm512_unpacklo_epi64(t[k], t[k + 2]);         /* rows k .. k+3: dword 0 (4) */
        u[k / 4 + 2] = _mm512_unpackhi_epi64(t[k], t[k + 2]);     /* dword 1 (5) */
        u[k / 4 + 4] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]); /* dword 2 (6) */
        u[k / 4 + 6] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]); /* dword 3 (7) */
    }
    /* u[2 d] holds rows 0-3 (and 8-11) of dwords d and d + 4, u[2 d + 1] rows 4-7 (12-15) */
    const __m512i first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    int8_t *dst = values + (s * 8 * NP + 16 * h) * 4;
    for (int d = 0; d < 4; d++) {
        _mm512_storeu_si512((void *)(dst + d * NP * 4), _mm512_permutex2var_epi64(u[2 * d], first, u[2 * d + 1]));
        _mm512_storeu_si512((void *)(dst + (d + 4) * NP * 4),
                            _mm512_permutex2var_epi64(u[2 * d], second, u[2 * d + 1]));
    }
}

#define PACK_CASE(T) \
    case T: pack_row(T, row, chunks, j, p); break;

/* Rows o0 .. o0 + NP - 1 of W, zeros past `out`. */
static void pack_panel(const Weight *w, int64_t in, int64_t o0, int64_t out, Panel *p)
{
    const int64_t chunks = in / QK;
    p->unit = QK;
    p->has_offsets = 0;
    for (int j = 0; j < NP && o0 + j < out; j++) {
        int qtype;
        block_row(w, o0 + j, in, &qtype);
        p->unit = qtype == Q6_K ? 16 : p->unit;
        p->has_offsets |= has_minimum(qtype);
    }
    for (int j = 0; j < NP; j++) {
        if (o0 + j >= out) {
            for (int64_t u = 0; u < in / p->unit; u++) {
                p->scales[u * NP + j] = 0.0f;
                p->corrections[u * NP + j] = 0;
            }
            for (int64_t s = 0; s < chunks; s++)
                p->offsets[s * NP + j] = 0.0f;
            continue;
        }
        int qtype;
        const uint8_t *row = block_row(w, o0 + j, in, &qtype);
        switch (qtype) {
            PACK_CASE(Q4_0) PACK_CASE(Q4_1) PACK_CASE(Q5_0) PACK_CASE(Q5_1) PACK_CASE(Q8_0) PACK_CASE(Q4_K)
            PACK_CASE(Q5_K) PACK_CASE(Q6_K)
        }
    }
    for (int h = 0; h < NP / 16; h++)
        for (int64_t s = 0; s < chunks; s++)
            transpose_chunk(p->rows + 16 * h * in, in, s, h, p->values);
}

/* dot[r][h] = the panel's correction for unit u, then + x[r]'s codes . the unit's weights (U of them),
 * for MR rows of x and the panel's NP outputs. */
__attribute__((target("avx512vnni"))) INLINE void unit_sums(const Panel *p, int U, int64_t u, const uint8_t *codes,
                                                            int64_t in, __m512i dot[MR][2])
{
    const __m512i c0 = _mm512_loadu_si512((const void *)(p->corrections + u * NP));
    const __m512i c1 = _mm512_loadu_si512((const void *)(p->corrections + u * NP + 16));
    for (int r = 0; r < MR; r++) {
        dot[r][0] = c0;
        dot[r][1] = c1;
    }
    for (int g = 0; g < U / 4; g++) {
        const int8_t *values = p->values + (u * (U / 4) + g) * NP * 4;
        const __m512i w0 = _mm512_loadu_si512((const void *)values);
        const __m512i w1 = _mm512_loadu_si512((const void *)(values + 64));
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, codes + r * in + u * U + g * 4, 4);
            const __m512i x = _mm512_set1_epi32(four);
            dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], x, w0);
            dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], x, w1);
        }
    }
}

/* y[r, j] (+)= x[r] . W[o0 + j] (+ bias) for MR rows of x (their codes, scales and sums per 32) and the
 * panel's NP outputs; U = the panel's unit and OFFSETS = whether it has offsets (constants after
 * inlining). Only `rows` x `cols` of them are stored, added to y with `accumulate`. */
__attribute__((target("avx512vnni"))) INLINE void panel_product(const Panel *p, int U, int OFFSETS,
                                                                const uint8_t *codes, const float *x_scales,
                                                                const float *x_sums, int64_t in, float *y,
                                                                int64_t y_stride, int64_t rows, int64_t cols,
                                                                const float *bias, int accumulate)
{
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t u = 0; u < in / U; u++) {
        __m512i dot[MR][2];
        unit_sums(p, U, u, codes, in, dot);
        const __m512 s0 = _mm512_loadu_ps(p->scales + u * NP), s1 = _mm512_loadu_ps(p->scales + u * NP + 16);
        const int64_t b = u * U / QK; /* x's block */
        for (int r = 0; r < MR; r++) {
            const __m512 x_scale = _mm512_set1_ps(x_scales[r * (in / QK) + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, x_scale), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, x_scale), acc[r][1]);
        }
        if (OFFSETS && (u + 1) * U % QK == 0) {
            const __m512 o0 = _mm512_loadu_ps(p->offsets + b * NP), o1 = _mm512_loadu_ps(p->offsets + b * NP + 16);
            for (int r = 0; r < MR; r++) {
                const __m512 x_sum = _mm512_set1_ps(x_sums[r * (in / QK) + b]);
                acc[r][0] = _mm512_fmadd_ps(o0, x_sum, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(o1, x_sum, acc[r][1]);
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const int64_t n = cols - 16 * h;
        const __mmask16 valid = n >= 16 ? 0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + 16 * h) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            float *dst = y + r * y_stride + 16 * h;
            __m512 v = _mm512_add_ps(acc[r][h], b);
            if (accumulate)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, dst), v);
            _mm512_mask_storeu_ps(dst, valid, v);
        }
    }
}
#endif

int int8_gemm_available(void)
{
#ifdef USE_AVX512
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

int64_t int8_scratch_bytes(int64_t in)
{
    /* a Panel's (NP = 32): values and rows, then scales and corrections per 16 and offsets per 32 */
    const int64_t bytes = 2 * in * 32 + (int64_t)sizeof(float) * 32 * (2 * (in / 16) + in / 32);
    return (bytes + 63) / 64 * 64; /* each thread's on a cache line of its own */
}

void int8_rows(const float *x, int64_t rows, int64_t in, uint8_t *codes, float *scales, float *sums)
{
    quantize_rows(x, rows, in, (int8_t *)codes, scales, sums);
    for (int64_t i = 0; i < rows * in; i++)
        codes[i] ^= 0x80; /* q + 128 */
}

#ifdef USE_AVX512
__attribute__((target("avx512vnni"))) /* called where int8_gemm_available() */
#endif
void int8_gemm_share(const Int8Rows *x, const Weight *w, int64_t out, float *y, int accumulate, uint8_t *scratch)
{
#ifdef USE_AVX512
    const int64_t in = x->in, units16 = in / 16; /* the most units a panel has */
    float *scales = (float *)(scratch + 2 * in * NP);
    int32_t *corrections = (int32_t *)(scales + units16 * NP);
    float *offsets = (float *)(corrections + units16 * NP);
    Panel p = {(int8_t *)scratch, scales, offsets, corrections, (int8_t *)scratch + in * NP, QK, 0};
#pragma omp for schedule(dynamic, 1)
    for (int64_t o0 = 0; o0 < out; o0 += NP) {
        pack_panel(w, in, o0, out, &p);
        const int64_t cols = out - o0 < NP ? out - o0 : NP;
        for (int64_t r0 = 0; r0 < x->rows; r0 += MR) {
            const uint8_t *codes = x->codes + r0 * in;
            const float *x_scales = x->scales + r0 * (in / QK), *x_sums = x->sums + r0 * (in / QK);
            const float *bias = w->bias ? w->bias + o0 : NULL;
            float *dst = y + r0 * out + o0;
            const int64_t rows = x->rows - r0 < MR ? x->rows - r0 : MR;
#define PRODUCT(U, OFFSETS) \
    panel_product(&p, U, OFFSETS, codes, x_scales, x_sums, in, dst, out, rows, cols, bias, accumulate)
            if (p.unit == 16 && p.has_offsets)
                PRODUCT(16, 1);
            else if (p.unit == 16)
                PRODUCT(16, 0);
            else if (p.has_offsets)
                PRODUCT(QK, 1);
            else
                PRODUCT(QK, 0);
#undef PRODUCT
        }
    }
#else
    (void)x, (void)w, (void)out, (void)y, (void)accumulate, (void)scratch;
#endif
}

/* x: [rows, in] fp32, rounded here; W: [out, in] in GGUF blocks; y: [rows, out]. Returns KERNEL_OK,
 * KERNEL_UNSUPPORTED where this CPU or this weight has no such product, or KERNEL_NO_MEMORY. */
int int8_gemm(const float *x, int64_t rows, int64_t in, const Weight *w, int64_t out, float *y, int num_threads)
{
    if (!int8_gemm_available() || rows < 1 || in % QK != 0 || !reads_blocks(w, in))
        return KERNEL_UNSUPPORTED;
    const int64_t padded = (rows + INT8_GEMM_ROWS - 1) / INT8_GEMM_ROWS * INT8_GEMM_ROWS;
    uint8_t *codes = calloc((size_t)(padded * in), 1);
    float *scales = calloc((size_t)(padded * in / QK), sizeof(float));
    float *sums = calloc((size_t)(padded * in / QK), sizeof(float));
    uint8_t *scratch = aligned_alloc(64, (size_t)(num_threads * int8_scratch_bytes(in)));
    const int status = codes && scales && sums && scratch ? KERNEL_OK : KERNEL_NO_MEMORY;
    if (status == KERNEL_OK) {
        const Int8Rows rounded = {codes, scales, sums, rows, in};
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                int8_rows(x + r * in, 1, in, codes + r * in, scales + r * (in / QK), sums + r * (in / QK));
            int8_gemm_share(&rounded, w, out, y, 0, scratch + omp_get_thread_num() * int8_scratch_bytes(in));
        }
    }
    free(codes);
    free(scales);
    free(sums);
    free(scratch);
    return status;
}
