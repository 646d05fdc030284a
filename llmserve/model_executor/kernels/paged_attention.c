/* Decode attention over the paged, head-major KV cache, fp32 or bf16 (`--dtype bfloat16`), for CPUs.
 *
 * One query token per row, of its own length (a sequence's guessed tokens are rows of their own, after
 * their keys were written). Each (row, KV head) task reads that head's cached keys and values
 * once, in place through the block table, for all the query heads that share it (grouped-query
 * attention). The PyTorch path instead gathers the blocks into a padded copy and reads that copy:
 * three passes over the cache where this makes one.
 *
 * Compiled at run time by native.py with -O3 -march=native -fopenmp; it then shares the OpenMP
 * runtime PyTorch already loaded (same soname), so the threads are PyTorch's.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_exp.h"

/* The cache's values are fp32, or bf16 (`bf16`, a constant after inlining): a bf16's bits are the top
 * half of the fp32 it stands for, so it widens exactly; the arithmetic is fp32 either way. */
static inline const void *at(const void *cache, int64_t i, int bf16)
{
    return (const char *)cache + i * (bf16 ? 2 : 4);
}

static inline float value_at(const void *cache, int64_t i, int bf16)
{
    return bf16 ? bf16_to_float(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

#ifdef USE_AVX2
/* s[0..len) = e^(s - max(s)); returns their sum. */
static float softmax_numerators(float *s, int64_t len)
{
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8)
        m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + t));
    float m[8], max = -INFINITY;
    _mm256_storeu_ps(m, m8);
    for (int i = 0; i < 8; i++)
        max = m[i] > max ? m[i] : max;
    for (; t < len; t++)
        max = s[t] > max ? s[t] : max;
    const __m256 max8 = _mm256_set1_ps(max);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), max8));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    if (t < len) { /* the tail through the same exp8, so that every score is rounded alike */
        float tail[8] = {0};
        memcpy(tail, s + t, sizeof(float) * (size_t)(len - t));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), max8)));
        for (int64_t i = 0; t + i < len; i++) {
            s[t + i] = tail[i];
            sum += tail[i];
        }
    }
    return sum;
}

/* Cached values i .. i + 7 as fp32. */
static inline __m256 load8(const void *cache, int64_t i, int bf16)
{
    if (!bf16)
        return _mm256_loadu_ps((const float *)cache + i);
    const __m128i halves = _mm_loadu_si128((const __m128i *)at(cache, i, 1));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* The four dot products q . k[0..3] (head_dim values each, a multiple of 8), as 4 lanes. */
static inline __m128 dot4(const float *q, const void *k, int64_t head_dim, int bf16)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qd, load8(k, d, bf16), a0);
        a1 = _mm256_fmadd_ps(qd, load8(k, head_dim + d, bf16), a1);
        a2 = _mm256_fmadd_ps(qd, load8(k, 2 * head_dim + d, bf16), a2);
        a3 = _mm256_fmadd_ps(qd, load8(k, 3 * head_dim + d, bf16), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* o[0..head_dim) += the sum over t < n of p[t] * v[t]: o stays in registers for the block. */
static inline void weigh_values(const void *v, const float *p, int64_t n, int64_t head_dim, float *o, int bf16)
{
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        __m256 acc[8];
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(o + d + 8 * i);
        for (int64_t t = 0; t < n; t++) {
            const __m256 pt = _mm256_broadcast_ss(p + t);
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(pt, load8(v, t * head_dim + d + 8 * i, bf16), acc[i]);
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + d + 8 * i, acc[i]);
    }
    for (; d < head_dim; d += 8) {
        __m256 acc = _mm256_loadu_ps(o + d);
        for (int64_t t = 0; t < n; t++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), load8(v, t * head_dim + d, bf16), acc);
        _mm256_storeu_ps(o + d, acc);
    }
}

/* Rows [t, t + 4) of the next block, head_dim values each, towards the cache while this one computes. */
static inline void prefetch_rows(const void *next, int64_t t, int64_t head_dim, int bf16)
{
    if (next != NULL)
        for (int64_t i = t * head_dim; i < (t + 4) * head_dim; i += bf16 ? 32 : 16)
            _mm_prefetch((const char *)at(next, i, bf16), _MM_HINT_T0);
}
#endif

/* Scores of `group` query heads against the cached keys at positions [first, len), first = len - window
 * (0 without a window, window <= 0), block by block of the table from the block holding `first`; the
 * blocks before it are never read (behind a sliding window they may have been freed and reused). Then
 * e^(score - max) of each, and out = their weighted sum of the values / the sum of the weights. The
 * next block is prefetched while one computes: the blocks lie scattered, out of the hardware
 * prefetcher's sight. */
__attribute__((always_inline)) static inline void attend(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
    int64_t window, float *out, int64_t group, int64_t head_dim, int64_t block_size, int64_t head_stride,
    float scale, float *scores, int bf16)
{
    const int64_t first = window > 0 && len > window ? len - window : 0, keys = len - first;
    const int64_t blocks = (len + block_size - 1) / block_size, block_values = block_size * head_dim;
#ifdef USE_AVX2
    const int vector = head_dim % 8 == 0 && block_size % 4 == 0;
#endif
    for (int64_t b = first / block_size; b < blocks; b++) {
        const int64_t t0 = b * block_size, n = len - t0 < block_size ? len - t0 : block_size;
        const int64_t skip = first > t0 ? first - t0 : 0; /* rows of the first block before the window */
        const void *k = at(k_cache, head_stride + table[b] * block_values + skip * head_dim, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float *s = scores + g * keys + t0 + skip - first; /* s[t]: the score of k's row t */
            int64_t t = 0;
#ifdef USE_AVX2
            const void *next = g == 0 && b + 1 < blocks ? at(k_cache, head_stride + table[b + 1] * block_values, bf16) : NULL;
            for (; vector && t + 4 <= n - skip; t += 4) {
                prefetch_rows(next, t, head_dim, bf16);
                _mm_storeu_ps(s + t, _mm_mul_ps(dot4(qg, at(k, t * head_dim, bf16), head_dim, bf16), _mm_set1_ps(scale)));
            }
#endif
            for (; t < n - skip; t++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qg[d] * value_at(k, t * head_dim + d, bf16);
                s[t] = dot * scale;
            }
        }
    }
    float inverse[group];
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * keys, sum = 0.0f;
#ifdef USE_AVX2
        if (vector)
            sum = softmax_numerators(s, keys);
        else
#endif
        {
            float max = -INFINITY;
            for (int64_t t = 0; t < keys; t++)
                max = s[t] > max ? s[t] : max;
            for (int64_t t = 0; t < keys; t++) {
                s[t] = expf(s[t] - max);
                sum += s[t];
            }
        }
        inverse[g] = 1.0f / sum;
        for (int64_t d = 0; d < head_dim; d++)
            out[g * head_dim + d] = 0.0f;
    }
    for (int64_t b = first / block_size; b < blocks; b++) {
        const int64_t t0 = b * block_size, n = len - t0 < block_size ? len - t0 : block_size;
        const int64_t skip = first > t0 ? first - t0 : 0;
        const void *v = at(v_cache, head_stride + table[b] * block_values + skip * head_dim, bf16);
        const float *p = scores + t0 + skip - first; /* p[t]: the weight of v's row t, for head 0 */
#ifdef USE_AVX2
        if (vector) {
            const void *next = b + 1 < blocks ? at(v_cache, head_stride + table[b + 1] * block_values, bf16) : NULL;
            for (int64_t t = 0; t < block_size; t += 4)
                prefetch_rows(next, t, head_dim, bf16);
            for (int64_t g = 0; g < group; g++)
                weigh_values(v, p + g * keys, n - skip, head_dim, out + g * head_dim, bf16);
            continue;
        }
#endif
        for (int64_t t = 0; t < n - skip; t++)
            for (int64_t g = 0; g < group; g++) {
                const float w = p[g * keys + t];
                float *o = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += w * value_at(v, t * head_dim + d, bf16);
            }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++)
            out[g * head_dim + d] *= inverse[g];
}

void attend_one(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
    int64_t window, float *out, int64_t group, int64_t head_dim, int64_t block_size, int64_t head_stride,
    float scale, float *scores, int bf16)
{
    if (bf16)
        attend(q, k_cache, v_cache, table, len, window, out, group, head_dim, block_size, head_stride, scale,
               scores, 1);
    else
        attend(q, k_cache, v_cache, table, len, window, out, group, head_dim, block_size, head_stride, scale,
               scores, 0);
}

int tables_in_bounds(const int64_t *block_tables, const int64_t *seq_lens, int64_t rows, int64_t max_blocks,
                     int64_t num_blocks, int64_t block_size)
{
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = seq_lens[r];
        if (len < 1 || len > max_blocks * block_size)
            return 0;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (block_tables[r * max_blocks + b] < 0 || block_tables[r * max_blocks + b] >= num_blocks)
                return 0;
    }
    return 1;
}

/* q, out: [batch, heads, head_dim] fp32; caches: [kv_heads, num_blocks, block_size, head_dim], fp32 or with
 * `cache_bf16` bf16;
 * block_tables: [batch, max_blocks]; seq_lens: [batch], each >= 1; window: the keys each query sees, its own
 * included (<= 0: all). Returns KERNEL_OK, KERNEL_NO_MEMORY, or KERNEL_OUT_OF_BOUNDS for a length or
 * block id out of bounds (tables_in_bounds). */
int paged_decode_attention(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
    const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks, int64_t window,
    int64_t cache_bf16, float scale, int num_threads)
{
    if (!tables_in_bounds(block_tables, seq_lens, batch, max_blocks, num_blocks, block_size))
        return KERNEL_OUT_OF_BOUNDS;
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    max_len = window > 0 && window < max_len ? window : max_len; /* the most keys one query sees */
    float *scratch = malloc(sizeof(float) * num_threads * group * max_len);
    if (scratch == NULL)
        return KERNEL_NO_MEMORY;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t offset = (b * num_heads + h * group) * head_dim;
            float *scores = scratch + omp_get_thread_num() * group * max_len;
            const int64_t head_stride = h * num_blocks * block_size * head_dim;
            if (cache_bf16)
                attend(q + offset, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b], window,
                       out + offset, group, head_dim, block_size, head_stride, scale, scores, 1);
            else
                attend(q + offset, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b], window,
                       out + offset, group, head_dim, block_size, head_stride, scale, scores, 0);
        }
    }
    free(scratch);
    return KERNEL_OK;
}
