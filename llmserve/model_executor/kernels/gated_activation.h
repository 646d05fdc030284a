/* The MLP's gated activation, act(gate) * up, as the decode step (decoder_step.c) and the layer's
 * PyTorch forward (gated_activation.c, through layers/decoder_layer.py) both compute it: one definition,
 * so that a token's MLP rounds alike whether its step decodes or prefills. */
#ifndef LLMSERVE_GATED_ACTIVATION_H
#define LLMSERVE_GATED_ACTIVATION_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vector_exp.h"

/* The gate's activation as x / (1 + e^-z): SiLU (ACTIVATION_SILU) with z = x, tanh GELU
 * (ACTIVATION_GELU_TANH) with z = 2 sqrt(2 / pi) (x + 0.044715 x^3), since 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u). The same function as
 * PyTorch's, rounded otherwise (a vector e^x, not libm's tanhf and expf one value at a time). Below
 * z = -88, where e^-z would pass its clamp, it is x * 0 as PyTorch's is (-0.0; NaN at -inf). */
#ifdef USE_AVX512
static inline __m512 act16(__m512 x, int64_t activation)
{
    __m512 z = x;
    if (activation == ACTIVATION_GELU_TANH)
        z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),
                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
    const __m512 y =
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
    const __mmask16 vanishing = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-EXP_HIGH), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(y, vanishing, x, _mm512_setzero_ps());
}
#define ACT_LANES 16
#elif defined(USE_AVX2)
static inline __m256 act8(__m256 x, int64_t activation)
{
    __m256 z = x;
    if (activation == ACTIVATION_GELU_TANH)
        z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                          _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
    const __m256 y =
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
    const __m256 vanishing = _mm256_cmp_ps(z, _mm256_set1_ps(-EXP_HIGH), _CMP_LT_OQ);
    return _mm256_blendv_ps(y, _mm256_mul_ps(x, _mm256_setzero_ps()), vanishing);
}
#define ACT_LANES 8
#endif

#ifdef ACT_LANES
/* act(g) * u for ACT_LANES values at g and u into h. */
static inline void act_vector(const float *g, const float *u, int64_t activation, float *h)
{
#ifdef USE_AVX512
    _mm512_storeu_ps(h, _mm512_mul_ps(act16(_mm512_loadu_ps(g), activation), _mm512_loadu_ps(u)));
#else
    _mm256_storeu_ps(h, _mm256_mul_ps(act8(_mm256_loadu_ps(g), activation), _mm256_loadu_ps(u)));
#endif
}
#endif

/* h[i] = act(gate[i]) * up[i] for i < n; the last partial vector goes through the same vector code, so
 * that every value is rounded alike whatever n. */
static inline void gated_act(const float *gate, const float *up, int64_t n, int64_t activation, float *h)
{
#ifdef ACT_LANES
    int64_t i = 0;
    for (; i + ACT_LANES <= n; i += ACT_LANES)
        act_vector(gate + i, up + i, activation, h + i);
    if (i < n) {
        float g[ACT_LANES] = {0}, u[ACT_LANES] = {0}, v[ACT_LANES];
        memcpy(g, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u, up + i, sizeof(float) * (size_t)(n - i));
        act_vector(g, u, activation, v);
        memcpy(h + i, v, sizeof(float) * (size_t)(n - i));
    }
#else
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i];
        const float z =
            activation == ACTIVATION_GELU_TANH ? 1.5957691216057308f * (0.044715f * x * (x * x) + x) : x;
        h[i] = x / (1.0f + expf(-z)) * up[i];
    }
#endif
}

#endif
