/* The instruction sets a build has, one spelling each, and the vector helpers more than one kernel uses.
 *
 * native.py compiles the library once per instruction set: x86-64-v4 (AVX-512 F, BW, CD, DQ and VL) with
 * and without VNNI, x86-64-v3 (AVX2, FMA, F16C), and portable C. The kernels test these macros, never the
 * compiler's __AVX...__ ones: code under USE_AVX2 runs on the AVX2 and AVX-512 builds, under USE_AVX512 on
 * both AVX-512 builds, under USE_AVX512_VNNI on the VNNI build; the portable C beside it everywhere. */
#ifndef LLMSERVE_VEC_H
#define LLMSERVE_VEC_H

#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define USE_AVX2 1
#endif
#if defined(USE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define USE_AVX512 1
#endif
#if defined(USE_AVX512) && defined(__AVX512VNNI__)
#define USE_AVX512_VNNI 1
#endif

/* Inlined into each caller, so that each type's or shape's code is compiled for its constants. */
#define INLINE static inline __attribute__((always_inline))

/* The build's vector of floats for the kernels written once for every width (weight_gemm.c,
 * prefill_attention.c): VL lanes, 16 on AVX-512, 8 on AVX2, 4 elsewhere. */
#if defined(USE_AVX512)
#define VL 16
#elif defined(USE_AVX2)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

INLINE vf vload(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef USE_AVX2
/* The sum of v's 8 lanes. */
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#endif

#endif
