/* Decode attention read straight from the paged KV cache: one query token per sequence.
 *
 * PyTorch eager has to gather each sequence's blocks into a contiguous copy (and, for a bf16 cache on
 * a CPU without bf16 arithmetic, widen that copy to float32) before two batched matmuls: about seven
 * times the bytes of the context move per layer. Here every key and value is read once, where it
 * lies, and widened in registers.
 *
 * Cache layout: [num_blocks, kv_heads, block_size, head_dim], float32 or bf16 (the top 16 bits of a
 * float32). Queries [batch, heads, head_dim] with a row stride per token and output [batch, heads *
 * head_dim]: float32 or bf16 each (the arithmetic is float32: bf16 queries are widened, a bf16
 * output is rounded to nearest even, as PyTorch's conversions do).
 * Query heads that share a key/value head are adjacent (head h reads kv head h / (heads / kv_heads)).
 *
 * An int8 cache (paged_decode_attention_int8) holds each row as int8 with a float32 scale per
 * (token, kv head) beside it, [num_blocks, kv_heads, block_size]: the row stands for int8 * scale.
 * The int8 values are widened in registers as bf16 ones are, and the scales are applied once per
 * row, not per element: a key's to its score (q . (s k) = s (q . k)), a value's to its weight.
 * Each form is its own instantiation of one body (`attend`, the format a constant), so the float32
 * and bf16 forms carry no test for the int8 one.
 *
 * A sliding window (window > 0) keeps a sequence's last `window` tokens only: the older rows are
 * not even read. A soft cap (softcap > 0) bounds each scaled score to softcap * tanh(score /
 * softcap) before the softmax (Gemma 2's attention logits).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* the vector paths need AVX2 and FMA; the 16-float ones AVX-512F on top (nothing from DQ or BW) */
#if defined(__AVX2__) && defined(__FMA__)
#define VECTOR_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__)
#define VECTOR_AVX512 1
#endif
#endif

/* A cache's element format (the `bf16` arguments below take these values): float32, bf16, or
 * int8 (a scale per row kept apart, see paged_decode_attention_int8) */
#define FORMAT_F32 0
#define FORMAT_BF16 1
#define FORMAT_INT8 2

#ifdef VECTOR_AVX2
/* 8 floats of a cache row (FORMAT_*) */
static inline __m256 load8(const void *cache, int bf16, int64_t at) {
    if (bf16 == FORMAT_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)cache + at))));
    if (!bf16) return _mm256_loadu_ps((const float *)cache + at);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

/* A cache row as float32: itself when the cache is float32, else widened into `out` (an int8
 * row unscaled). */
static inline const float *widen_row(const void *row, int bf16, int64_t dim, float *out) {
    if (!bf16) return (const float *)row;
    int64_t d = 0;
    if (bf16 == FORMAT_INT8) {
        const int8_t *src = (const int8_t *)row;
#ifdef VECTOR_AVX2
        for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, load8(src, FORMAT_INT8, d));
#endif
        for (; d < dim; d++) out[d] = (float)src[d];
        return out;
    }
    const uint16_t *src = (const uint16_t *)row;
#ifdef VECTOR_AVX2
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, load8(src, 1, d));
#endif
    for (; d < dim; d++) out[d] = bf16_to_float(src[d]);
    return out;
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    int64_t d = 0;
    float total = 0.0f;
#ifdef VECTOR_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; d + 16 <= dim; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    for (; d + 8 <= dim; d += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 folded = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    folded = _mm_hadd_ps(folded, folded);
    folded = _mm_hadd_ps(folded, folded);
    total = _mm_cvtss_f32(folded);
#endif
    for (; d < dim; d++) total += a[d] * b[d];
    return total;
}

#ifdef VECTOR_AVX2
/* exp for 8 floats (Cephes' range reduction and polynomial, within 2 ulp of expf for the
 * x <= 0 that softmax hands it); inputs below -87 give 0. */
static inline __m256 exp256(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3f), high = _mm256_set1_ps(88.3f);
    __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), high);
    /* x = n ln2 + r, |r| <= ln2 / 2 */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
    __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    return _mm256_andnot_ps(underflow, result);
}
#endif

/* s[t] = exp(s[t] - top) for t < length; returns their sum */
static inline float exp_shifted(float *s, int64_t length, float top) {
    int64_t t = 0;
    float total = 0.0f;
#ifdef VECTOR_AVX2
    __m256 shift = _mm256_set1_ps(top), acc = _mm256_setzero_ps();
    for (; t + 8 <= length; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    __m128 folded = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    folded = _mm_hadd_ps(folded, folded);
    folded = _mm_hadd_ps(folded, folded);
    total = _mm_cvtss_f32(folded);
#endif
    for (; t < length; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    return total;
}

#ifdef VECTOR_AVX2
/* The 8 horizontal sums of acc[0..7], in order. */
static inline __m256 sum8(const __m256 acc[8]) {
    __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* scores[g * stride + j] = scale * q_g . k_j for 8 keys: each key row is loaded once per 8 lanes
 * and the sums are reduced together, not one horizontal reduction per score. */
static inline void score8(const float *q, int64_t group, const float *const keys[8],
                          int64_t head_dim, float scale, float *scores, int64_t stride) {
    for (int64_t g = 0; g < group; g++) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + g * head_dim + d);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + d), acc[j]);
        }
        _mm256_storeu_ps(scores + g * stride, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
    }
}
#endif

/* out += weight * row */
static inline void axpy(float weight, const float *row, float *out, int64_t dim) {
    int64_t d = 0;
#ifdef VECTOR_AVX2
    __m256 w = _mm256_set1_ps(weight);
    for (; d + 8 <= dim; d += 8)
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(row + d),
                                                  _mm256_loadu_ps(out + d)));
#endif
    for (; d < dim; d++) out[d] += weight * row[d];
}

/* offsets[t - first]: where token t's row (first <= t < end) for kv head `kv` starts in the cache,
 * in elements (keys and values share their layout), walking the block table a block at a time. */
static inline void row_offsets(const int64_t *table, int64_t first, int64_t end, int64_t kv,
                               int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                               int64_t *offsets) {
    for (int64_t t = first; t < end;) {
        const int64_t block = t / block_size;
        int64_t at = ((table[block] * num_kv_heads + kv) * block_size + t - block * block_size)
                     * head_dim;
        const int64_t block_end = (block + 1) * block_size < end ? (block + 1) * block_size : end;
        for (; t < block_end; t++, at += head_dim) offsets[t - first] = at;
    }
}

/* The rows a sequence of `length` tokens attends over: its last `window` ones (0: all). */
static inline int64_t window_start(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

#ifdef VECTOR_AVX2
/* For the `count` (1 to 4) query heads that share these values: o[h * head_dim + d0 ..+ 16) = sum
 * over t of probs[h * stride + t] * value row t (its 16 dims from d0). Each value row is read and
 * widened once for all the heads, not once per head. */
static inline __attribute__((always_inline)) void
weighted_sum16(const void *value_cache, int bf16, const int64_t *offsets, int64_t length,
               const float *probs, int64_t stride, const int count, int64_t d0, int64_t head_dim,
               float *o) {
    __m256 acc[4][2];
    for (int h = 0; h < count; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        int64_t at = offsets[t] + d0;
        __m256 v0 = load8(value_cache, bf16, at), v1 = load8(value_cache, bf16, at + 8);
        for (int h = 0; h < count; h++) {
            __m256 w = _mm256_set1_ps(probs[h * stride + t]);
            acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
        }
    }
    for (int h = 0; h < count; h++) {
        _mm256_storeu_ps(o + h * head_dim + d0, acc[h][0]);
        _mm256_storeu_ps(o + h * head_dim + d0 + 8, acc[h][1]);
    }
}

/* weighted_sum16 with the head count known to the compiler, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void
weighted_sums(const void *value_cache, int bf16, const int64_t *offsets, int64_t length,
              const float *probs, int64_t stride, int64_t heads, int64_t head_dim, float *o) {
    for (int64_t h = 0; h < heads; h += 4, probs += 4 * stride, o += 4 * head_dim) {
        int64_t count = heads - h < 4 ? heads - h : 4;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            switch (count) {
            case 1: weighted_sum16(value_cache, bf16, offsets, length, probs, stride, 1, d0,
                                   head_dim, o); break;
            case 2: weighted_sum16(value_cache, bf16, offsets, length, probs, stride, 2, d0,
                                   head_dim, o); break;
            case 3: weighted_sum16(value_cache, bf16, offsets, length, probs, stride, 3, d0,
                                   head_dim, o); break;
            default: weighted_sum16(value_cache, bf16, offsets, length, probs, stride, 4, d0,
                                    head_dim, o); break;
            }
        }
    }
}
#endif

#ifdef VECTOR_AVX512
/* 16 floats of a cache row (FORMAT_*) */
static inline __m512 load16(const void *cache, int bf16, int64_t at) {
    if (bf16 == FORMAT_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)cache + at))));
    if (!bf16) return _mm512_loadu_ps((const float *)cache + at);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The 8 horizontal sums of acc[0..7], in order. */
static inline __m256 sum8_wide(const __m512 acc[8]) {
    __m256 halves[8];
    for (int j = 0; j < 8; j++)
        halves[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm256_castpd_ps(
            _mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
    return sum8(halves);
}

/* scores[h * stride + j] = scale * q_h . k_j for `count` (1 to 3) query heads and 8 keys (rows at
 * offsets[0..8)): each key's 16 dims are loaded and widened once for all the heads, in registers. */
static inline __attribute__((always_inline)) void
score8_wide(const float *q, const int count, const void *key_cache, int bf16,
            const int64_t *offsets, int64_t head_dim, float scale, float *scores, int64_t stride) {
    __m512 acc[3][8];
    for (int h = 0; h < count; h++)
        for (int j = 0; j < 8; j++) acc[h][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 qv[3];
        for (int h = 0; h < count; h++) qv[h] = _mm512_loadu_ps(q + h * head_dim + d);
        for (int j = 0; j < 8; j++) {
            __m512 k = load16(key_cache, bf16, offsets[j] + d);
            for (int h = 0; h < count; h++) acc[h][j] = _mm512_fmadd_ps(qv[h], k, acc[h][j]);
        }
    }
    for (int h = 0; h < count; h++)
        _mm256_storeu_ps(scores + h * stride, _mm256_mul_ps(sum8_wide(acc[h]), _mm256_set1_ps(scale)));
}

/* score8_wide for every head of a group, three at a time (the accumulators fill the registers) */
static inline __attribute__((always_inline)) void
scores8_wide(const float *q, int64_t heads, const void *key_cache, int bf16,
             const int64_t *offsets, int64_t head_dim, float scale, float *scores,
             int64_t stride) {
    for (int64_t h = 0; h < heads; h += 3, q += 3 * head_dim, scores += 3 * stride) {
        switch (heads - h < 3 ? heads - h : 3) {
        case 1: score8_wide(q, 1, key_cache, bf16, offsets, head_dim, scale, scores, stride); break;
        case 2: score8_wide(q, 2, key_cache, bf16, offsets, head_dim, scale, scores, stride); break;
        default: score8_wide(q, 3, key_cache, bf16, offsets, head_dim, scale, scores, stride); break;
        }
    }
}

/* As weighted_sum16, for 64 dims from d0 in four 16-float registers per head. */
static inline __attribute__((always_inline)) void
weighted_sum64_wide(const void *value_cache, int bf16, const int64_t *offsets, int64_t length,
                    const float *probs, int64_t stride, const int count, int64_t d0,
                    int64_t head_dim, float *o) {
    __m512 acc[4][4];
    for (int h = 0; h < count; h++)
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        int64_t at = offsets[t] + d0;
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = load16(value_cache, bf16, at + 16 * c);
        for (int h = 0; h < count; h++) {
            __m512 w = _mm512_set1_ps(probs[h * stride + t]);
            for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
        }
    }
    for (int h = 0; h < count; h++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + h * head_dim + d0 + 16 * c, acc[h][c]);
}

static inline __attribute__((always_inline)) void
weighted_sums_wide(const void *value_cache, int bf16, const int64_t *offsets, int64_t length,
                   const float *probs, int64_t stride, int64_t heads, int64_t head_dim,
                   float *o) {
    for (int64_t h = 0; h < heads; h += 4, probs += 4 * stride, o += 4 * head_dim) {
        int64_t count = heads - h < 4 ? heads - h : 4;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            switch (count) {
            case 1: weighted_sum64_wide(value_cache, bf16, offsets, length, probs, stride, 1, d0,
                                        head_dim, o); break;
            case 2: weighted_sum64_wide(value_cache, bf16, offsets, length, probs, stride, 2, d0,
                                        head_dim, o); break;
            case 3: weighted_sum64_wide(value_cache, bf16, offsets, length, probs, stride, 3, d0,
                                        head_dim, o); break;
            default: weighted_sum64_wide(value_cache, bf16, offsets, length, probs, stride, 4, d0,
                                         head_dim, o); break;
            }
        }
    }
}
#endif

/* Rows ahead of the one being scored whose keys are fetched early: the rows of a sequence lie in
 * blocks scattered over the cache, which the hardware prefetchers do not follow from block to block;
 * without these requests a step waits on memory for most of its attention time. */
#define PREFETCH_AHEAD 32

/* Asks for the cache lines of one row before they are read (a row may start inside a line), into
 * L2 (prefetcht1), not L1: on the AVX-512 EPYC of benchmarks/RESULTS.md asking for L1 left the
 * kernel reading 14-15 GB/s of keys and values, L2 20-23 GB/s (a batch-32 step's attention 8.3 ->
 * 5.5 ms at 160-token contexts); the rows still reach L1 from L2 in time. */
static inline void prefetch_row(const char *row, int64_t bytes) {
    const char *line = (const char *)((uintptr_t)row & ~(uintptr_t)63);
    for (; line < row + bytes; line += 64) __builtin_prefetch(line, 0, 2);
}

/* scales[t - first]: the scale of token t's row (first <= t < end) for kv head `kv`, from the
 * [num_blocks, kv_heads, block_size] scales beside an int8 cache (row_offsets' walk, per row). */
static inline void row_scales(const float *cache_scales, const int64_t *table, int64_t first,
                              int64_t end, int64_t kv, int64_t num_kv_heads, int64_t block_size,
                              float *scales) {
    for (int64_t t = first; t < end;) {
        const int64_t block = t / block_size;
        const float *at = cache_scales + (table[block] * num_kv_heads + kv) * block_size
                          + t - block * block_size;
        const int64_t block_end = (block + 1) * block_size < end ? (block + 1) * block_size : end;
        for (; t < block_end; t++) scales[t - first] = *at++;
    }
}

/* What every (sequence, kv head) of a call shares. */
typedef struct {
    const void *key_cache, *value_cache;
    const float *key_scales, *value_scales; /* FORMAT_INT8 only */
    const void *queries;
    int queries_are_bf16, out_is_bf16;
    int64_t query_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size, window;
    int64_t longest;
    const int64_t *block_tables, *context_lens;
    float scale, softcap;
    void *out;
} call_t;

/* Per thread: scores [group, longest], 8 widened key or value rows, a group's queries and
 * outputs in float32, row offsets, and (int8) the rows' key and value scales. */
typedef struct {
    float *scores, *row, *group_queries, *group_out, *key_row_scales, *value_row_scales;
    int64_t *offsets;
} scratch_t;

/* Sequence b's attention for the query heads of kv head `kv`, its cache in `format` (a constant
 * in each instantiation: the branches on it fold away). */
static inline __attribute__((always_inline)) void
attend(const call_t *c, const scratch_t *w, int64_t b, int64_t kv, const int format) {
    const int64_t head_dim = c->head_dim, num_kv_heads = c->num_kv_heads;
    const int64_t group = c->num_heads / num_kv_heads, longest = c->longest;
    const size_t element = format == FORMAT_INT8 ? 1 : format == FORMAT_BF16 ? 2 : 4;
    const void *key_cache = c->key_cache, *value_cache = c->value_cache;
    float *scores = w->scores, *row = w->row;
    int64_t *offsets = w->offsets;
    /* rows are numbered from the window's first: row t is token first + t */
    const int64_t first = window_start(c->context_lens[b], c->window);
    const int64_t length = c->context_lens[b] - first;
    const int64_t *table = c->block_tables + b * c->table_stride;
    const int64_t query_at = b * c->query_stride + kv * group * head_dim;
    const int64_t out_at = (b * c->num_heads + kv * group) * head_dim;
    const float scale = c->scale, softcap = c->softcap;
    const float *q = (const float *)c->queries + query_at;
    if (c->queries_are_bf16) {
        widen_row((const uint16_t *)c->queries + query_at, 1, group * head_dim, w->group_queries);
        q = w->group_queries;
    }
    float *o = c->out_is_bf16 ? w->group_out : (float *)c->out + out_at;
    row_offsets(table, first, first + length, kv, num_kv_heads, c->block_size, head_dim, offsets);
    if (format == FORMAT_INT8) {
        row_scales(c->key_scales, table, first, first + length, kv, num_kv_heads, c->block_size,
                   w->key_row_scales);
        row_scales(c->value_scales, table, first, first + length, kv, num_kv_heads, c->block_size,
                   w->value_row_scales);
    }
    const int64_t row_bytes = head_dim * (int64_t)element;
    for (int64_t t = 0; t < PREFETCH_AHEAD && t < length; t++)
        prefetch_row((const char *)key_cache + offsets[t] * element, row_bytes);
    int64_t t = 0;
#ifdef VECTOR_AVX2
    for (; head_dim % 8 == 0 && t + 8 <= length; t += 8) {
        const float *keys[8];
        for (int j = 0; j < 8; j++) {
            /* the keys PREFETCH_AHEAD rows on, and the values scored now: they are
             * read once the scores are known */
            if (t + j + PREFETCH_AHEAD < length)
                prefetch_row((const char *)key_cache
                             + offsets[t + j + PREFETCH_AHEAD] * element, row_bytes);
            prefetch_row((const char *)value_cache + offsets[t + j] * element, row_bytes);
        }
#ifdef VECTOR_AVX512
        if (head_dim % 16 == 0) {
            scores8_wide(q, group, key_cache, format, offsets + t, head_dim, scale, scores + t,
                         longest);
            continue;
        }
#endif
        for (int j = 0; j < 8; j++)
            keys[j] = widen_row((const char *)key_cache + offsets[t + j] * element, format,
                                head_dim, row + j * head_dim);
        score8(q, group, keys, head_dim, scale, scores + t, longest);
    }
#endif
    for (; t < length; t++) {
        if (t + PREFETCH_AHEAD < length)
            prefetch_row((const char *)key_cache + offsets[t + PREFETCH_AHEAD] * element,
                         row_bytes);
        prefetch_row((const char *)value_cache + offsets[t] * element, row_bytes);
        const float *k = widen_row((const char *)key_cache + offsets[t] * element, format,
                                   head_dim, row);
        for (int64_t g = 0; g < group; g++)
            scores[g * longest + t] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * longest;
        if (format == FORMAT_INT8) {
            const float *key_row_scales = w->key_row_scales;
#pragma omp simd
            for (int64_t t = 0; t < length; t++) s[t] *= key_row_scales[t];
        }
        if (softcap > 0.0f)
            for (int64_t t = 0; t < length; t++) s[t] = softcap * tanhf(s[t] / softcap);
        float top = s[0];
#pragma omp simd reduction(max : top)
        for (int64_t t = 1; t < length; t++) top = s[t] > top ? s[t] : top;
        float inverse = 1.0f / exp_shifted(s, length, top);
        if (format == FORMAT_INT8) {
            /* each value row's scale goes into its weight */
            const float *value_row_scales = w->value_row_scales;
#pragma omp simd
            for (int64_t t = 0; t < length; t++) s[t] *= inverse * value_row_scales[t];
        } else {
            for (int64_t t = 0; t < length; t++) s[t] *= inverse;
        }
    }
    int summed = 0;
#ifdef VECTOR_AVX512
    if (head_dim % 64 == 0) {
        weighted_sums_wide(value_cache, format, offsets, length, scores, longest, group, head_dim,
                           o);
        summed = 1;
    }
#endif
#ifdef VECTOR_AVX2
    if (!summed && head_dim % 16 == 0) {
        weighted_sums(value_cache, format, offsets, length, scores, longest, group, head_dim, o);
        summed = 1;
    }
#endif
    if (!summed) {
        memset(o, 0, sizeof(float) * (size_t)(group * head_dim));
        for (int64_t t = 0; t < length; t++) {
            const float *v = widen_row((const char *)value_cache + offsets[t] * element, format,
                                       head_dim, row);
            for (int64_t g = 0; g < group; g++)
                axpy(scores[g * longest + t], v, o + g * head_dim, head_dim);
        }
    }
    if (c->out_is_bf16)
        for (int64_t i = 0; i < group * head_dim; i++)
            ((uint16_t *)c->out)[out_at + i] = float_to_bf16(o[i]);
}

/* Every (sequence, kv head) of the call, over the threads; 0, or -1 when a scratch buffer could
 * not be allocated (nothing is written then). */
static int attend_all(call_t *c, int64_t batch, const int format) {
    const int64_t group = c->num_heads / c->num_kv_heads, head_dim = c->head_dim;
    int64_t longest = 0;  /* the most rows a sequence attends over */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t rows = c->context_lens[b] - window_start(c->context_lens[b], c->window);
        if (rows > longest) longest = rows;
    }
    c->longest = longest;
    const size_t scale_rows = format == FORMAT_INT8 ? 2 * (size_t)longest : 0;
    int failed = 0;

#pragma omp parallel
    {
        /* the int64 offsets first: after an odd count of floats they would be misaligned */
        int64_t *scratch = malloc(sizeof(int64_t) * (size_t)longest
                                  + sizeof(float) * ((size_t)(group * longest + 8 * head_dim
                                                              + 2 * group * head_dim) + scale_rows));
        float *scores = scratch ? (float *)(scratch + longest) : NULL;
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            scratch_t w;
            w.scores = scores;
            w.row = scores + group * longest;
            w.group_queries = w.row + 8 * head_dim;
            w.group_out = w.group_queries + group * head_dim;
            w.key_row_scales = w.group_out + group * head_dim;
            w.value_row_scales = w.key_row_scales + scale_rows / 2;
            w.offsets = scratch;
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < batch; b++)
                for (int64_t kv = 0; kv < c->num_kv_heads; kv++) {
                    if (format == FORMAT_INT8)
                        attend(c, &w, b, kv, FORMAT_INT8);
                    else if (format == FORMAT_BF16)
                        attend(c, &w, b, kv, FORMAT_BF16);
                    else
                        attend(c, &w, b, kv, FORMAT_F32);
                }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Returns 0, or -1 when a scratch buffer could not be allocated (nothing is written then). */
int paged_decode_attention(const void *key_cache, const void *value_cache, int cache_is_bf16,
                           const void *queries, int queries_are_bf16, int64_t query_stride,
                           const int64_t *block_tables, int64_t table_stride,
                           const int64_t *context_lens, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           int64_t window, float softcap, void *out, int out_is_bf16) {
    call_t c = {key_cache, value_cache, 0, 0, queries, queries_are_bf16, out_is_bf16,
                query_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size,
                window, 0, block_tables, context_lens, scale, softcap, out};
    return attend_all(&c, batch, cache_is_bf16 ? FORMAT_BF16 : FORMAT_F32);
}

/* paged_decode_attention over an int8 cache: key_cache/value_cache [num_blocks, kv_heads,
 * block_size, head_dim] int8, key_scales/value_scales [num_blocks, kv_heads, block_size] float32
 * (row r stands for its int8 values times scales[r]). */
int paged_decode_attention_int8(const void *key_cache, const void *value_cache,
                                const float *key_scales, const float *value_scales,
                                const void *queries, int queries_are_bf16, int64_t query_stride,
                                const int64_t *block_tables, int64_t table_stride,
                                const int64_t *context_lens, int64_t batch, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int64_t window, float softcap, void *out,
                                int out_is_bf16) {
    call_t c = {key_cache, value_cache, key_scales, value_scales, queries, queries_are_bf16,
                out_is_bf16, query_stride, table_stride, num_heads, num_kv_heads, head_dim,
                block_size, window, 0, block_tables, context_lens, scale, softcap, out};
    return attend_all(&c, batch, FORMAT_INT8);
}
