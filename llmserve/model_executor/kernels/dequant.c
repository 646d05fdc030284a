/* Rows of stored weights widened to fp32: every GGUF block type of the common Q4_K_M, Q5_K_M, Q6_K,
 * Q8_0, Q4_0 and Q4_1 files, and the 2-byte floats of Hugging Face checkpoints, exactly as
 * `gguf.quants.dequantize` reads them (see dequant.h).
 */
#pragma GCC optimize("fp-contract=off")

#include <omp.h>
#include <stdint.h>

#include "dequant.h"

/* The instruction set this library was compiled for, as native.py's ISAS names it: what the compiler
 * enabled, not what the file is called, so the tests can check that a forced build is the one loaded. */
const char *kernels_isa(void)
{
#if defined(USE_AVX512_VNNI)
    return "avx512_vnni";
#elif defined(USE_AVX512)
    return "avx512";
#elif defined(USE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

int64_t row_bytes(int qtype, int64_t k)
{
    const int64_t bytes = block_bytes(qtype), weights = block_weights(qtype);
    return bytes && k > 0 && k % weights == 0 ? k / weights * bytes : 0;
}

/* One type's copy of the loop over a row's 32-weight groups. */
#define ROW_CASE(T)                                     \
    case T:                                             \
        for (int64_t s = 0; s < k / 32; s++) {          \
            f32x16 w[2];                                \
            if (is_k_type(T) && s % 8 == 0)             \
                k_scales(T, src + block_bytes(T) * (s / 8), &ks); \
            decode32(T, src, s, &ks, w);                \
            memcpy(dst + 32 * s, w, sizeof w);          \
        }                                               \
        break;

/* Weight i of a row of fp32, fp16 or bf16. */
static float float_weight(int qtype, const uint8_t *src, int64_t i)
{
    if (qtype == F16)
        return read_half(src + 2 * i);
    if (qtype == BF16)
        return bf16_to_float((uint16_t)(src[2 * i] | src[2 * i + 1] << 8));
    float v;
    memcpy(&v, src + 4 * i, 4);
    return v;
}

void dequantize_row(int qtype, const uint8_t *src, int64_t k, float *dst)
{
    KScales ks; /* of the K super-block being widened */
    switch (qtype) {
        FOR_EACH_TYPE(ROW_CASE)
    }
    for (int64_t i = k / 32 * 32; i < k; i++) /* a float row need not be whole groups */
        dst[i] = float_weight(qtype, src, i);
}

/* out[i] = row ids[i] of W [rows, k] (stored as qtype) in fp32: an embedding lookup, or a whole weight
 * dequantized. Returns KERNEL_OK, KERNEL_UNSUPPORTED for a type or width we do not read, or
 * KERNEL_OUT_OF_BOUNDS for an id outside [0, rows). */
int dequantize_rows(const uint8_t *w, int qtype, int64_t k, int64_t rows, const int64_t *ids, int64_t n,
                    float *out, int num_threads)
{
    const int64_t bytes = row_bytes(qtype, k);
    if (bytes == 0)
        return KERNEL_UNSUPPORTED;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows)
            return KERNEL_OUT_OF_BOUNDS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++)
        dequantize_row(qtype, w + ids[i] * bytes, k, out + i * k);
    return KERNEL_OK;
}
