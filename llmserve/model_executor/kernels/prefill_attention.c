/* Prefill attention: one sequence's chunk of queries against its keys in the paged KV cache, fp32 or bf16,
 * causal and within a sliding window, for CPUs. A bf16 cache's values widen exactly to fp32, in which
 * everything is computed.
 *
 * PyTorch's flash attention (scaled_dot_product_attention, one call per sequence) multiplies blocks
 * through MKL, packing them at every call, a large share of a prefill's time. Here the products are register tiles in the layout
 * that needs no reduction: each (KV head, run of query positions) task holds the rows of all the query
 * heads that share the head (grouped-query attention), its scores MR rows x KV_VECTORS vectors of keys,
 * from keys transposed once per call (KT, phase one); its output MR rows x KV_VECTORS vectors of
 * head_dim, from the values read in place through the block table. The softmax runs online over chunks
 * of KC keys (flash attention's rescaling), so a task's scores never exceed one chunk per row.
 *
 * The query at position p sees the keys at (p - window, p] (all up to p without a window); a chunk's
 * scores outside a row's keys weigh 0, and no key before the first one any query sees is read (behind a
 * window the KV cache manager may have freed and reused those blocks), nor any past the last.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_exp.h"

#ifdef USE_AVX512 /* rows of a register tile */
#define MR 6
#else
#define MR 3
#endif
#define KV_VECTORS 4           /* vectors of keys (or of head_dim) per register tile */
#define KC (KV_VECTORS * VL)   /* keys per chunk of the online softmax */
#define TASK_ROWS 48           /* query rows a task aims at: its positions times the group's heads */

typedef int32_t vi __attribute__((vector_size(VL * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));

/* VL values of a cache row from element i: fp32, or bf16 (a constant after inlining) widened exactly (a
 * bf16's bits are the top half of the fp32's). */
static inline vf cache_load(const void *row, int64_t i, int bf16)
{
    if (!bf16)
        return vload((const float *)row + i);
    vh h;
    memcpy(&h, (const uint16_t *)row + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline float cache_value(const void *row, int64_t i, int bf16)
{
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void vstore(float *p, vf v)
{
    memcpy(p, &v, sizeof v);
}

static inline vf broadcast(float x)
{
#if VL == 16
    return (vf)_mm512_set1_ps(x);
#elif VL == 8
    return (vf)_mm256_set1_ps(x);
#else
    vf v;
    for (int i = 0; i < VL; i++)
        v[i] = x;
    return v;
#endif
}

static inline vf vmax(vf a, vf b)
{
    const vi greater = a > b;
    return (vf)(((vi)a & greater) | ((vi)b & ~greater));
}

static inline vf vexp(vf x)
{
#if VL == 16
    return (vf)exp16((__m512)x);
#elif VL == 8
    return (vf)exp8((__m256)x);
#else
    vf y;
    for (int i = 0; i < VL; i++)
        y[i] = expf(x[i] < EXP_LOW ? EXP_LOW : x[i] > EXP_HIGH ? EXP_HIGH : x[i]);
    return y;
#endif
}

typedef struct {
    const float *q;      /* [q_len, num_heads, head_dim] */
    const void *v_cache; /* [kv_heads, num_blocks, block_size, head_dim], fp32 or bf16 */
    const int64_t *table;
    const float *kt;     /* [kv_heads, keys / KC, head_dim, KC]: the keys from `start` by chunks, each
                          * transposed (contiguous, so that a tile's loads do not collide in L1), zero
                          * past the last */
    float *out;
    int64_t num_heads, group, head_dim, num_blocks, block_size;
    int64_t context_len, start, keys, window;
    float scale;
    int bf16; /* the caches' values */
} Call;

/* The first key the query at position p sees: p - window + 1, or 0 (window <= 0: all of them). */
static inline int64_t first_seen(int64_t p, int64_t window)
{
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* The cache slot of the key at position t. */
static inline int64_t slot(const Call *c, int64_t t)
{
    return c->table[t / c->block_size] * c->block_size + t % c->block_size;
}

/* Scores s[r][0..KC) = scale * q_r . k for a chunk's keys (kt: its [head_dim, KC] transpose), for
 * `rows` <= MR rows (a constant after inlining). */
static inline void score_tile(const float *const *qr, int rows, const float *kt, int64_t head_dim,
                              float scale, float *s)
{
    vf acc[MR][KV_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < KV_VECTORS; v++)
            acc[r][v] = (vf){0};
    for (int64_t d = 0; d < head_dim; d++) {
        vf k[KV_VECTORS];
        for (int v = 0; v < KV_VECTORS; v++)
            k[v] = vload(kt + d * KC + v * VL);
        for (int r = 0; r < rows; r++) {
            const vf b = broadcast(qr[r][d]);
            for (int v = 0; v < KV_VECTORS; v++)
                acc[r][v] += b * k[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < KV_VECTORS; v++)
            vstore(s + r * KC + v * VL, acc[r][v] * scale);
}

/* o[r][d0..d0 + nv VL) += the sum over t in [t0, t1) of p[r][t] * values[t][d0..], for `rows` <= MR rows
 * and nv <= KV_VECTORS vectors of head_dim (hd values a row), both constants after inlining (the
 * accumulators then live in registers); bf16 too is a constant after inlining. */
static inline void value_tile(const void *const *values, int rows, int nv, int64_t hd, int64_t d0,
                              int64_t t0, int64_t t1, const float *p, float *o, int bf16)
{
    vf acc[MR][KV_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = vload(o + r * hd + d0 + v * VL);
    for (int64_t t = t0; t < t1; t++) {
        vf val[KV_VECTORS];
        for (int v = 0; v < nv; v++)
            val[v] = cache_load(values[t], d0 + v * VL, bf16);
        for (int r = 0; r < rows; r++) {
            const vf w = broadcast(p[r * KC + t]);
            for (int v = 0; v < nv; v++)
                acc[r][v] += w * val[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            vstore(o + r * hd + d0 + v * VL, acc[r][v]);
}

#define ROWS_CASE(R, CALL) \
    case R: CALL; break;
/* CALL with its row count `rows` made the constant R, for R = 1 .. MR. */
#if MR == 6
#define BY_ROWS(rows, CALL) \
    switch (rows) { ROWS_CASE(6, CALL(6)) ROWS_CASE(5, CALL(5)) ROWS_CASE(4, CALL(4)) ROWS_CASE(3, CALL(3)) \
                    ROWS_CASE(2, CALL(2)) default: CALL(1); }
#else
#define BY_ROWS(rows, CALL) \
    switch (rows) { ROWS_CASE(3, CALL(3)) ROWS_CASE(2, CALL(2)) default: CALL(1); }
#endif

/* The task of KV head h and query positions [i0, i1): rows (i - i0) * group + g. s: [rows, KC], o: [rows,
 * head_dim], m, l: [rows]. bf16: c->bf16, a constant after inlining. */
static inline __attribute__((always_inline)) void task(const Call *c, int64_t h, int64_t i0, int64_t i1,
                                                       float *s, float *o, float *m, float *l, int bf16)
{
    const int64_t hd = c->head_dim, rows = (i1 - i0) * c->group;
    const float *qr[rows];
    for (int64_t r = 0; r < rows; r++) {
        qr[r] = c->q + ((i0 + r / c->group) * c->num_heads + h * c->group + r % c->group) * hd;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(o + r * hd, 0, sizeof(float) * (size_t)hd);
    }
    const char *head = (const char *)c->v_cache + h * c->num_blocks * c->block_size * hd * (bf16 ? 2 : 4);
    const void *values[KC]; /* the chunk's value rows */
    /* the keys these rows see: position p sees (p - window, p] */
    const int64_t p_first = c->context_len + i0, p_last = c->context_len + i1 - 1;
    const int64_t lo_first = first_seen(p_first, c->window), lo_last = first_seen(p_last, c->window);
    for (int64_t j0 = (lo_first - c->start) / KC * KC; c->start + j0 <= p_last; j0 += KC) {
        const int64_t t0 = c->start + j0; /* the chunk's first key's position */
        const int64_t u0 = t0 > lo_first ? t0 : lo_first, u1 = t0 + KC - 1 < p_last ? t0 + KC : p_last + 1;
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const int n = rows - r0 < MR ? (int)(rows - r0) : MR;
#define SCORES(R) score_tile(qr + r0, R, c->kt + (h * c->keys + j0) * hd, hd, c->scale, s + r0 * KC)
            BY_ROWS(n, SCORES)
#undef SCORES
        }
        const int whole = t0 >= lo_last && t0 + KC - 1 <= p_first; /* every row sees every key */
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * KC;
            if (!whole) {
                const int64_t p = c->context_len + i0 + r / c->group;
                const int64_t lo = first_seen(p, c->window);
                for (int64_t t = 0; t < KC; t++)
                    if (t0 + t < lo || t0 + t > p)
                        sr[t] = -INFINITY;
            }
            vf mv = vload(sr);
            for (int v = 1; v < KV_VECTORS; v++)
                mv = vmax(mv, vload(sr + v * VL));
            float top = m[r];
            for (int i = 0; i < VL; i++)
                top = mv[i] > top ? mv[i] : top;
            if (top == -INFINITY) { /* none of this row's keys yet */
                memset(sr, 0, sizeof(float) * KC);
                continue;
            }
            const float rescale = expf(m[r] - top); /* 0 for the row's first keys */
            m[r] = top;
            const vf unseen = (vf){0} - INFINITY;
            vf sum = {0};
            for (int v = 0; v < KV_VECTORS; v++) {
                const vf x = vload(sr + v * VL);
                const vi seen = x > unseen;
                const vf e = (vf)((vi)vexp(x - top) & seen);
                vstore(sr + v * VL, e);
                sum += e;
            }
            float total = 0.0f;
            for (int i = 0; i < VL; i++)
                total += sum[i];
            l[r] = l[r] * rescale + total;
            if (rescale != 1.0f)
                for (int64_t d = 0; d < hd; d++)
                    o[r * hd + d] *= rescale;
        }
        for (int64_t t = u0; t < u1; t++)
            values[t - t0] = head + slot(c, t) * hd * (bf16 ? 2 : 4);
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const int n = rows - r0 < MR ? (int)(rows - r0) : MR;
            for (int64_t d0 = 0; d0 < hd; d0 += KV_VECTORS * VL) {
                const int nv = hd - d0 < KV_VECTORS * VL ? (int)((hd - d0) / VL) : KV_VECTORS;
#define VALUES(R) value_tile(values, R, KV_VECTORS, hd, d0, u0 - t0, u1 - t0, s + r0 * KC, o + r0 * hd, bf16)
#define VALUES_PART(R) value_tile(values, R, nv, hd, d0, u0 - t0, u1 - t0, s + r0 * KC, o + r0 * hd, bf16)
                if (nv == KV_VECTORS)
                    BY_ROWS(n, VALUES)
                else /* the last of a head_dim not a multiple of KV_VECTORS vectors */
                    VALUES_PART(n);
#undef VALUES_PART
#undef VALUES
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inverse = 1.0f / l[r];
        float *dst = c->out + ((i0 + r / c->group) * c->num_heads + h * c->group + r % c->group) * hd;
        for (int64_t d = 0; d < hd; d++)
            dst[d] = o[r * hd + d] * inverse;
    }
}

static void task_f32(const Call *c, int64_t h, int64_t i0, int64_t i1, float *s, float *o, float *m,
                     float *l)
{
    task(c, h, i0, i1, s, o, m, l, 0);
}

static void task_bf16(const Call *c, int64_t h, int64_t i0, int64_t i1, float *s, float *o, float *m,
                      float *l)
{
    task(c, h, i0, i1, s, o, m, l, 1);
}

/* out [q_len, num_heads, head_dim] = attention of q (the same shape, fp32), the queries at positions
 * context_len .. context_len + q_len - 1, over the sequence's keys and values in the caches [kv_heads,
 * num_blocks, block_size, head_dim], fp32 or with `cache_bf16` bf16, through its block table of table_len
 * ids (this step's keys already written). window: the keys each query sees, its own included (<= 0:
 * all). Returns KERNEL_OK; KERNEL_UNSUPPORTED where head_dim is not a multiple of the build's vectors
 * (the caller then takes another path); KERNEL_OUT_OF_BOUNDS where the table does not cover the positions
 * read or holds an id out of bounds; KERNEL_NO_MEMORY. */
int prefill_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                      int64_t table_len, int64_t context_len, int64_t q_len, float *out, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                      int64_t window, int64_t cache_bf16, float scale, int num_threads)
{
    if (head_dim % VL != 0 || num_heads % num_kv_heads != 0)
        return KERNEL_UNSUPPORTED;
    const int64_t group = num_heads / num_kv_heads, total = context_len + q_len;
    const int64_t start = first_seen(context_len, window); /* the first query's */
    if (q_len < 1 || context_len < 0 || (total - 1) / block_size >= table_len)
        return KERNEL_OUT_OF_BOUNDS;
    for (int64_t b = start / block_size; b <= (total - 1) / block_size; b++)
        if (table[b] < 0 || table[b] >= num_blocks)
            return KERNEL_OUT_OF_BOUNDS;
    const int64_t keys = (total - start + KC - 1) / KC * KC;
    const int64_t positions = TASK_ROWS / group > 0 ? TASK_ROWS / group : 1; /* per task */
    const int64_t runs = (q_len + positions - 1) / positions, rows = positions * group;
    float *kt = malloc(sizeof(float) * (size_t)(num_kv_heads * head_dim * keys));
    const int64_t per_thread = rows * (KC + head_dim + 2);
    float *scratch = malloc(sizeof(float) * (size_t)(num_threads * per_thread));
    const int status = kt && scratch ? KERNEL_OK : KERNEL_NO_MEMORY;
    if (status == KERNEL_OK) {
        const Call c = {q, v_cache, table, kt, out, num_heads, group, head_dim, num_blocks, block_size,
                        context_len, start, keys, window, scale, cache_bf16 != 0};
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for collapse(2) schedule(static)
            for (int64_t h = 0; h < num_kv_heads; h++)
                for (int64_t j0 = 0; j0 < keys; j0 += KC) {
                    float *chunk = kt + (h * keys + j0) * head_dim;
                    for (int64_t j = 0; j < KC; j++) {
                        const int64_t t = start + j0 + j;
                        if (t >= total) {
                            for (int64_t d = 0; d < head_dim; d++)
                                chunk[d * KC + j] = 0.0f;
                            continue;
                        }
                        const int64_t at = (h * num_blocks * block_size + slot(&c, t)) * head_dim;
                        for (int64_t d = 0; d < head_dim; d++)
                            chunk[d * KC + j] = cache_value(k_cache, at + d, c.bf16);
                    }
                }
            float *mine = scratch + omp_get_thread_num() * per_thread;
            /* the last positions, which see the most keys, first */
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t run = runs - 1; run >= 0; run--)
                for (int64_t h = 0; h < num_kv_heads; h++) {
                    const int64_t i0 = run * positions, i1 = i0 + positions < q_len ? i0 + positions : q_len;
                    float *o = mine + rows * KC, *m = o + rows * head_dim, *l = m + rows;
                    (c.bf16 ? task_bf16 : task_f32)(&c, h, i0, i1, mine, o, m, l);
                }
        }
    }
    free(kt);
    free(scratch);
    return status;
}
