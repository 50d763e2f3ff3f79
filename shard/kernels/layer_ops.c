/* The element-wise steps of a decoder layer, each fused into one pass over its rows.
 *
 * In PyTorch eager each of these is several ops (an RMS norm is eight: widen, square, mean, add,
 * rsqrt, multiply, narrow, scale), each a dispatch of a few microseconds and, on a prefill's
 * thousands of rows, a pass over memory of its own. Here each is one call and one pass.
 *
 * The results follow PyTorch's op by op: a bf16 tensor is read as float32, every op computes in
 * float32 and rounds its result to bf16 (to nearest, ties to even) where PyTorch's op would store
 * a bf16 tensor. Only the order of a row's sum of squares and the exponential's last bits differ,
 * which moves a bf16 result by one unit in rare elements.
 *
 * Tensors are contiguous rows of float32 or bf16 (`bf16` says which; a layer's activations, norm
 * weights and rotary tables share one dtype; the KV cache has its own). The code is plain C that
 * compilers vectorize (`omp simd`, with -fno-trapping-math for the exponential's selects), for AVX2,
 * AVX-512 and ARM alike; large calls (a prefill) split their rows over PyTorch's OpenMP threads,
 * small ones (a decode step) run on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* elements below which a call stays on one thread: waking the others costs more than it saves */
#define PARALLEL_MIN_ELEMENTS (1 << 15)

static inline __attribute__((always_inline)) float load(const void *data, int64_t at,
                                                        const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)data)[at]) : ((const float *)data)[at];
}

static inline __attribute__((always_inline)) void store(void *data, int64_t at, float value,
                                                        const int bf16) {
    if (bf16)
        ((uint16_t *)data)[at] = float_to_bf16(value);
    else
        ((float *)data)[at] = value;
}

/* the value a float becomes once stored in the tensor's dtype */
static inline __attribute__((always_inline)) float narrow(float value, const int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(value)) : value;
}

/* exp(x) in float32 for vector lanes (Cephes' range reduction and polynomial, within 2 ulp of
 * expf), 0 below -87.3 (where expf is 1e-38 or less: nothing these ops add it to notices) and
 * infinite above ln(FLT_MAX), as expf. Branch-free, so that loops calling it vectorize. */
static inline __attribute__((always_inline)) float exp_lane(float x) {
    const float clamped = x < -87.3f ? -87.3f : x > 88.72f ? 88.72f : x;
    /* n = x / ln2 rounded to an integer: adding 1.5 * 2^23 pushes the fraction out of the float */
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n as 2^(n - 1) * 2 at the top (n reaches 128 there, past the float exponent) */
    const int32_t top = n > 127.0f;
    uint32_t bits = (uint32_t)((int32_t)n - top + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float value = p * scale * (top ? 2.0f : 1.0f);
    return x < -87.3f ? 0.0f : x > 88.7228f ? INFINITY : value;
}

/* ---- RMS norm, with the residual add before it ------------------------------------------- */

/* One row; `bf16` is a literal at every call, so each dtype's loops are compiled (and vectorized)
 * apart. */
static inline __attribute__((always_inline)) void
rms_norm_row(const void *x, const void *residual, void *sum_out, const void *weight, void *out,
             int64_t base, int64_t dim, float eps, const int bf16) {
    const void *h = x;
    float squares = 0.0f;
    if (residual) {
        /* h = x + residual, stored as PyTorch's add stores it */
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; d++) {
            float value = narrow(load(x, base + d, bf16) + load(residual, base + d, bf16), bf16);
            store(sum_out, base + d, value, bf16);
            squares += value * value;
        }
        h = sum_out;
    } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; d++) {
            float value = load(x, base + d, bf16);
            squares += value * value;
        }
    }
    const float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) {
        float normed = narrow(load(h, base + d, bf16) * inverse, bf16);
        store(out, base + d, load(weight, d, bf16) * normed, bf16);
    }
}

/* out = weight * (h / rms(h)) for every row h of x, or of x + residual when residual is not NULL
 * (then written to sum_out: the residual stream the next layer continues from). */
void rms_norm(const void *x, const void *residual, void *sum_out, const void *weight, void *out,
              int64_t rows, int64_t dim, float eps, int bf16) {
    const int parallel = rows * dim >= PARALLEL_MIN_ELEMENTS;
    if (bf16) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; r++)
            rms_norm_row(x, residual, sum_out, weight, out, r * dim, dim, eps, 1);
    } else {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; r++)
            rms_norm_row(x, residual, sum_out, weight, out, r * dim, dim, eps, 0);
    }
}

/* ---- SiLU(gate) * up ----------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void
silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t width, const int bf16) {
    const int64_t in = r * 2 * width, at = r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        float gate = load(gate_up, in + i, bf16);
        float silu = narrow(gate / (1.0f + exp_lane(-gate)), bf16);
        store(out, at + i, silu * load(gate_up, in + width + i, bf16), bf16);
    }
}

/* out [rows, width] = silu(gate) * up, gate_up [rows, 2 * width] holding gate then up per row */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    const int parallel = rows * width >= PARALLEL_MIN_ELEMENTS;
    if (bf16) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, out, r, width, 1);
    } else {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, out, r, width, 0);
    }
}

/* ---- Rotary embedding of queries and keys; keys and values into the paged cache ----------- */

/* One head of `dim` values rotated (Hugging Face's layout: the halves are the real and imaginary
 * parts; sin's first half is negated in the table): x cos + roll(x, dim / 2) sin, rounded as
 * PyTorch's multiply then add-multiply round. */
static inline __attribute__((always_inline)) void
rotate_head(const void *x, int64_t at, const void *cos, const void *sin, int64_t angle_at,
            int64_t dim, void *out, int64_t out_at, const int bf16) {
    const int64_t half = dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float direct = narrow(load(x, at + i, bf16) * load(cos, angle_at + i, bf16), bf16);
        store(out, out_at + i,
              direct + load(x, at + i + half, bf16) * load(sin, angle_at + i, bf16), bf16);
    }
#pragma omp simd
    for (int64_t i = half; i < dim; i++) {
        float direct = narrow(load(x, at + i, bf16) * load(cos, angle_at + i, bf16), bf16);
        store(out, out_at + i,
              direct + load(x, at + i - half, bf16) * load(sin, angle_at + i, bf16), bf16);
    }
}

/* `dim` values of a tensor of one dtype copied into a cache row of another */
static inline __attribute__((always_inline)) void
copy_row(const void *src, int64_t at, void *cache, int64_t cache_at, int64_t dim, const int bf16,
         const int cache_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < dim; i++)
        store(cache, cache_at + i, load(src, at + i, bf16), cache_bf16);
}

static inline __attribute__((always_inline)) void
rotary_store_token(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                   int64_t t, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   void *qk_out, void *key_cache, void *value_cache, const int64_t *slot_blocks,
                   const int64_t *slot_offsets, int64_t block_size, const int bf16,
                   const int cache_bf16) {
    const int64_t rotated = num_heads + num_kv_heads;
    const int64_t row = t * qkv_stride, angle_at = t * head_dim;
    for (int64_t h = 0; h < rotated; h++)
        rotate_head(qkv, row + h * head_dim, cos, sin, angle_at, head_dim, qk_out,
                    (t * rotated + h) * head_dim, bf16);
    for (int64_t h = 0; h < num_kv_heads; h++) {
        /* cache [blocks, kv_heads, block_size, head_dim] */
        const int64_t slot = ((slot_blocks[t] * num_kv_heads + h) * block_size + slot_offsets[t])
                             * head_dim;
        copy_row(qk_out, (t * rotated + num_heads + h) * head_dim, key_cache, slot, head_dim, bf16,
                 cache_bf16);
        copy_row(qkv, row + (rotated + h) * head_dim, value_cache, slot, head_dim, bf16,
                 cache_bf16);
    }
}

/* qkv [tokens, qkv_stride]: each token's query heads, key heads and value heads side by side;
 * cos/sin [tokens, head_dim]: its position's angles. Writes the rotated queries and keys to
 * qk_out [tokens, num_heads + num_kv_heads, head_dim] and the keys and values to their cache
 * slots (slot_blocks[t], slot_offsets[t]) of key_cache/value_cache
 * [num_blocks, num_kv_heads, block_size, head_dim]. Returns 0, or -1 (nothing written) when a
 * slot lies outside the cache. */
int rotary_store(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                 int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int bf16, void *qk_out, void *key_cache, void *value_cache, int cache_bf16,
                 const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_blocks,
                 int64_t block_size) {
    /* the cache is written through raw offsets: a slot outside it must not be */
    for (int64_t t = 0; t < tokens; t++)
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks || slot_offsets[t] < 0
            || slot_offsets[t] >= block_size)
            return -1;
    const int parallel = tokens * qkv_stride >= PARALLEL_MIN_ELEMENTS;
#define ROTARY_STORE(B, C)                                                                        \
    do {                                                                                          \
        _Pragma("omp parallel for schedule(static) if (parallel)")                                \
        for (int64_t t = 0; t < tokens; t++)                                                      \
            rotary_store_token(qkv, qkv_stride, cos, sin, t, num_heads, num_kv_heads, head_dim,   \
                               qk_out, key_cache, value_cache, slot_blocks, slot_offsets,         \
                               block_size, B, C);                                                 \
    } while (0)
    if (bf16 && cache_bf16)
        ROTARY_STORE(1, 1);
    else if (bf16)
        ROTARY_STORE(1, 0);
    else if (cache_bf16)
        ROTARY_STORE(0, 1);
    else
        ROTARY_STORE(0, 0);
#undef ROTARY_STORE
    return 0;
}

/* `dim` values of a tensor as an int8 cache row with its scale (shard/layers/kv_int8.py): the
 * scale max|x| / 127, each value divided by it and rounded to nearest even, as quantize_rows does
 * in PyTorch (the same float32 operations, so the same bytes) */
static inline __attribute__((always_inline)) void
quantize_row(const void *src, int64_t at, int8_t *cache, int64_t cache_at, float *scales,
             int64_t scale_at, int64_t dim, const int bf16) {
    float top = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < dim; i++) {
        const float magnitude = fabsf(load(src, at + i, bf16));
        top = magnitude > top ? magnitude : top;
    }
    const float scale = top / 127.0f;
    const float divisor = scale > 0.0f ? scale : 1.0f; /* a zero row stays zeros */
    scales[scale_at] = scale;
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        float r = rintf(load(src, at + i, bf16) / divisor);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        cache[cache_at + i] = (int8_t)r;
    }
}

static inline __attribute__((always_inline)) void
rotary_store_token_int8(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                        int64_t t, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        void *qk_out, int8_t *key_cache, int8_t *value_cache, float *key_scales,
                        float *value_scales, const int64_t *slot_blocks,
                        const int64_t *slot_offsets, int64_t block_size, const int bf16) {
    const int64_t rotated = num_heads + num_kv_heads;
    const int64_t row = t * qkv_stride, angle_at = t * head_dim;
    for (int64_t h = 0; h < rotated; h++)
        rotate_head(qkv, row + h * head_dim, cos, sin, angle_at, head_dim, qk_out,
                    (t * rotated + h) * head_dim, bf16);
    for (int64_t h = 0; h < num_kv_heads; h++) {
        /* scales [blocks, kv_heads, block_size]; the cache's rows are head_dim times that */
        const int64_t slot = (slot_blocks[t] * num_kv_heads + h) * block_size + slot_offsets[t];
        quantize_row(qk_out, (t * rotated + num_heads + h) * head_dim, key_cache, slot * head_dim,
                     key_scales, slot, head_dim, bf16);
        quantize_row(qkv, row + (rotated + h) * head_dim, value_cache, slot * head_dim,
                     value_scales, slot, head_dim, bf16);
    }
}

/* rotary_store into an int8 cache: key_cache/value_cache [num_blocks, num_kv_heads, block_size,
 * head_dim] int8 with key_scales/value_scales [num_blocks, num_kv_heads, block_size] float32, each
 * key quantized from the rotated key written to qk_out (rounded to the activations' dtype, as the
 * PyTorch path stores it). Returns 0, or -1 (nothing written) when a slot lies outside the cache. */
int rotary_store_int8(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                      int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int bf16, void *qk_out, void *key_cache, void *value_cache,
                      float *key_scales, float *value_scales, const int64_t *slot_blocks,
                      const int64_t *slot_offsets, int64_t num_blocks, int64_t block_size) {
    for (int64_t t = 0; t < tokens; t++)
        if (slot_blocks[t] < 0 || slot_blocks[t] >= num_blocks || slot_offsets[t] < 0
            || slot_offsets[t] >= block_size)
            return -1;
    const int parallel = tokens * qkv_stride >= PARALLEL_MIN_ELEMENTS;
    if (bf16) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tokens; t++)
            rotary_store_token_int8(qkv, qkv_stride, cos, sin, t, num_heads, num_kv_heads,
                                    head_dim, qk_out, key_cache, value_cache, key_scales,
                                    value_scales, slot_blocks, slot_offsets, block_size, 1);
    } else {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t t = 0; t < tokens; t++)
            rotary_store_token_int8(qkv, qkv_stride, cos, sin, t, num_heads, num_kv_heads,
                                    head_dim, qk_out, key_cache, value_cache, key_scales,
                                    value_scales, slot_blocks, slot_offsets, block_size, 0);
    }
    return 0;
}

/* ---- The greedy choice of the next token --------------------------------------------------- */

static inline void greedy_row(const float *scores, int64_t vocab, int64_t *id, float *logprob) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < vocab; i++) top = scores[i] > top ? scores[i] : top;
    /* the first of equal maxima, as torch.argmax picks: found 64 scores at a time */
    int64_t at = 0;
    for (int64_t start = 0; start < vocab; start += 64) {
        const int64_t end = vocab - start < 64 ? vocab : start + 64;
        int found = 0;
#pragma omp simd reduction(| : found)
        for (int64_t i = start; i < end; i++) found |= scores[i] == top;
        if (found) {
            for (at = start; at < end - 1 && !(scores[at] == top); at++) {}
            break;
        }
    }
    /* in float a chunk at a time, the chunks in double: tens of thousands of terms summed in one
     * float lose about 1e-5 of the total */
    double total = 0.0;
    for (int64_t start = 0; start < vocab; start += 1024) {
        const int64_t end = vocab - start < 1024 ? vocab : start + 1024;
        float chunk = 0.0f;
#pragma omp simd reduction(+ : chunk)
        for (int64_t i = start; i < end; i++) chunk += exp_lane(scores[i] - top);
        total += chunk;
    }
    *id = at;
    *logprob = (float)-log(total); /* log_softmax at the maximum: -log(sum exp(s - top)) */
}

/* For each row of scores [rows, vocab] (float32): the index of its maximum and that token's
 * log-probability, without the [rows, vocab] log-probabilities log_softmax would write. A NaN score
 * is passed over where torch.argmax would pick it; the row's log-probability is NaN either way. */
void greedy_pick(const float *scores, int64_t rows, int64_t vocab, int64_t *ids, float *logprobs) {
#pragma omp parallel for schedule(static) if (rows * vocab >= PARALLEL_MIN_ELEMENTS && rows > 1)
    for (int64_t r = 0; r < rows; r++) greedy_row(scores + r * vocab, vocab, ids + r, logprobs + r);
}
