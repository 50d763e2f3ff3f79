/* A whole decode step of a Llama-family model in one C call: the CPU's counterpart of replaying a
 * CUDA graph.
 *
 * Eager PyTorch runs a decode step as about 400 Python-level calls (norms, projections, rotary and
 * cache writes, attention, activations, per layer), a few microseconds of interpreter and dispatch
 * each: 5-7 ms a step on SmolLM2 whatever the batch, as long as the arithmetic of a batch-1 step.
 * Here the layer loop is C and calls the same kernels the eager step calls (shard/kernels:
 * layer_ops.c, paged_attention.c, bf16_matmul.c, reached through the pointers in `kernels`, each
 * library built on its own), in the same order on the same buffers, so the results are the eager
 * step's bit for bit.
 *
 * Everything is bf16 (activations, the KV cache) but the weights, each projection multiplied by the
 * matmul of its own form (bf16_matmul's packed layout, int4's or int8's groups); rows are
 * contiguous. An int8 KV cache (model_t.kv_int8: int8 rows with a float32 scale each beside them,
 * shard/layers/kv_int8.py) is written and read by the int8 forms of the same two kernels.
 *
 * LoRA adapters (shard/layers/lora.py): where a step has row slots, each projection's output gets
 * its parts' updates (lora.c) right after its matmul, before anything reads it, as the eager
 * linear layers add them.
 */
#include <stdint.h>

typedef void (*rms_norm_fn)(const void *x, const void *residual, void *sum_out,
                            const void *weight, void *out, int64_t rows, int64_t dim, float eps,
                            int bf16);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16);
typedef int (*rotary_store_fn)(const void *qkv, int64_t qkv_stride, const void *cos,
                               const void *sin, int64_t tokens, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int bf16, void *qk_out,
                               void *key_cache, void *value_cache, int cache_bf16,
                               const int64_t *slot_blocks, const int64_t *slot_offsets,
                               int64_t num_blocks, int64_t block_size);
typedef int (*attention_fn)(const void *key_cache, const void *value_cache, int cache_is_bf16,
                            const void *queries, int queries_are_bf16, int64_t query_stride,
                            const int64_t *block_tables, int64_t table_stride,
                            const int64_t *context_lens, int64_t batch, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int64_t window, float softcap, void *out,
                            int out_is_bf16);
typedef int (*rotary_store_int8_fn)(const void *qkv, int64_t qkv_stride, const void *cos,
                                    const void *sin, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int bf16,
                                    void *qk_out, void *key_cache, void *value_cache,
                                    float *key_scales, float *value_scales,
                                    const int64_t *slot_blocks, const int64_t *slot_offsets,
                                    int64_t num_blocks, int64_t block_size);
typedef int (*attention_int8_fn)(const void *key_cache, const void *value_cache,
                                 const float *key_scales, const float *value_scales,
                                 const void *queries, int queries_are_bf16, int64_t query_stride,
                                 const int64_t *block_tables, int64_t table_stride,
                                 const int64_t *context_lens, int64_t batch, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, float softcap, void *out,
                                 int out_is_bf16);
/* every matmul of ours (bf16_matmul.c, int4_matmul.c, int8_matmul.c) takes its weight's own
 * packed form through this one signature */
typedef int (*matmul_fn)(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                         const void *packed, int64_t n, const uint16_t *bias, uint16_t *out,
                         int64_t out_stride);

typedef int (*lora_add_fn)(const uint16_t *x, int64_t rows, int64_t in, int64_t x_stride,
                           const int64_t *row_slots, const uint16_t *a, const uint16_t *bt,
                           const int64_t *ranks, int64_t num_slots, int64_t max_rank,
                           int64_t width, uint16_t *out, int64_t out_stride);

typedef struct {
    rms_norm_fn rms_norm;
    silu_mul_fn silu_mul;
    rotary_store_fn rotary_store;
    attention_fn attention;
    lora_add_fn lora_add;       /* NULL where the LoRA kernel did not build (no step has slots) */
    rotary_store_int8_fn rotary_store_int8; /* the int8 cache's forms (model_t.kv_int8) */
    attention_int8_fn attention_int8;
} kernels_t;

/* the adapters' update of one checkpoint module a projection computes (a LoraPart): a
 * [num_slots, max_rank, in], bt [num_slots, max_rank, width], ranks [num_slots], written to the
 * projection's columns offset .. offset + width; a NULL where there is none */
typedef struct {
    const uint16_t *a, *bt;
    const int64_t *ranks;
    int64_t num_slots, max_rank, offset, width;
} lora_part_t;

/* where each projection's parts sit in layer_t.lora, and how many it may have: q, k, v (or one
 * for a fused checkpoint tensor); o; gate, up (or one); down */
#define LORA_QKV 0
#define LORA_O 3
#define LORA_GATE_UP 4
#define LORA_DOWN 6
#define LORA_PARTS 7

/* a projection: the matmul of its weight's form (bf16, int4 or int8), that form, and its bias
 * (NULL where the model has none) */
typedef struct {
    matmul_fn matmul;
    const void *weight;
    const uint16_t *bias;
} linear_t;

/* one decoder layer's projections and cache */
typedef struct {
    const void *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    lora_part_t lora[LORA_PARTS];
    float *key_scale, *value_scale; /* an int8 cache's scales; NULL otherwise */
} layer_t;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab_rows;
    int64_t num_blocks, block_size;
    float eps, scale;
    const void *final_norm;
    linear_t lm_head;
    const layer_t *layer;
    int64_t kv_int8; /* 1: the KV cache is int8 with scales (layer_t.key_scale, value_scale) */
} model_t;

/* the step's activations, each [batch, width] */
typedef struct {
    void *residual[2], *normed, *qkv, *qk, *attention, *projected, *gate_up, *act;
} buffers_t;

/* x [batch, in] -> out [batch, n] by the projection's own matmul, as the eager step's linear
 * layers multiply; nonzero where a kernel could not allocate its scratch */
static int linear(const linear_t *w, const void *x, int64_t batch, int64_t in, void *out,
                  int64_t n) {
    return w->matmul(x, batch, in, in, w->weight, n, w->bias, out, n);
}

/* a matmul that fails ends the step */
#define LINEAR(...)                                                                                \
    do {                                                                                           \
        if (linear(__VA_ARGS__) != 0)                                                              \
            return -2;                                                                             \
    } while (0)

/* out [batch, n] (a projection's output for x [batch, in]) plus the updates of its parts
 * lora[first .. first + count) for each row's slot; nothing without row slots */
static int add_lora(const kernels_t *k, const lora_part_t *lora, int first, int count,
                    const int64_t *row_slots, const void *x, int64_t batch, int64_t in, void *out,
                    int64_t n) {
    if (!row_slots)
        return 0;
    for (int p = first; p < first + count; p++) {
        const lora_part_t *part = &lora[p];
        if (part->a && k->lora_add(x, batch, in, in, row_slots, part->a, part->bt, part->ranks,
                                   part->num_slots, part->max_rank, part->width,
                                   (uint16_t *)out + part->offset, n) != 0)
            return -2;
    }
    return 0;
}

/* a LoRA update that fails (its scratch) ends the step */
#define LORA(...)                                                                                  \
    do {                                                                                           \
        if (add_lora(k, w->lora, __VA_ARGS__) != 0)                                                \
            return -2;                                                                             \
    } while (0)

/* the residual buffer an add writes to: not the one it reads */
static void *other(const buffers_t *buf, const void *residual) {
    return residual == buf->residual[0] ? buf->residual[1] : buf->residual[0];
}

/* embeds [batch, hidden] -> hidden_out [batch, hidden] (the final norm's output) and logits
 * [batch, vocab_rows]. cos/sin [batch, head_dim] are each token's angles; the new keys and values go
 * to (slot_blocks, slot_offsets); attention reads context_lens[b] tokens through block_tables.
 * row_slots [batch]: each row's LoRA slot (-1: none), or NULL: no LoRA this step.
 * Returns 0, -1 for a KV slot outside the cache (nothing of that layer written), -2 when attention,
 * a matmul or a LoRA update could not allocate its scratch. */
int decode_step(const kernels_t *k, const model_t *m, const buffers_t *buf, int64_t batch,
                const void *embeds, const void *cos, const void *sin, const int64_t *slot_blocks,
                const int64_t *slot_offsets, const int64_t *block_tables, int64_t table_stride,
                const int64_t *context_lens, void *hidden_out, void *logits,
                const int64_t *row_slots) {
    const int64_t d = m->head_dim, qkv_width = (m->heads + 2 * m->kv_heads) * d;
    const int64_t q_width = m->heads * d, qk_width = (m->heads + m->kv_heads) * d;
    const void *hidden = embeds;
    const void *residual = 0;
    for (int64_t l = 0; l < m->layers; l++) {
        const layer_t *w = &m->layer[l];
        void *summed = other(buf, residual);
        if (residual == 0) {
            k->rms_norm(hidden, 0, 0, w->input_norm, buf->normed, batch, m->hidden, m->eps, 1);
            residual = hidden;
        } else {
            k->rms_norm(hidden, residual, summed, w->input_norm, buf->normed, batch, m->hidden,
                        m->eps, 1);
            residual = summed;
        }
        LINEAR(&w->qkv, buf->normed, batch, m->hidden, buf->qkv, qkv_width);
        LORA(LORA_QKV, 3, row_slots, buf->normed, batch, m->hidden, buf->qkv, qkv_width);
        if (m->kv_int8) {
            if (k->rotary_store_int8(buf->qkv, qkv_width, cos, sin, batch, m->heads, m->kv_heads,
                                     d, 1, buf->qk, w->key_cache, w->value_cache, w->key_scale,
                                     w->value_scale, slot_blocks, slot_offsets, m->num_blocks,
                                     m->block_size) != 0)
                return -1;
            if (k->attention_int8(w->key_cache, w->value_cache, w->key_scale, w->value_scale,
                                  buf->qk, 1, qk_width, block_tables, table_stride, context_lens,
                                  batch, m->heads, m->kv_heads, d, m->block_size, m->scale, 0,
                                  0.0f, buf->attention, 1) != 0)
                return -2;
        } else {
            if (k->rotary_store(buf->qkv, qkv_width, cos, sin, batch, m->heads, m->kv_heads, d,
                                1, buf->qk, w->key_cache, w->value_cache, 1, slot_blocks,
                                slot_offsets, m->num_blocks, m->block_size) != 0)
                return -1;
            /* no sliding window, no soft cap: models with either take the eager step */
            if (k->attention(w->key_cache, w->value_cache, 1, buf->qk, 1, qk_width, block_tables,
                             table_stride, context_lens, batch, m->heads, m->kv_heads, d,
                             m->block_size, m->scale, 0, 0.0f, buf->attention, 1) != 0)
                return -2;
        }
        LINEAR(&w->o, buf->attention, batch, q_width, buf->projected, m->hidden);
        LORA(LORA_O, 1, row_slots, buf->attention, batch, q_width, buf->projected, m->hidden);
        summed = other(buf, residual);
        k->rms_norm(buf->projected, residual, summed, w->post_norm, buf->normed, batch, m->hidden,
                    m->eps, 1);
        residual = summed;
        LINEAR(&w->gate_up, buf->normed, batch, m->hidden, buf->gate_up, 2 * m->intermediate);
        LORA(LORA_GATE_UP, 2, row_slots, buf->normed, batch, m->hidden, buf->gate_up,
             2 * m->intermediate);
        k->silu_mul(buf->gate_up, buf->act, batch, m->intermediate, 1);
        LINEAR(&w->down, buf->act, batch, m->intermediate, buf->projected, m->hidden);
        LORA(LORA_DOWN, 1, row_slots, buf->act, batch, m->intermediate, buf->projected, m->hidden);
        hidden = buf->projected;
    }
    void *summed = other(buf, residual);
    if (residual == 0)
        k->rms_norm(hidden, 0, 0, m->final_norm, hidden_out, batch, m->hidden, m->eps, 1);
    else
        k->rms_norm(hidden, residual, summed, m->final_norm, hidden_out, batch, m->hidden, m->eps,
                    1);
    LINEAR(&m->lm_head, hidden_out, batch, m->hidden, logits, m->vocab_rows);
    return 0;
}
