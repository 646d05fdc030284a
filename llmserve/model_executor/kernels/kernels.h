/* What the kernels share: weights in their stored formats (dequant.c, weight_gemm.c), block products of a
 * few rows with int8 activations (block_q8.c) and one (sequence, KV head) of decode attention
 * (paged_attention.c), which decoder_step.c strings together.
 *
 * The library is compiled once per instruction set (see native.py); vec.h says which a build has. */
#ifndef LLMSERVE_KERNELS_H
#define LLMSERVE_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define QK 32 /* weights per block of the legacy GGUF types */
#define QK_K 256 /* weights per super-block of the K types */
#define BLOCK_GEMV_MAX_ROWS 16

/* A layer's MLP as decoder_step.c computes it (LayerSpec.mlp_kind; layers/mlp.py's MLPKind), and its
 * gate's activation (LayerSpec.activation; gated_activation.h). */
enum { MLP_GATED = 0, MLP_EXPERTS = 1 };
enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1 };

/* What the functions native.py calls return: KERNEL_OK, or why they did nothing useful (native.py raises
 * on each by name; structs.py's KernelStatus). */
enum { KERNEL_OK = 0, KERNEL_UNSUPPORTED = -1, KERNEL_NO_MEMORY = -2, KERNEL_OUT_OF_BOUNDS = -3 };

/* GGML type ids of the stored weights we read. */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       BF16 = 30 };

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
#endif
}

/* The bf16 h as a float: its bits are the top half of the float's, so it widens exactly. */
static inline float bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Weights of one stored block: 1 of a float type, 32 of a legacy GGUF type, 256 of a K type. */
static inline int64_t block_weights(int qtype)
{
    if (qtype == F32 || qtype == F16 || qtype == BF16)
        return 1;
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? QK_K : QK;
}

/* Bytes of one stored block (block_weights of them), or 0 for a type we do not read. Inline, so that the
 * kernels specialised per type see constant strides. */
static inline int64_t block_bytes(int qtype)
{
    switch (qtype) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* dequant.c: bytes of a row of k weights of this type, or 0 for a type we do not read or a k that is not
 * whole blocks. */
int64_t row_bytes(int qtype, int64_t k);

/* dst[0:k] = the row's weights as fp32, exactly the values `gguf.quants.dequantize` gives. */
void dequantize_row(int qtype, const uint8_t *src, int64_t k, float *dst);

/* weight_gemm.c: a weight W [n, k] in its stored format, as up to three parts of rows stacked (a fused
 * projection whose checkpoint shards have different types), and an optional bias [n]. */
#define MAX_WEIGHT_PARTS 3
typedef struct {
    const uint8_t *data; /* [rows, row_bytes(qtype, k)] */
    int64_t qtype, rows;
} WeightPart;

typedef struct {
    WeightPart parts[MAX_WEIGHT_PARTS];
    int64_t num_parts;
    const float *bias;
} Weight;

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ y when `accumulate`), for this thread's share of W's rows:
 * called by every thread of a parallel region. */
void weight_gemm_share(const float *x, int64_t m, int64_t k, const Weight *w, float *y, int accumulate);

/* Rows x [rows, in] as block_q8.c reads them: rounded to int8 per block (q [rows, in]), with each block's
 * scale and scale * sum(q) (for the weights' minimums and centres), [rows, in / 32] each. */
typedef struct {
    const float *x, *sums;
    const int8_t *q;
    const float *scales;
    int64_t rows, in;
} BlockInput;

/* The fewest of `out` output rows of w a thread takes at a time in a decode step's product: about
 * SHARE_BYTES of them (`per_output` weight rows each, sized by the first part's type), and no more than
 * every one of `threads` threads gets some. Threads take rows as they finish (OpenMP's guided schedule,
 * the first shares largest), so that one slower core does not keep the others waiting at the barrier,
 * while each share stays one long run of memory for the prefetchers. */
#define SHARE_BYTES (64 << 10)
int64_t share_rows(const Weight *w, int64_t in, int64_t per_output, int64_t out, int threads);

/* Rounds in->x into q, scales and sums, and points `in` at them. */
void prepare_input(BlockInput *in, int8_t *q, float *scales, float *sums);

/* x rounded to int8 per block of 32: q, the blocks' scales, and scale * sum(q) for each. */
void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *q, float *scales, float *sums);

/* x rounded to int8 per block of 32 and back to fp32 (what the int8 blocks multiply), for the products
 * of more rows than the blocks take: out [rows, in]. */
void round_rows(const float *x, int64_t rows, int64_t in, float *out);

/* Whether block_q8.c reads this type: the GGUF block types. */
int is_block_type(int qtype);

/* acc[r] = x[r] . w for one output row w of a block type, in->rows <= BLOCK_GEMV_MAX_ROWS. */
void q8_dot_rows(const BlockInput *in, const uint8_t *w, int qtype, float *acc);

/* Whether every part of W, rows of `in` weights, is in blocks the integer products read. */
int reads_blocks(const Weight *w, int64_t in);

/* Row o of W, rows of `in` weights: its stored bytes, and their type in *qtype. */
const uint8_t *block_row(const Weight *w, int64_t o, int64_t in, int *qtype);

/* int8_gemm.c: rows of x rounded as block_q8.c rounds them, for the products of many rows: codes q + 128
 * [rows, in], scales per 32 [rows, in / 32] and scale * sum(q) per 32, with room (and any values) for
 * rows up to a multiple of INT8_GEMM_ROWS. */
#define INT8_GEMM_ROWS 4
typedef struct {
    const uint8_t *codes;
    const float *scales, *sums;
    int64_t rows, in;
} Int8Rows;

/* Whether this build and CPU have int8_gemm.c's products (AVX-512 VNNI). */
int int8_gemm_available(void);

/* Rounds x [rows, in] into codes, scales and sums as Int8Rows holds them. */
void int8_rows(const float *x, int64_t rows, int64_t in, uint8_t *codes, float *scales, float *sums);

/* Bytes of one thread's scratch for int8_gemm_share with rows of `in` weights. */
int64_t int8_scratch_bytes(int64_t in);

/* y [rows, out] (+)= x @ W.T + bias, W in GGUF blocks (reads_blocks), for this thread's share of W's
 * rows: called by every thread of a parallel region, each with its own scratch. */
void int8_gemm_share(const Int8Rows *x, const Weight *w, int64_t out, float *y, int accumulate, uint8_t *scratch);

/* One sequence's query heads that share KV head `head_stride / (num_blocks * block_size * head_dim)`,
 * attending to its last `window` keys (window <= 0: all `len`), never reading a block before them:
 * q, out [group, head_dim]; scores: scratch of group * min(len, window) floats; caches fp32, or bf16 where
 * `bf16`. */
void attend_one(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                int64_t window, float *out, int64_t group, int64_t head_dim, int64_t block_size,
                int64_t head_stride, float scale, float *scores, int bf16);

/* decoder_step.c's view of a model (native.py mirrors these in ctypes; layout.c exports their layout so
 * that native.py can check its copies at load time). */
typedef struct {
    const float *input_norm, *post_norm;       /* [hidden]: before the attention, before the MLP */
    const float *q_norm, *k_norm;              /* [head_dim]: on each query and key head before RoPE, or NULL
                                                  (or [q_size] and [kv_size]: see qk_norm_whole) */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden]: on the attention's and the MLP's outputs before
                                                  their residual adds, or NULL */
    Weight qkv, o;
    int64_t mlp_kind;                          /* MLP_GATED: down(act(gate) * up); MLP_EXPERTS: top_k of
                                                  num_experts such MLPs per row, chosen by the router */
    Weight gate_up, down;                      /* gate_up: the gate's rows, then the up's */
    int64_t intermediate, activation;          /* the MLP's (each expert's) width; its gate's ACTIVATION_* */
    const Weight *experts;                     /* MLP_EXPERTS: [2 * num_experts], each one's gate_up, down */
    Weight router;                             /* MLP_EXPERTS: [num_experts, hidden] fp32, the routing logits */
    int64_t num_experts, top_k, norm_topk;     /* norm_topk: the k routing weights divided by their sum */
    int64_t qk_norm_whole;                     /* q_norm and k_norm span the whole projections, not heads */
    void *k_cache, *v_cache;                   /* [kv_heads, num_blocks, block_size, head_dim], kv_bf16 */
    int64_t sliding_window;                    /* keys a query sees, its own included; 0: the whole sequence */
    const float *rope_cos, *rope_sin;          /* this layer's tables, [max_positions, head_dim / 2] */
} LayerSpec;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim;
    int64_t intermediate;     /* the widest layer's MLP */
    int64_t num_blocks, block_size;
    int64_t kv_bf16;          /* the caches hold bf16 (--kv-cache-dtype bfloat16), else fp32 */
    int64_t int8_activations; /* round each projection's input as block_q8.c does */
    int64_t block_rows;       /* with int8 activations, steps of up to this many rows go to block_q8.c */
    int64_t rope_positions;   /* rows of every layer's RoPE tables */
    float eps, scale;
    float norm_offset;        /* every norm multiplies by (norm_offset + w): 1 for Gemma, else 0 */
    const LayerSpec *layers;
    const float *final_norm;  /* NULL: the layers are not the model's last; `out` gets the residual stream */
} DecoderSpec;

/* paged_attention.c: whether each of `rows` sequences has a length in [1, max_blocks * block_size] and the
 * blocks its length covers in [0, num_blocks): what attend_one reads. */
int tables_in_bounds(const int64_t *block_tables, const int64_t *seq_lens, int64_t rows, int64_t max_blocks,
                     int64_t num_blocks, int64_t block_size);

#include "exports.h"

#endif
