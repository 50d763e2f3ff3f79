/* LoRA updates of a batch whose rows each use their own adapter (or none): the batched gather
 * matrix-vector product (BGMV, Punica's name for it), on the CPU.
 *
 *   out[i, :width] += sum_{r < ranks[s]} (x[i] . a[s, r]) bt[s, r, :]      s = row_slots[i]
 *
 * in two stages: shrink (h[i, r] = x[i] . a[s, r], float32) and expand (out[i] += h[i] bt[s]).
 * The rows are sorted by slot and cut into tiles of up to 4 rows of one slot, so that every
 * vector of an adapter's weights is widened to float32 once per tile and serves each of its rows
 * from registers. The work items are (tile, block of ranks) for the shrink and (tile, block of
 * output columns) for the expand; the threads of the OpenMP team split each stage's items, with a
 * barrier between the stages. A batch of a few rows then still spreads over the cores.
 *
 * bf16 vectors are widened without shuffles: a vector of 2 * LANES bf16 values, read as LANES
 * 32-bit words, gives the even elements as floats by a shift and the odd ones by a mask, so both
 * operands of a dot product (and the columns of bt and out alike) split the same way.
 *
 * Rounding, and why a row's result depends on nothing but its own inputs: each h[i, r] is one
 * float32 dot product of fixed order (lane j of its accumulator takes the elements 2j, then
 * 2j + 1, of each step of 2 * LANES; the lanes summed in a fixed tree; the inputs past the last
 * whole step added after, in order), whatever its tile, its item or the thread count. Each
 * output element is one float32 FMA chain over r from 0 (the scalar tail columns use fmaf, the
 * same single rounding as a vector lane), then one add to the bf16 value already there and one
 * rounding to bf16 (to nearest, ties to even). The same row alone and in a mixed batch thus
 * get the same bits. Builds differ (AVX-512: 16 lanes; AVX2: 8; otherwise one): machines do not
 * share results.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
ALWAYS_INLINE vi load_pairs(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
ALWAYS_INLINE void store_pairs(uint16_t *p, vi v) { _mm512_storeu_si512((void *)p, v); }
ALWAYS_INLINE vf evens(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
ALWAYS_INLINE vf odds(vi v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
ALWAYS_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vset1(float value) { return _mm512_set1_ps(value); }
ALWAYS_INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE float hsum(vf v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* float32 lanes -> their bf16 bits in the top half of each word, as float_to_bf16 rounds */
ALWAYS_INLINE vi round_high(vf v) {
    const vi bits = _mm512_castps_si512(v);
    const vi lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const vi rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(nan, rounded,
                                   _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
}
ALWAYS_INLINE vi pack_pairs(vf even, vf odd) {
    return _mm512_or_si512(_mm512_srli_epi32(round_high(even), 16),
                           _mm512_and_si512(round_high(odd), _mm512_set1_epi32((int)0xffff0000u)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
ALWAYS_INLINE vi load_pairs(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE void store_pairs(uint16_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
ALWAYS_INLINE vf evens(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
ALWAYS_INLINE vf odds(vi v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
ALWAYS_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf vset1(float value) { return _mm256_set1_ps(value); }
ALWAYS_INLINE vf vload(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS_INLINE float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
ALWAYS_INLINE vi round_high(vf v) {
    const vi bits = _mm256_castps_si256(v);
    const vi lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const vi rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
    /* (signed compare: both sides are below 2^31) */
    const vi nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                      _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
}
ALWAYS_INLINE vi pack_pairs(vf even, vf odd) {
    return _mm256_or_si256(_mm256_srli_epi32(round_high(even), 16),
                           _mm256_and_si256(round_high(odd), _mm256_set1_epi32((int)0xffff0000u)));
}
#else
/* one lane: the same arithmetic, an element pair at a time */
#define LANES 1
typedef float vf;
typedef uint32_t vi;
ALWAYS_INLINE vi load_pairs(const uint16_t *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE void store_pairs(uint16_t *p, vi v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE float bits_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
ALWAYS_INLINE vf evens(vi v) { return bits_float(v << 16); }
ALWAYS_INLINE vf odds(vi v) { return bits_float(v & 0xffff0000u); }
ALWAYS_INLINE vf vzero(void) { return 0.0f; }
ALWAYS_INLINE vf vset1(float value) { return value; }
ALWAYS_INLINE vf vload(const float *p) { return *p; }
ALWAYS_INLINE void vstore(float *p, vf v) { *p = v; }
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { return fmaf(a, b, c); }
ALWAYS_INLINE vf vadd(vf a, vf b) { return a + b; }
ALWAYS_INLINE float hsum(vf v) { return v; }
ALWAYS_INLINE vi pack_pairs(vf even, vf odd) {
    return (vi)float_to_bf16(even) | (vi)float_to_bf16(odd) << 16;
}
#endif

/* the bf16 elements one vector step reads */
#define STEP (2 * LANES)
/* rows of one slot that share each widened weight vector */
#define TILE_ROWS 4
/* the expand's items are this many output columns of a tile (a multiple of 4 steps) */
#define COLUMN_BLOCK (16 * STEP)
/* below this many multiply-adds a call stays on the calling thread */
#define PARALLEL_MIN_WORK (1 << 16)

/* A tile's rows, sorted by slot: rows order[start .. start + count), all of slot `slot`. */
typedef struct {
    int64_t start, count, slot;
} tile_t;

/* x [in] bf16 -> xw: per whole step its even elements then its odd ones, as floats (the
 * shrink's operand layout) */
static void widen_row(const uint16_t *x, int64_t steps, float *xw) {
    for (int64_t j = 0; j < steps; j++) {
        const vi pairs = load_pairs(x + j * STEP);
        vstore(xw + j * STEP, evens(pairs));
        vstore(xw + j * STEP + LANES, odds(pairs));
    }
}

/* h[t * h_stride + u] = x_t . a[u] for the T rows of a tile (x widened in xw, rows xw_row apart;
 * x_t the bf16 rows, for the inputs past the last step) and U consecutive rows of a */
ALWAYS_INLINE void shrink_tile(const int T, const int U, const float *xw, int64_t xw_row,
                               const uint16_t *const *x, const uint16_t *a, int64_t in,
                               int64_t steps, float *h, int64_t h_stride) {
    vf acc[TILE_ROWS][8];
    for (int t = 0; t < T; t++)
        for (int u = 0; u < U; u++)
            acc[t][u] = vzero();
    for (int64_t j = 0; j < steps; j++)
        for (int u = 0; u < U; u++) {
            const vi pairs = load_pairs(a + u * in + j * STEP);
            const vf even = evens(pairs), odd = odds(pairs);
            for (int t = 0; t < T; t++) {
                const float *row = xw + t * xw_row + j * STEP;
                acc[t][u] = vfma(vload(row), even, acc[t][u]);
                acc[t][u] = vfma(vload(row + LANES), odd, acc[t][u]);
            }
        }
    for (int t = 0; t < T; t++)
        for (int u = 0; u < U; u++) {
            float sum = hsum(acc[t][u]);
            for (int64_t k = steps * STEP; k < in; k++)
                sum = fmaf(bf16_to_float(x[t][k]), bf16_to_float(a[u * in + k]), sum);
            h[t * h_stride + u] = sum;
        }
}

/* h [T][ranks r0 .. r1) of a tile: groups of U ranks (as many as the tile's rows leave
 * registers for), then one at a time */
ALWAYS_INLINE void shrink_ranks(const int T, const int U, const float *xw, int64_t xw_row,
                                const uint16_t *const *x, const uint16_t *a, int64_t in,
                                int64_t steps, float *h, int64_t h_stride, int64_t r0,
                                int64_t r1) {
    int64_t r = r0;
    for (; r + U <= r1; r += U)
        shrink_tile(T, U, xw, xw_row, x, a + r * in, in, steps, h + r, h_stride);
    for (; r < r1; r++)
        shrink_tile(T, 1, xw, xw_row, x, a + r * in, in, steps, h + r, h_stride);
}

/* out_t[0 .. C * STEP) += sum_{r < rank} h[t * h_stride + r] bt[r * width + ...] for a tile's T
 * rows, rounded to bf16 */
ALWAYS_INLINE void expand_tile(const int T, const int C, const float *h, int64_t h_stride,
                               int64_t rank, const uint16_t *bt, int64_t width,
                               uint16_t *const *out, int64_t column) {
    vf even[TILE_ROWS][4], odd[TILE_ROWS][4];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            even[t][c] = odd[t][c] = vzero();
    for (int64_t r = 0; r < rank; r++)
        for (int c = 0; c < C; c++) {
            const vi pairs = load_pairs(bt + r * width + column + c * STEP);
            const vf b_even = evens(pairs), b_odd = odds(pairs);
            for (int t = 0; t < T; t++) {
                const vf scale = vset1(h[t * h_stride + r]);
                even[t][c] = vfma(scale, b_even, even[t][c]);
                odd[t][c] = vfma(scale, b_odd, odd[t][c]);
            }
        }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) {
            uint16_t *to = out[t] + column + c * STEP;
            const vi pairs = load_pairs(to);
            store_pairs(to, pack_pairs(vadd(evens(pairs), even[t][c]),
                                       vadd(odds(pairs), odd[t][c])));
        }
}

/* columns c0 .. c1 of a tile's rows: groups of C steps, single steps, then the columns past
 * the last whole step one by one (the same FMA chain as a vector lane) */
ALWAYS_INLINE void expand_columns(const int T, const int C, const float *h, int64_t h_stride,
                                  int64_t rank, const uint16_t *bt, int64_t width,
                                  uint16_t *const *out, int64_t c0, int64_t c1) {
    int64_t column = c0;
    for (; column + C * STEP <= c1; column += C * STEP)
        expand_tile(T, C, h, h_stride, rank, bt, width, out, column);
    for (; column + STEP <= c1; column += STEP)
        expand_tile(T, 1, h, h_stride, rank, bt, width, out, column);
    for (; column < c1; column++)
        for (int t = 0; t < T; t++) {
            float sum = 0.0f;
            for (int64_t r = 0; r < rank; r++)
                sum = fmaf(h[t * h_stride + r], bf16_to_float(bt[r * width + column]), sum);
            out[t][column] = float_to_bf16(bf16_to_float(out[t][column]) + sum);
        }
}

/* (dispatch on a tile's row count, so that each count gets a kernel with constant loops; the
 * ranks and column groups per count keep T * U and 2 * T * C accumulators within 16 registers) */
static void shrink_item(int64_t T, const float *xw, int64_t xw_row, const uint16_t *const *x,
                        const uint16_t *a, int64_t in, int64_t steps, float *h, int64_t h_stride,
                        int64_t r0, int64_t r1) {
    switch (T) {
    case 1: shrink_ranks(1, 8, xw, xw_row, x, a, in, steps, h, h_stride, r0, r1); break;
    case 2: shrink_ranks(2, 4, xw, xw_row, x, a, in, steps, h, h_stride, r0, r1); break;
    case 3: shrink_ranks(3, 2, xw, xw_row, x, a, in, steps, h, h_stride, r0, r1); break;
    default: shrink_ranks(4, 2, xw, xw_row, x, a, in, steps, h, h_stride, r0, r1); break;
    }
}

static void expand_item(int64_t T, const float *h, int64_t h_stride, int64_t rank,
                        const uint16_t *bt, int64_t width, uint16_t *const *out, int64_t c0,
                        int64_t c1) {
    switch (T) {
    case 1: expand_columns(1, 4, h, h_stride, rank, bt, width, out, c0, c1); break;
    case 2: expand_columns(2, 2, h, h_stride, rank, bt, width, out, c0, c1); break;
    case 3: expand_columns(3, 1, h, h_stride, rank, bt, width, out, c0, c1); break;
    default: expand_columns(4, 1, h, h_stride, rank, bt, width, out, c0, c1); break;
    }
}

/* the calling thread's scratch, grown as needed and kept */
static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_buffer(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *grown = realloc(scratch, bytes);
        if (!grown)
            return 0;
        scratch = grown;
        scratch_bytes = bytes;
    }
    return scratch;
}

static int64_t rank_of(const int64_t *ranks, int64_t slot, int64_t max_rank) {
    const int64_t rank = ranks[slot];
    return rank < 0 ? 0 : rank > max_rank ? max_rank : rank;
}

/* x [rows, in] (rows x_stride apart), row_slots [rows], a [num_slots, max_rank, in], bt
 * [num_slots, max_rank, width], ranks [num_slots] -> out [rows, width] (rows out_stride apart)
 * plus each row's update, in place. A row whose slot is outside 0 .. num_slots - 1 is left as it
 * is, and so is one whose slot's rank is 0; ranks past max_rank count as max_rank. Returns 0, or
 * -2 where the scratch could not be allocated (out unchanged). */
int lora_add(const uint16_t *x, int64_t rows, int64_t in, int64_t x_stride,
             const int64_t *row_slots, const uint16_t *a, const uint16_t *bt,
             const int64_t *ranks, int64_t num_slots, int64_t max_rank, int64_t width,
             uint16_t *out, int64_t out_stride) {
    if (rows <= 0 || width <= 0 || num_slots <= 0 || max_rank <= 0 || in < 0)
        return 0;
    const int64_t steps = in / STEP;
    const int threads = omp_get_max_threads();
    /* scratch: per slot a count (then its next place), the sorted rows, the tiles, h, and per
     * thread a tile's rows widened */
    const size_t counts_bytes = (size_t)num_slots * sizeof(int64_t);
    const size_t order_bytes = (size_t)rows * sizeof(int64_t);
    const size_t tiles_bytes = (size_t)rows * sizeof(tile_t);
    const size_t h_bytes = (size_t)rows * (size_t)max_rank * sizeof(float);
    const int64_t xw_row = steps * STEP;
    const size_t xw_bytes = (size_t)threads * TILE_ROWS * (size_t)xw_row * sizeof(float);
    char *base = scratch_buffer(counts_bytes + order_bytes + tiles_bytes + h_bytes + xw_bytes);
    if (!base)
        return -2;
    int64_t *next = (int64_t *)base;
    int64_t *order = (int64_t *)(base + counts_bytes);
    tile_t *tiles = (tile_t *)(base + counts_bytes + order_bytes);
    float *h = (float *)(base + counts_bytes + order_bytes + tiles_bytes);
    float *xw = (float *)(base + counts_bytes + order_bytes + tiles_bytes + h_bytes);

    /* the rows with an update, sorted by slot (each slot's rows in batch order) */
    for (int64_t s = 0; s < num_slots; s++)
        next[s] = 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = row_slots[i];
        if (s >= 0 && s < num_slots && rank_of(ranks, s, max_rank) > 0)
            next[s]++;
    }
    int64_t active = 0, num_tiles = 0, work = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        const int64_t count = next[s];
        for (int64_t start = 0; start < count; start += TILE_ROWS)
            tiles[num_tiles++] = (tile_t){active + start,
                                          count - start < TILE_ROWS ? count - start : TILE_ROWS, s};
        work += count * rank_of(ranks, s, max_rank) * (in + width);
        next[s] = active;
        active += count;
    }
    if (active == 0)
        return 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = row_slots[i];
        if (s >= 0 && s < num_slots && rank_of(ranks, s, max_rank) > 0)
            order[next[s]++] = i;
    }

    /* items: few tiles split their ranks (and columns) into blocks, so that every thread has
     * some; many take all their ranks at once and widen their rows once */
    const int parallel = threads > 1 && work >= PARALLEL_MIN_WORK;
    const int64_t rank_block = parallel && num_tiles < 4 * threads ? 8 : max_rank;
    const int64_t rank_blocks = (max_rank + rank_block - 1) / rank_block;
    const int64_t column_blocks = (width + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel if (parallel)
    {
        float *own_xw = xw + (int64_t)omp_get_thread_num() * TILE_ROWS * xw_row;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_tiles * rank_blocks; item++) {
            const tile_t tile = tiles[item / rank_blocks];
            const int64_t rank = rank_of(ranks, tile.slot, max_rank);
            const int64_t r0 = item % rank_blocks * rank_block;
            const int64_t r1 = r0 + rank_block < rank ? r0 + rank_block : rank;
            if (r0 >= r1)
                continue;
            const uint16_t *x_rows[TILE_ROWS];
            for (int64_t t = 0; t < tile.count; t++) {
                x_rows[t] = x + order[tile.start + t] * x_stride;
                widen_row(x_rows[t], steps, own_xw + t * xw_row);
            }
            shrink_item(tile.count, own_xw, xw_row, x_rows, a + tile.slot * max_rank * in, in,
                        steps, h + tile.start * max_rank, max_rank, r0, r1);
        }
        /* (the loop's barrier: every h is complete before any expand reads it) */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_tiles * column_blocks; item++) {
            const tile_t tile = tiles[item / column_blocks];
            const int64_t c0 = item % column_blocks * COLUMN_BLOCK;
            const int64_t c1 = c0 + COLUMN_BLOCK < width ? c0 + COLUMN_BLOCK : width;
            uint16_t *out_rows[TILE_ROWS];
            for (int64_t t = 0; t < tile.count; t++)
                out_rows[t] = out + order[tile.start + t] * out_stride;
            expand_item(tile.count, h + tile.start * max_rank, max_rank,
                        rank_of(ranks, tile.slot, max_rank), bt + tile.slot * max_rank * width,
                        width, out_rows, c0, c1);
        }
    }
    return 0;
}
