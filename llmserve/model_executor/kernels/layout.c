/* The layout of the structs native.py builds with ctypes, and the constants it mirrors, so that it can
 * check its copies when it loads the library: a field that moved, or a value that changed, in one
 * language and not the other would otherwise be read silently from the wrong bytes. */
#include <stddef.h>
#include <string.h>

#include "kernels.h"

#define SIZE(type)          \
    if (!strcmp(name, #type)) \
        return (int64_t)sizeof(type);
#define FIELD(type, field)              \
    if (!strcmp(name, #type "." #field)) \
        return (int64_t)offsetof(type, field);

#define CONSTANT(constant)       \
    if (!strcmp(name, #constant)) \
        return (int64_t)(constant);

/* sizeof(T) for name "T", offsetof(T, f) for "T.f", the value of a constant native.py mirrors, or -1 for
 * a name not passed to Python. */
int64_t struct_layout(const char *name)
{
    SIZE(WeightPart) FIELD(WeightPart, data) FIELD(WeightPart, qtype) FIELD(WeightPart, rows)
    SIZE(Weight) FIELD(Weight, parts) FIELD(Weight, num_parts) FIELD(Weight, bias)
    SIZE(LayerSpec) FIELD(LayerSpec, input_norm) FIELD(LayerSpec, post_norm) FIELD(LayerSpec, q_norm)
    FIELD(LayerSpec, k_norm) FIELD(LayerSpec, attn_out_norm) FIELD(LayerSpec, mlp_out_norm) FIELD(LayerSpec, qkv)
    FIELD(LayerSpec, o) FIELD(LayerSpec, mlp_kind) FIELD(LayerSpec, gate_up) FIELD(LayerSpec, down)
    FIELD(LayerSpec, intermediate) FIELD(LayerSpec, activation) FIELD(LayerSpec, experts)
    FIELD(LayerSpec, router) FIELD(LayerSpec, num_experts) FIELD(LayerSpec, top_k) FIELD(LayerSpec, norm_topk)
    FIELD(LayerSpec, qk_norm_whole) FIELD(LayerSpec, k_cache)
    FIELD(LayerSpec, v_cache) FIELD(LayerSpec, sliding_window) FIELD(LayerSpec, rope_cos) FIELD(LayerSpec, rope_sin)
    SIZE(DecoderSpec) FIELD(DecoderSpec, num_layers) FIELD(DecoderSpec, hidden) FIELD(DecoderSpec, num_heads)
    FIELD(DecoderSpec, num_kv_heads) FIELD(DecoderSpec, head_dim) FIELD(DecoderSpec, intermediate)
    FIELD(DecoderSpec, num_blocks) FIELD(DecoderSpec, block_size) FIELD(DecoderSpec, kv_bf16)
    FIELD(DecoderSpec, int8_activations)
    FIELD(DecoderSpec, block_rows) FIELD(DecoderSpec, rope_positions)
    FIELD(DecoderSpec, eps) FIELD(DecoderSpec, scale) FIELD(DecoderSpec, norm_offset) FIELD(DecoderSpec, layers)
    FIELD(DecoderSpec, final_norm)
    CONSTANT(MLP_GATED) CONSTANT(MLP_EXPERTS) CONSTANT(ACTIVATION_SILU) CONSTANT(ACTIVATION_GELU_TANH) CONSTANT(BLOCK_GEMV_MAX_ROWS)
    CONSTANT(MAX_WEIGHT_PARTS) CONSTANT(QK)
    CONSTANT(KERNEL_OK) CONSTANT(KERNEL_UNSUPPORTED) CONSTANT(KERNEL_NO_MEMORY) CONSTANT(KERNEL_OUT_OF_BOUNDS)
    CONSTANT(F32) CONSTANT(F16) CONSTANT(Q4_0) CONSTANT(Q4_1) CONSTANT(Q5_0) CONSTANT(Q5_1) CONSTANT(Q8_0)
    CONSTANT(Q4_K) CONSTANT(Q5_K) CONSTANT(Q6_K) CONSTANT(BF16)
    return -1;
}
