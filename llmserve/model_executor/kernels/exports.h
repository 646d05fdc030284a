/* The functions native.py calls through ctypes and only it (kernels.h declares those the kernels share
 * too: row_bytes, round_rows, is_block_type, int8_gemm_available). Every kernel source sees these
 * prototypes (kernels.h includes this), so a definition that differs from its prototype fails to compile;
 * signatures.c exports each exported function's kinds, which the compiler checks against the prototype
 * and native.py against signatures.py's ctypes declaration at load. */
#ifndef LLMSERVE_EXPORTS_H
#define LLMSERVE_EXPORTS_H

#include <stdint.h>

/* dequant.c: the instruction set this library was compiled for, as native.py's ISAS names it. */
const char *kernels_isa(void);

/* layout.c: a struct's size, a field's offset or a constant's value by name, -1 for another name. */
int64_t struct_layout(const char *name);

/* signatures.c: "name: kinds" lines of every function here; see there. */
int64_t kernel_signatures(char *buffer, int64_t size);

/* dequant.c: out [n, k] = rows ids [n] of w [rows, row_bytes(qtype, k)] as fp32. */
int dequantize_rows(const uint8_t *w, int qtype, int64_t k, int64_t rows, const int64_t *ids, int64_t n,
                    float *out, int num_threads);

/* weight_gemm.c: y [m, n] = x [m, k] @ W.T (+ bias). */
int weight_gemm(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int num_threads);

/* block_q8.c: y [rows, out] = x [rows, in], rounded to int8 per block, @ W.T (+ bias), W in GGUF blocks. */
int block_gemv(const float *x, int64_t rows, int64_t in, const Weight *w, int64_t out, float *y, int num_threads);

/* int8_gemm.c: the same as block_gemv for many rows, with AVX-512 VNNI. */
int int8_gemm(const float *x, int64_t rows, int64_t in, const Weight *w, int64_t out, float *y, int num_threads);

/* paged_attention.c: one decode step's attention over the paged caches. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                           const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t max_blocks, int64_t window, int64_t cache_bf16, float scale, int num_threads);

/* prefill_attention.c: one sequence's chunk of queries attending causally to the paged caches. */
int prefill_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                      int64_t table_len, int64_t context_len, int64_t q_len, float *out, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                      int64_t window, int64_t cache_bf16, float scale, int num_threads);

/* decoder_step.c: a decode step through every layer of a DecoderSpec. */
int decoder_step(const DecoderSpec *s, float *x, const int64_t *positions, const int64_t *slots,
                 const int64_t *block_tables, const int64_t *seq_lens, int64_t rows, int64_t max_blocks,
                 float *out, int num_threads);

/* argmax.c: out [rows] = each row's argmax of x [rows, n], as torch.argmax gives it. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);

/* gated_activation.c: h [rows, inter] = act(gate) * up of gate_up [rows, 2 * inter]. */
void gated_activation(const float *gate_up, int64_t rows, int64_t inter, int64_t activation, float *h,
                      int num_threads);

#endif
