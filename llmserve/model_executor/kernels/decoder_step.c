/* A decode step of any number of sequences through every decoder layer in one call, for CPUs.
 *
 * At one to a few rows a layer's products take ~1/3 ms, but the same layer written as PyTorch ops is some
 * fifty calls of 2-17 us each: half of a single-stream step went to them. Here the whole stack runs in
 * one OpenMP parallel region, the threads meeting at a barrier after each projection. It computes the
 * layer of layers/decoder_layer.py from the same parts, the optional ones where the LayerSpec has them:
 * RMSNorm -> QKV -> (q/k norms) -> RoPE -> KV write -> paged attention (within the layer's sliding
 * window, if it has one) -> o_proj -> (norm) + residual -> RMSNorm -> MLP -> (norm) + residual, per
 * layer, then the final RMSNorm. The MLP is the layer's kind (LayerSpec.mlp_kind): MLP_GATED, gate/up ->
 * act(gate) * up -> down, or MLP_EXPERTS, a router's top k of such MLPs per row (layers/moe.py: the
 * rows grouped by expert, each chosen expert's rows multiplied together, its outputs added back in
 * expert order, weighted). The plan runs a layer of another kind through its PyTorch forward, between
 * two calls over the layers around it (native_decoder.py).
 *
 * Every projection multiplies its weight in the stored format (weight_gemm.c). With int8 activations
 * (`--quantization gguf|int8|int4`) steps of up to `block_rows` rows multiply the blocks as integers
 * (block_q8.c) instead, split between the threads by output features; larger ones too where the CPU
 * has AVX-512 VNNI (int8_gemm.c), else they round their activations the same way before weight_gemm.c.
 *
 * It computes what the PyTorch path computes (same weights, same fp32 arithmetic, rotate-half RoPE from
 * the same tables, the gate's activation of gated_activation.h), only summing in another order.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gated_activation.h"
#include "kernels.h"

/* out = (offset + weight) * x / rms(x) for each of `rows` rows of n; out may be x. */
static void rms_norm(const float *x, const float *weight, float offset, int64_t rows, int64_t n, float eps,
                     float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++)
            sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            out[r * n + i] = (offset + weight[i]) * (xr[i] * inv);
    }
}

/* Rotate-half RoPE of `heads` heads of one token, in place. */
static void rope(float *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin)
{
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

typedef struct {
    const int64_t *positions, *slots, *block_tables, *seq_lens; /* see decoder_step */
    int64_t rows, max_blocks, max_len;
    int read_blocks;  /* this step's projections go through block_q8.c */
    int int8_gemm;    /* else through int8_gemm.c, else weight_gemm.c */
    float *normed;    /* [rows, max(hidden, q_size)]: the normed residual, then the attention output */
    float *wide;      /* [rows, max(qkv width, intermediate)]: the QKV, then the MLP's hidden */
    float *gate_up;   /* [rows, 2 intermediate] from weight_gemm.c */
    float *out;       /* [rows, hidden]: a projection's output before its norm, where the layer has one */
    BlockInput input; /* whichever feeds the next projection, as the blocks read it */
    float *sums;      /* its int8 scales, then scale * sum(q) per block */
    int8_t *q;        /* its int8 rounding (for int8_gemm.c, q + 128) */
    float *rounded;   /* the same rounding in fp32, for weight_gemm.c */
    Int8Rows gemm_in; /* or for int8_gemm.c, over q, sums and this */
    float *gemm_scales;
    uint8_t *scratch; /* [threads, int8_scratch_bytes(widest)] */
    int64_t scratch_bytes;
    float *scores;    /* [threads, group, max_len] */
    /* MLP_EXPERTS layers: */
    float *logits;    /* [rows, max experts]: the router's */
    float *gathered;  /* [rows, hidden]: the normed rows one expert takes */
    float *moe_sum;   /* [rows, hidden]: the chosen experts' weighted outputs, summed in expert order */
    int64_t *chosen;  /* [rows, max top_k]: each row's experts, best first */
    float *chosen_weight;
    int64_t *members; /* [rows * max top_k]: (row, choice) pairs, grouped by expert */
    int64_t *first;   /* [max experts + 1]: each expert's pairs in members */
} Step;

/* Point the step's input at x [rows, in], as the next projection reads it; by every thread. */
static void feed(const DecoderSpec *s, Step *t, const float *x, int64_t in)
{
    if (t->int8_gemm) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < t->rows; r++)
            int8_rows(x + r * in, 1, in, (uint8_t *)t->q + r * in, t->gemm_scales + r * (in / QK),
                      t->sums + r * (in / QK));
#pragma omp single
        t->gemm_in = (Int8Rows){(const uint8_t *)t->q, t->gemm_scales, t->sums, t->rows, in};
        return;
    }
    if (!t->read_blocks && s->int8_activations) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < t->rows; r++)
            round_rows(x + r * in, 1, in, t->rounded + r * in);
        x = t->rounded;
    }
#pragma omp single
    {
        t->input.x = x;
        t->input.in = in;
        if (t->read_blocks)
            prepare_input(&t->input, t->q, t->sums, t->sums + t->rows * in / QK);
    }
}

/* y [rows, out] (+)= the step's input @ W.T (+ bias) through int8_gemm.c or weight_gemm.c, for this
 * thread's share; every thread waits for the whole product. */
static void product_share(const Weight *p, const Step *t, int64_t out, float *y, int accumulate)
{
    if (t->int8_gemm)
        int8_gemm_share(&t->gemm_in, p, out, y, accumulate, t->scratch + omp_get_thread_num() * t->scratch_bytes);
    else
        weight_gemm_share(t->input.x, t->rows, t->input.in, p, y, accumulate);
#pragma omp barrier
}

/* y[r, o] (+)= x[r] . W[o] + bias[o], y: [rows, out], for this thread's share of the outputs; `accumulate` adds into y. */
static void project(const Weight *p, const Step *t, int64_t out, float *y, int accumulate)
{
    if (!t->read_blocks) {
        product_share(p, t, out, y, accumulate);
        return;
    }
    const BlockInput *x = &t->input;
    const int64_t rows = x->rows, chunk = share_rows(p, x->in, 1, out, omp_get_num_threads());
#pragma omp for schedule(guided, chunk)
    for (int64_t o = 0; o < out; o++) {
        float acc[BLOCK_GEMV_MAX_ROWS];
        int qtype;
        const uint8_t *row = block_row(p, o, x->in, &qtype);
        q8_dot_rows(x, row, qtype, acc);
        for (int64_t r = 0; r < rows; r++) {
            const float v = acc[r] + (p->bias ? p->bias[o] : 0.0f);
            y[r * out + o] = accumulate ? y[r * out + o] + v : v;
        }
    }
}

/* Intermediate features whose activations a decode step computes together: one at a time, a single
 * row's took a whole vector each (9% of a Qwen 0.5B step). */
#define ACT_GROUP 16

/* h = act(gate) * up for this thread's share of the intermediate features (gate and up read together
 * from the blocks, ACT_GROUP features at a time), or of the rows (after weight_gemm.c's product of
 * both). */
static void gate_up_act(const Weight *p, const Step *t, int64_t inter, int64_t activation, float *h)
{
    if (!t->read_blocks) {
        product_share(p, t, 2 * inter, t->gate_up, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < t->rows; r++)
            gated_act(t->gate_up + r * 2 * inter, t->gate_up + r * 2 * inter + inter, inter, activation,
                      h + r * inter);
        return;
    }
    const BlockInput *x = &t->input;
    const int64_t rows = x->rows, groups = (inter + ACT_GROUP - 1) / ACT_GROUP;
    const int64_t chunk = (share_rows(p, x->in, 2, inter, omp_get_num_threads()) + ACT_GROUP - 1) / ACT_GROUP;
#pragma omp for schedule(guided, chunk)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o0 = g * ACT_GROUP, n = inter - o0 < ACT_GROUP ? inter - o0 : ACT_GROUP;
        float gate[ACT_GROUP * BLOCK_GEMV_MAX_ROWS], up[ACT_GROUP * BLOCK_GEMV_MAX_ROWS];
        float act[ACT_GROUP * BLOCK_GEMV_MAX_ROWS];
        for (int64_t j = 0; j < n; j++) {
            float gate_acc[BLOCK_GEMV_MAX_ROWS], up_acc[BLOCK_GEMV_MAX_ROWS];
            int gate_type, up_type;
            const uint8_t *gate_row = block_row(p, o0 + j, x->in, &gate_type);
            const uint8_t *up_row = block_row(p, inter + o0 + j, x->in, &up_type);
            q8_dot_rows(x, gate_row, gate_type, gate_acc);
            q8_dot_rows(x, up_row, up_type, up_acc);
            for (int64_t r = 0; r < rows; r++) {
                gate[r * n + j] = gate_acc[r];
                up[r * n + j] = up_acc[r];
            }
        }
        gated_act(gate, up, rows * n, activation, act);
        for (int64_t r = 0; r < rows; r++)
            memcpy(h + r * inter + o0, act + r * n, sizeof(float) * (size_t)n);
    }
}

/* x rounded to bf16 as PyTorch rounds it: to nearest, ties to even; NaN stays NaN. */
static inline uint16_t bf16_of(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x)
        return 0x7fc0;
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* The q/k norms (where the layer has them) and RoPE on this step's queries and keys, then its keys and
 * values into their cache slots (fp32, or rounded to bf16); rows split between the threads. */
static void rope_and_store(const DecoderSpec *s, const LayerSpec *layer, float *qkv, int64_t rows,
                           const int64_t *positions, const int64_t *slots)
{
    const int64_t half = s->head_dim / 2, q_size = s->num_heads * s->head_dim;
    const int64_t kv_size = s->num_kv_heads * s->head_dim, width = q_size + 2 * kv_size;
    const int64_t head_stride = s->num_blocks * s->block_size * s->head_dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *q = qkv + r * width, *k = q + q_size, *v = k + kv_size;
        const float *cos = layer->rope_cos + positions[r] * half, *sin = layer->rope_sin + positions[r] * half;
        if (layer->q_norm && layer->qk_norm_whole) {
            rms_norm(q, layer->q_norm, s->norm_offset, 1, q_size, s->eps, q);
            rms_norm(k, layer->k_norm, s->norm_offset, 1, kv_size, s->eps, k);
        } else if (layer->q_norm) {
            rms_norm(q, layer->q_norm, s->norm_offset, s->num_heads, s->head_dim, s->eps, q);
            rms_norm(k, layer->k_norm, s->norm_offset, s->num_kv_heads, s->head_dim, s->eps, k);
        }
        rope(q, s->num_heads, s->head_dim, cos, sin);
        rope(k, s->num_kv_heads, s->head_dim, cos, sin);
        for (int64_t h = 0; h < s->num_kv_heads; h++) {
            const int64_t at = h * head_stride + slots[r] * s->head_dim;
            const float *kh = k + h * s->head_dim, *vh = v + h * s->head_dim;
            if (s->kv_bf16)
                for (int64_t d = 0; d < s->head_dim; d++) {
                    ((uint16_t *)layer->k_cache)[at + d] = bf16_of(kh[d]);
                    ((uint16_t *)layer->v_cache)[at + d] = bf16_of(vh[d]);
                }
            else
                for (int64_t d = 0; d < s->head_dim; d++) {
                    ((float *)layer->k_cache)[at + d] = kh[d];
                    ((float *)layer->v_cache)[at + d] = vh[d];
                }
        }
    }
}

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* RMSNorm of each row of x [rows, n] into out, rows split between the threads. */
static void norm_rows(const DecoderSpec *s, const float *x, const float *weight, int64_t rows, int64_t n,
                      float *out)
{
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rms_norm(x + r * n, weight, s->norm_offset, 1, n, s->eps, out + r * n);
}

/* x += p's product of the step's input, or x += norm(that product) where the layer has `norm`. */
static void project_into_residual(const DecoderSpec *s, const Weight *p, Step *t, const float *norm, float *x)
{
    if (!norm) {
        project(p, t, s->hidden, x, 1);
        return;
    }
    project(p, t, s->hidden, t->out, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t->rows; r++) {
        float *out = t->out + r * s->hidden;
        rms_norm(out, norm, s->norm_offset, 1, s->hidden, s->eps, out);
        for (int64_t i = 0; i < s->hidden; i++)
            x[r * s->hidden + i] += out[i];
    }
}

/* Each row's top k experts by router logit (the lower index first among equal ones), with their
 * softmax probabilities over every expert (renormalised over the k where norm_topk), and the
 * (row, choice) pairs grouped by expert; by one thread. */
static void route(const LayerSpec *layer, Step *t)
{
    const int64_t n = layer->num_experts, k = layer->top_k;
    for (int64_t e = 0; e <= n; e++)
        t->first[e] = 0;
    for (int64_t r = 0; r < t->rows; r++) {
        const float *logits = t->logits + r * n;
        int64_t *chosen = t->chosen + r * k;
        float *weight = t->chosen_weight + r * k;
        float max = logits[0];
        for (int64_t e = 1; e < n; e++)
            max = logits[e] > max ? logits[e] : max;
        float total = 0.0f;
        for (int64_t e = 0; e < n; e++)
            total += expf(logits[e] - max);
        for (int64_t j = 0; j < k; j++) { /* the best expert not yet chosen; the lower index among equals */
            int64_t best = -1;
            for (int64_t e = 0; e < n; e++) {
                int64_t taken = 0;
                for (int64_t i = 0; i < j; i++)
                    taken |= chosen[i] == e;
                if (!taken && (best < 0 || logits[e] > logits[best]))
                    best = e;
            }
            chosen[j] = best;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            weight[j] = expf(logits[chosen[j]] - max) / total;
            sum += weight[j];
        }
        if (layer->norm_topk)
            for (int64_t j = 0; j < k; j++)
                weight[j] /= sum;
        for (int64_t j = 0; j < k; j++)
            t->first[chosen[j] + 1]++;
    }
    for (int64_t e = 0; e < n; e++)
        t->first[e + 1] += t->first[e];
    for (int64_t pair = 0; pair < t->rows * k; pair++) /* in row order within each expert; first[e] counts up */
        t->members[t->first[t->chosen[pair]]++] = pair;
    for (int64_t e = n; e > 0; e--) /* back to each expert's start */
        t->first[e] = t->first[e - 1];
    t->first[0] = 0;
}

/* x += the layer's experts on the normed rows (t->normed): the router's choice, then each chosen
 * expert's gated MLP over all the rows that chose it, in expert order; by every thread. */
static void experts_step(const DecoderSpec *s, const LayerSpec *layer, Step *t, float *x)
{
    const int64_t hidden = s->hidden, inter = layer->intermediate, rows = t->rows, k = layer->top_k;
    weight_gemm_share(t->normed, rows, hidden, &layer->router, t->logits, 0);
#pragma omp barrier
#pragma omp single
    route(layer, t);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * hidden; i++)
        t->moe_sum[i] = 0.0f;
    for (int64_t e = 0; e < layer->num_experts; e++) {
        const int64_t begin = t->first[e], count = t->first[e + 1] - begin;
        if (!count)
            continue;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++)
            memcpy(t->gathered + i * hidden, t->normed + t->members[begin + i] / k * hidden,
                   sizeof(float) * (size_t)hidden);
#pragma omp single
        t->rows = t->input.rows = count;
        feed(s, t, t->gathered, hidden);
        gate_up_act(&layer->experts[2 * e], t, inter, layer->activation, t->wide);
        feed(s, t, t->wide, inter);
        project(&layer->experts[2 * e + 1], t, hidden, t->out, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const int64_t pair = t->members[begin + i];
            const float w = t->chosen_weight[pair];
            float *sum = t->moe_sum + pair / k * hidden;
            const float *y = t->out + i * hidden;
            for (int64_t j = 0; j < hidden; j++)
                sum[j] += y[j] * w;
        }
#pragma omp single
        t->rows = t->input.rows = rows;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *out = t->moe_sum + r * hidden;
        if (layer->mlp_out_norm)
            rms_norm(out, layer->mlp_out_norm, s->norm_offset, 1, hidden, s->eps, out);
        for (int64_t j = 0; j < hidden; j++)
            x[r * hidden + j] += out[j];
    }
}

/* One decoder layer; called by every thread of the parallel region. */
static void layer_step(const DecoderSpec *s, const LayerSpec *layer, Step *t, float *x)
{
    const int64_t hidden = s->hidden, inter = layer->intermediate, rows = t->rows;
    const int64_t group = s->num_heads / s->num_kv_heads, q_size = s->num_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * s->num_kv_heads * s->head_dim;
    norm_rows(s, x, layer->input_norm, rows, hidden, t->normed);
    feed(s, t, t->normed, hidden);
    project(&layer->qkv, t, qkv_width, t->wide, 0);
    rope_and_store(s, layer, t->wide, rows, t->positions, t->slots);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < s->num_kv_heads; h++) {
            const int64_t head = h * group * s->head_dim;
            attend_one(t->wide + r * qkv_width + head, layer->k_cache, layer->v_cache,
                       t->block_tables + r * t->max_blocks, t->seq_lens[r], layer->sliding_window,
                       t->normed + r * q_size + head, group, s->head_dim, s->block_size,
                       h * s->num_blocks * s->block_size * s->head_dim, s->scale,
                       t->scores + omp_get_thread_num() * group * t->max_len, (int)s->kv_bf16);
        }
    feed(s, t, t->normed, q_size);
    project_into_residual(s, &layer->o, t, layer->attn_out_norm, x);
    norm_rows(s, x, layer->post_norm, rows, hidden, t->normed);
    if (layer->mlp_kind == MLP_EXPERTS) {
        experts_step(s, layer, t, x);
        return;
    }
    feed(s, t, t->normed, hidden);
    gate_up_act(&layer->gate_up, t, inter, layer->activation, t->wide);
    feed(s, t, t->wide, inter);
    project_into_residual(s, &layer->down, t, layer->mlp_out_norm, x);
}

/* Whether decoder_step computes this layer's MLP at these rows: its kind (with experts, a top k among
 * them), its activation, and, with int8 activations, a width of whole blocks. */
static int mlp_fits(const DecoderSpec *s, const LayerSpec *layer, int int8_inputs)
{
    const int experts = layer->mlp_kind == MLP_EXPERTS && layer->experts && layer->num_experts >= 1 &&
                        layer->top_k >= 1 && layer->top_k <= layer->num_experts;
    return (layer->mlp_kind == MLP_GATED || experts) && layer->intermediate >= 1 &&
           layer->intermediate <= s->intermediate &&
           (layer->activation == ACTIVATION_SILU || layer->activation == ACTIVATION_GELU_TANH) &&
           !(int8_inputs && layer->intermediate % QK);
}

/* x: [rows, hidden], the embedded tokens (or the residual stream after the layers before these), used as
 * the residual stream (overwritten); out: [rows, hidden] after the final norm, or the residual stream
 * where the spec has none. positions, slots, seq_lens: [rows]; block_tables: [rows, max_blocks].
 * Returns KERNEL_OK, KERNEL_UNSUPPORTED for a shape it cannot take, KERNEL_NO_MEMORY, or
 * KERNEL_OUT_OF_BOUNDS for a position, slot, length or block id out of bounds. */
int decoder_step(const DecoderSpec *s, float *x, const int64_t *positions, const int64_t *slots,
                 const int64_t *block_tables, const int64_t *seq_lens, int64_t rows, int64_t max_blocks,
                 float *out, int num_threads)
{
    const int read_blocks = s->int8_activations && rows <= s->block_rows;
    if (rows < 1 || (read_blocks && rows > BLOCK_GEMV_MAX_ROWS) || (s->int8_activations && s->hidden % QK))
        return KERNEL_UNSUPPORTED;
    for (int64_t l = 0; l < s->num_layers; l++)
        if (!mlp_fits(s, &s->layers[l], (int)s->int8_activations))
            return KERNEL_UNSUPPORTED;
    if (!tables_in_bounds(block_tables, seq_lens, rows, max_blocks, s->num_blocks, s->block_size))
        return KERNEL_OUT_OF_BOUNDS;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= s->rope_positions || slots[r] < 0 ||
            slots[r] >= s->num_blocks * s->block_size)
            return KERNEL_OUT_OF_BOUNDS;
    const int64_t q_size = s->num_heads * s->head_dim, group = s->num_heads / s->num_kv_heads;
    const int64_t wide = max64(q_size + 2 * s->num_kv_heads * s->head_dim, s->intermediate);
    const int64_t narrow = max64(s->hidden, q_size);
    const int64_t widest = max64(narrow, wide);
    Step t = {.positions = positions, .slots = slots, .block_tables = block_tables, .seq_lens = seq_lens,
              .rows = rows, .max_blocks = max_blocks, .max_len = 1, .read_blocks = read_blocks,
              .int8_gemm = s->int8_activations && !read_blocks && int8_gemm_available(),
              .input = {.rows = rows}};
    for (int64_t r = 0; r < rows; r++)
        t.max_len = max64(t.max_len, seq_lens[r]);
    int64_t experts = 0, top_k = 0; /* the most of any layer, for MLP_EXPERTS layers' buffers */
    for (int64_t l = 0; l < s->num_layers; l++)
        if (s->layers[l].mlp_kind == MLP_EXPERTS) {
            experts = max64(experts, s->layers[l].num_experts);
            top_k = max64(top_k, s->layers[l].top_k);
        }
    t.normed = malloc(sizeof(float) * rows * narrow);
    t.wide = malloc(sizeof(float) * rows * wide);
    t.scores = malloc(sizeof(float) * num_threads * group * t.max_len);
    t.out = malloc(sizeof(float) * rows * s->hidden);
    int ready = t.normed && t.wide && t.scores && t.out;
    if (experts) {
        t.logits = malloc(sizeof(float) * rows * experts);
        t.gathered = malloc(sizeof(float) * rows * s->hidden);
        t.moe_sum = malloc(sizeof(float) * rows * s->hidden);
        t.chosen = malloc(sizeof(int64_t) * rows * top_k);
        t.chosen_weight = malloc(sizeof(float) * rows * top_k);
        t.members = malloc(sizeof(int64_t) * rows * top_k);
        t.first = malloc(sizeof(int64_t) * (experts + 1));
        ready = ready && t.logits && t.gathered && t.moe_sum && t.chosen && t.chosen_weight && t.members &&
                t.first;
    }
    if (read_blocks) {
        t.sums = malloc(sizeof(float) * rows * widest / QK * 2);
        t.q = malloc((size_t)(rows * widest));
        ready = ready && t.sums && t.q;
    } else {
        t.gate_up = malloc(sizeof(float) * rows * 2 * s->intermediate);
        ready = ready && t.gate_up;
    }
    if (t.int8_gemm) {
        const int64_t padded = (rows + INT8_GEMM_ROWS - 1) / INT8_GEMM_ROWS * INT8_GEMM_ROWS;
        t.q = calloc((size_t)(padded * widest), 1);
        t.gemm_scales = calloc((size_t)(padded * widest / QK), sizeof(float));
        t.sums = calloc((size_t)(padded * widest / QK), sizeof(float));
        t.scratch_bytes = int8_scratch_bytes(widest);
        t.scratch = aligned_alloc(64, (size_t)(num_threads * t.scratch_bytes));
        ready = ready && t.q && t.gemm_scales && t.sums && t.scratch;
    } else if (!read_blocks && s->int8_activations) {
        t.rounded = malloc(sizeof(float) * rows * widest);
        ready = ready && t.rounded;
    }
    if (ready) {
#pragma omp parallel num_threads(num_threads)
        for (int64_t l = 0; l < s->num_layers; l++)
            layer_step(s, &s->layers[l], &t, x);
        if (s->final_norm)
            rms_norm(x, s->final_norm, s->norm_offset, rows, s->hidden, s->eps, out);
        else
            memcpy(out, x, sizeof(float) * (size_t)(rows * s->hidden));
    }
    free(t.normed);
    free(t.wide);
    free(t.scores);
    free(t.out);
    free(t.sums);
    free(t.q);
    free(t.gate_up);
    free(t.rounded);
    free(t.gemm_scales);
    free(t.scratch);
    free(t.logits);
    free(t.gathered);
    free(t.moe_sum);
    free(t.chosen);
    free(t.chosen_weight);
    free(t.members);
    free(t.first);
    return ready ? KERNEL_OK : KERNEL_NO_MEMORY;
}
