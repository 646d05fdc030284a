/* Decode attention over the paged, head-major KV cache, fp32, for CPUs.
 *
 * One query token per sequence. Each (sequence, KV head) task reads that head's cached keys and values
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

void attend_one(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t len,
    float *out, int64_t group, int64_t head_dim, int64_t block_size, int64_t head_stride, float scale,
    float *scores)
{
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *k = k_cache + head_stride + slot * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++)
                dot += qg[d] * k[d];
            scores[g * len + t] = dot * scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        float max = -INFINITY;
        for (int64_t t = 0; t < len; t++)
            max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++)
            s[t] *= inv;
        float *o = out + g * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = 0.0f;
    }
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float *v = v_cache + head_stride + slot * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * len + t];
            float *o = out + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                o[d] += p * v[d];
        }
    }
}

/* q, out: [batch, heads, head_dim]; caches: [kv_heads, num_blocks, block_size, head_dim];
 * block_tables: [batch, max_blocks]; seq_lens: [batch], each >= 1. Returns 0, or -1 if out of memory. */
int paged_decode_attention(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
    const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
    int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    float *scratch = malloc(sizeof(float) * num_threads * group * max_len);
    if (scratch == NULL)
        return -1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t offset = (b * num_heads + h * group) * head_dim;
            float *scores = scratch + omp_get_thread_num() * group * max_len;
            attend_one(q + offset, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b],
                       out + offset, group, head_dim, block_size, h * num_blocks * block_size * head_dim,
                       scale, scores);
        }
    }
    free(scratch);
    return 0;
}
