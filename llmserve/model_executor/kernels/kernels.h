/* What the kernels share: GGUF block reading (block_gemv.c) and one (sequence, KV head) of decode
 * attention (paged_attention.c), which decoder_step.c strings together. */
#ifndef LLMSERVE_KERNELS_H
#define LLMSERVE_KERNELS_H

#include <stdint.h>

#define QK 32 /* weights per GGUF block */
#define BLOCK_GEMV_MAX_ROWS 16
enum { Q4_1 = 3, Q8_0 = 8 }; /* GGML type ids */

/* Bytes of one block of this type, or 0 for a type we do not read. */
int64_t block_bytes(int qtype);

/* xsum[r, b] = the sum of x[r]'s block b: the Q4_1 minimum's term. x: [rows, in]. */
void block_sums(const float *x, int64_t rows, int64_t in, float *xsum);

/* acc[r] = x[r] . w for one output row w of in / 32 blocks, for rows <= BLOCK_GEMV_MAX_ROWS. */
void block_gemv_row(const float *x, const float *xsum, int64_t rows, int64_t in, const uint8_t *w, int qtype,
                    float *acc);

/* One sequence's query heads that share KV head `head_stride / (num_blocks * block_size * head_dim)`:
 * q, out [group, head_dim]; scores: scratch of group * len floats. */
void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t len,
                float *out, int64_t group, int64_t head_dim, int64_t block_size, int64_t head_stride, float scale,
                float *scores);

#endif
