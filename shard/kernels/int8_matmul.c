/* y = x W^T (+ b) for bf16 x [m, k] and an 8-bit W [n, k] given per group of G = 16 or 32 input
 * features as w = q * scale + low (q in -128..127, scale and low float32: the product rounded,
 * then the sum), on CPUs with AVX-512 BF16 or AVX2. The form holds GGUF's 5-, 6- and 8-bit types
 * exactly (Q8_0: q * d; Q6_K: groups of 16; Q5_0, Q5_1, Q5_K: groups of 32), at 1 byte a weight
 * plus 8 bytes a group: decode-size batches, where reading the weights sets the time, multiply by
 * it directly.
 *
 * Packing: a 64-byte header (int64 magic, group, k, n), then per block of 16 output features and
 * group (blocks after one another, a block's groups in order; features past n zeros, with scale
 * and low 0) G / 2 x 32 bytes of q, byte [i][f][e] holding input 2i + e of feature f (the bf16
 * matmul's [pairs][16 features][2 inputs] order), then the 16 scales and the 16 lows. The
 * header carries the group, which the matmul's signature (the int4 kernel's, as the C decode step
 * calls both) has no room for, and lets a call refuse a buffer packed for another shape.
 *
 * AVX-512 BF16: integer dot products, each row's group of inputs held as int16 (multiples of d,
 * the group's largest magnitude / 32767, rounded to nearest: 2^-16 of that magnitude at most,
 * 128 times below the result's own bf16 rounding). Each 32 bytes of q, sign-extended to 16 bits,
 * are a VPDPWSSD operand ([16 features][2 inputs]), so a group's dot product D = sum q xq takes
 * G / 2 VPDPWSSD a row, exact in int32; the row's result then gains scale * d * D + low * X, X
 * the group's inputs as rounded, d * (sum xq), in float32, and is rounded once to bf16. Measured
 * against the first design (q converted to bf16, VDPBF16PS against the bf16 inputs, exact
 * products): 0.3-0.65x its time at 1-32 rows, a VPDPWSSD needing one conversion of q where a
 * VDPBF16PS took five (sign-extend, widen to float32 twice, and narrow to bf16). Past TILE_MAX_ROWS rows (prefills),
 * each thread unpacks a few blocks at a time into the bf16 matmul's layout, the bf16 of
 * q * scale + low (a float32 product, then a float32 sum: built with -ffp-contract=off, so no
 * compiler fuses them), and runs that kernel's tiles (bf16_tiles.h) over the rows: a prefill gets
 * what a bf16 layer of those weights gives, bit for bit, as int4_matmul.c does.
 *
 * AVX2 (no bf16 arithmetic): every batch by the 8-bit form, q widened to float32 and multiplied by
 * the rows widened to float32 (exact products, float32 sums), then scale * D + low * X as above.
 * No rounding of the inputs: q has twice int4's bits, and int8 inputs would be the larger error.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "matmul_isa.h"
#if defined(HAVE_DPBF16)
#include "bf16_tiles.h"
#elif defined(HAVE_AVX2_FMA)
#include "bf16_store.h"
#endif

#define HEADER_BYTES 64
/* "INT8PACK", little-endian: a header this library wrote */
#define MAGIC 0x4b43415038544e49LL
/* the bytes of one group of one block: the q of G inputs x 16 features, 16 scales, 16 lows */
#define GROUP_BYTES(G) (BLOCK * (G) + 2 * BLOCK * 4)
#define PARALLEL_MIN_WORK (1 << 16)
/* how many groups ahead a tile asks for its block's lines */
#define PREFETCH_GROUPS 4
#if defined(HAVE_DPBF16)
/* up to how many rows the 8-bit tiles run: every decode batch of the router's default 128
 * requests in flight. Not the speed's limit: on a Xeon (Emerald Rapids, 1 thread) the tiles took
 * 0.43x the unpacked blocks' time at 32-256 rows (and 0.57x the bf16 matmul's at 1 row, 0.42x at
 * 8); past it a prefill is what a bf16 layer of the restored weights gives, bit for bit. */
#define TILE_MAX_ROWS 128
/* rows a pass over the unpacked blocks takes (their inputs stay in L2 or L3 while each thread
 * unpacks its blocks once a pass) */
#define UNPACKED_ROWS_PER_PASS 256
/* blocks a thread unpacks at a time: the widest bf16 tile at many rows */
#define STRIP_BLOCKS 3
#else
/* no limit: every batch runs the 8-bit tiles */
#define TILE_MAX_ROWS 0
/* rows the tiles take against each thread's blocks before the next rows (their float32 form
 * stays in L2 meanwhile) */
#define ROWS_PER_PASS 128
#endif

/* 1: AVX-512 BF16 dot products; 2: float32 FMAs on AVX2; 0: no kernel in this build */
int int8_matmul_supported(void) { return matmul_form(); }

/* up to how many rows a call runs the 8-bit tiles (more: the unpacked blocks); 0: every batch */
int int8_matmul_tile_rows(void) { return TILE_MAX_ROWS; }

/* -1 where the group is not 16 or 32 or k not a positive multiple of it */
int64_t int8_matmul_packed_bytes(int64_t n, int64_t k, int64_t group) {
    if ((group != 16 && group != 32) || k <= 0 || k % group || n <= 0)
        return -1;
    return HEADER_BYTES + (n + BLOCK - 1) / BLOCK * (k / group) * GROUP_BYTES(group);
}

/* q [n, k], scale and low [n, k / group] -> out (int8_matmul_packed_bytes of them) */
void int8_matmul_pack(const int8_t *q, const float *scale, const float *low, int64_t n, int64_t k,
                      int64_t group, uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group;
    const int64_t header[4] = {MAGIC, group, k, n};
    memset(out, 0, HEADER_BYTES);
    memcpy(out, header, sizeof header);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *to = out + HEADER_BYTES + (b * groups + g) * GROUP_BYTES(group);
            for (int64_t i = 0; i < group / 2; i++)
                for (int f = 0; f < BLOCK; f++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t row = b * BLOCK + f, col = g * group + 2 * i + e;
                        to[(i * BLOCK + f) * 2 + e] = row < n ? (uint8_t)q[row * k + col] : 0;
                    }
            float *factors = (float *)(to + BLOCK * group);
            for (int f = 0; f < BLOCK; f++) {
                const int64_t row = b * BLOCK + f;
                float s = row < n ? scale[row * groups + g] : 0.0f;
                float l = row < n ? low[row * groups + g] : 0.0f;
                memcpy(factors + f, &s, sizeof s);
                memcpy(factors + BLOCK + f, &l, sizeof l);
            }
        }
}

#ifdef HAVE_DPBF16

/* acc + each lane's two products of 16-bit a and b (VPDPWSSD, or its two AVX-512 BW steps) */
static inline __attribute__((always_inline)) __m512i dot_words(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* MR rows (int16) x one block, groups of G: sums[r] over the groups so far, dot[c][r] the group's
 * integer dot products (CHAINS dependency chains a row, pairs alternating between them, so that
 * one or two rows are not held to VPDPWSSD's latency). Each 32 bytes of q, sign-extended, are
 * 16 features x 2 inputs in VPDPWSSD's operand layout; a row's pair of inputs is one broadcast.
 * One block at a time: one sequential stream of weights per thread, as int4_matmul.c measured
 * best at few rows. */
#define DEFINE_TILE(MR, G)                                                                         \
    static void tile_##MR##_##G(const int16_t *xq, int64_t x_stride, const float *x_scales,     \
                                const float *x_sums, int64_t groups, const uint8_t *block,      \
                                int64_t col, int64_t n, const uint16_t *bias, uint16_t *out,    \
                                int64_t out_stride) {                                           \
        enum { CHAINS = MR == 1 ? 4 : MR == 2 ? 2 : 1 };                                         \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t g = 0; g < groups; g++) {                                                   \
            const uint8_t *at = block + g * GROUP_BYTES(G);                                      \
            __m512i dot[CHAINS][MR];                                                             \
            _Pragma("GCC unroll 4") for (int c = 0; c < CHAINS; c++)                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                             \
                    dot[c][r] = _mm512_setzero_si512();                                          \
            /* the lines PREFETCH_GROUPS groups ahead (past the block's end: requested for       \
             * nothing; prefetches do not fault, and the address is an integer) */               \
            _Pragma("GCC unroll 10") for (int line = 0; line < GROUP_BYTES(G) / 64; line++)      \
                _mm_prefetch((const char *)((uintptr_t)at                                        \
                             + (uintptr_t)(PREFETCH_GROUPS * GROUP_BYTES(G) + line * 64)),        \
                             _MM_HINT_T0);                                                       \
            _Pragma("GCC unroll 16") for (int i = 0; i < (G) / 2; i++) {                         \
                const __m512i w = _mm512_cvtepi8_epi16(                                          \
                    _mm256_loadu_si256((const __m256i *)(at + i * 32)));                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    int32_t pair;                                                                \
                    memcpy(&pair, xq + r * x_stride + g * (G) + 2 * i, sizeof pair);             \
                    dot[i % CHAINS][r] = dot_words(dot[i % CHAINS][r], w,                        \
                                                   _mm512_set1_epi32(pair));                     \
                }                                                                                \
            }                                                                                    \
            const float *factors = (const float *)(at + BLOCK * (G));                            \
            const __m512 scale = _mm512_loadu_ps(factors);                                       \
            const __m512 low = _mm512_loadu_ps(factors + BLOCK);                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                               \
                __m512i d = dot[0][r];                                                           \
                _Pragma("GCC unroll 4") for (int c = 1; c < CHAINS; c++)                         \
                    d = _mm512_add_epi32(d, dot[c][r]);                                          \
                const __m512 product = _mm512_mul_ps(                                            \
                    _mm512_cvtepi32_ps(d), _mm512_set1_ps(x_scales[r * groups + g]));            \
                sums[r] = _mm512_fmadd_ps(scale, product, sums[r]);                              \
                sums[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x_sums[r * groups + g]), sums[r]); \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

DEFINE_TILE(1, 16) DEFINE_TILE(2, 16) DEFINE_TILE(4, 16) DEFINE_TILE(8, 16)
DEFINE_TILE(1, 32) DEFINE_TILE(2, 32) DEFINE_TILE(4, 32) DEFINE_TILE(8, 32)
#undef DEFINE_TILE

typedef void (*tile_fn)(const int16_t *, int64_t, const float *, const float *, int64_t,
                        const uint8_t *, int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* [group 16, 32][rows in the tile: 1, 2, 4, 8] */
static const tile_fn TILES[2][4] = {{tile_1_16, tile_2_16, tile_4_16, tile_8_16},
                                    {tile_1_32, tile_2_32, tile_4_32, tile_8_32}};

/* a row [k] of bf16 -> its int16 form (xq [k]: each group's inputs as multiples of d, its largest
 * magnitude / 32767, rounded to nearest), each group's d and its inputs' sum as rounded,
 * d x (sum of xq): with that sum the low's term, too, multiplies the rounded inputs, so the result
 * is the weights times the rounded inputs. A group with an infinity or a NaN gets NaNs, as a
 * float32 product would. */
static void quantize_row(const uint16_t *row, int64_t k, int group, int16_t *xq, float *x_scales,
                         float *x_sums) {
    const __m512 largest_finite = _mm512_set1_ps(3.4028235e38f);
    for (int64_t g = 0; g < k / group; g++) {
        __m512 values[2], largest = _mm512_setzero_ps();
        __mmask16 infinite = 0;
        for (int h = 0; h < group / 16; h++) {
            values[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(row + g * group + 16 * h))), 16));
            const __m512 magnitude = _mm512_abs_ps(values[h]);
            /* true for infinities and (unordered) NaNs */
            infinite |= _mm512_cmp_ps_mask(magnitude, largest_finite, _CMP_NLE_UQ);
            largest = _mm512_max_ps(largest, magnitude);
        }
        const float top = _mm512_reduce_max_ps(largest);
        /* in double: 32767 / top overflows a float for the smallest subnormals */
        const double inverse = !infinite && top > 0.0f ? 32767.0 / top : 0.0;
        __m256i total = _mm256_setzero_si256();
        for (int h = 0; h < group / 16; h++)
            for (int half = 0; half < 2; half++) {
                const __m512d wide = _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(values[h], 1)
                                                          : _mm512_castps512_ps256(values[h]));
                /* to nearest, ties to even (the default rounding); at most 32767 in magnitude */
                const __m256i rounded = _mm512_cvtpd_epi32(_mm512_mul_pd(wide,
                                                                         _mm512_set1_pd(inverse)));
                _mm_storeu_si128((__m128i *)(xq + g * group + 16 * h + 8 * half),
                                 _mm256_cvtepi32_epi16(rounded));
                total = _mm256_add_epi32(total, rounded);
            }
        int32_t lanes[8], sum = 0;
        _mm256_storeu_si256((__m256i *)lanes, total);
        for (int i = 0; i < 8; i++)
            sum += lanes[i];
        const float d = top / 32767.0f;
        x_scales[g] = infinite ? __builtin_nanf("") : d;
        x_sums[g] = infinite ? __builtin_nanf("") : d * (float)sum;
    }
}

/* a block's groups -> the bf16 matmul's layout of its weights ([pairs][16 features][2 inputs]):
 * the 32 bytes of a pair are already in that order. VCVTNE2PS2BF16 rounds as float_to_bf16 (to
 * nearest, ties to even; a NaN quiet) except that it flushes subnormals, which no weight of GGUF's
 * types is (their factors are float16 values or products of them and small integers, so every
 * q * scale + low is 0 or a multiple of 2^-24) */
__attribute__((noinline)) static void unpack_block(const uint8_t *block, int64_t groups, int group,
                                                   uint16_t *to) {
    /* lane 2f + e of 16 float32 lanes takes feature f's factor: features 0-7, then 8-15 */
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *at = block + g * GROUP_BYTES(group);
        const float *factors = (const float *)(at + BLOCK * group);
        const __m512 scale = _mm512_loadu_ps(factors), low = _mm512_loadu_ps(factors + BLOCK);
        const __m512 scale_0 = _mm512_permutexvar_ps(first, scale);
        const __m512 scale_1 = _mm512_permutexvar_ps(second, scale);
        const __m512 low_0 = _mm512_permutexvar_ps(first, low);
        const __m512 low_1 = _mm512_permutexvar_ps(second, low);
        for (int i = 0; i < group / 2; i++) {
            const __m512 q_0 = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32))));
            const __m512 q_1 = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32 + 16))));
            /* q * scale, rounded, then + low, rounded (no fused multiply-add: -ffp-contract=off) */
            const __m512 w_0 = _mm512_add_ps(_mm512_mul_ps(q_0, scale_0), low_0);
            const __m512 w_1 = _mm512_add_ps(_mm512_mul_ps(q_1, scale_1), low_1);
            _mm512_storeu_si512((void *)(to + (g * group / 2 + i) * 2 * BLOCK),
                                (__m512i)_mm512_cvtne2ps_pbh(w_1, w_0));
        }
    }
}

#elif defined(HAVE_AVX2_FMA)

/* 8 bytes of q ([4 features][2 inputs]) -> float32 */
static inline __attribute__((always_inline)) __m256 q_quarter(const uint8_t *at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}

/* 4 features' factors from `factors` -> lanes (f, even input), (f, odd input); `even_only`: the
 * odd lanes 0 (a low, added once a feature) */
static inline __attribute__((always_inline)) __m256 spread(const float *factors, int even_only) {
    const __m256 spread = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(factors)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    return even_only ? _mm256_blend_ps(spread, _mm256_setzero_ps(), 0xaa) : spread;
}

/* MR rows (widened to float32) x HALVES halves of a block (8 features each, from half `first`).
 * A half's pair of inputs is two vectors of 4 features x (even input, odd input), as
 * bf16_tiles.h's AVX2 tiles read the bf16 blocks; a row's pair of inputs is broadcast as one
 * 64-bit value and each feature's sum lies in two lanes until store_half adds them. 16 ymm
 * registers: 4 x MR x HALVES sums and dot products, two widened quarters, a broadcast. */
#define DEFINE_TILE(MR, HALVES, G)                                                                 \
    static void tile_##MR##_##HALVES##_##G(const float *x, int64_t x_stride, const float *x_sums, \
                                           int64_t groups, const uint8_t *block, int first,     \
                                           int64_t col, int64_t n, const uint16_t *bias,        \
                                           uint16_t *out, int64_t out_stride) {                 \
        __m256 sums[MR][HALVES][2];                                                              \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++)                             \
                sums[r][h][0] = sums[r][h][1] = _mm256_setzero_ps();                             \
        for (int64_t g = 0; g < groups; g++) {                                                   \
            const uint8_t *at = block + g * GROUP_BYTES(G);                                      \
            __m256 dot[MR][HALVES][2];                                                           \
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                 \
                _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++)                         \
                    dot[r][h][0] = dot[r][h][1] = _mm256_setzero_ps();                           \
            _Pragma("GCC unroll 10") for (int line = 0; line < GROUP_BYTES(G) / 64; line++)      \
                _mm_prefetch((const char *)((uintptr_t)at                                        \
                             + (uintptr_t)(PREFETCH_GROUPS * GROUP_BYTES(G) + line * 64)),        \
                             _MM_HINT_T0);                                                       \
            _Pragma("GCC unroll 4") for (int i = 0; i < (G) / 2; i++)                            \
                _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++)                         \
                    _Pragma("GCC unroll 2") for (int q = 0; q < 2; q++) {                        \
                        const __m256 w = q_quarter(at + i * 32 + (first + h) * 16 + q * 8);      \
                        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                   \
                            const __m256 in = _mm256_castpd_ps(_mm256_broadcast_sd(              \
                                (const double *)(x + r * x_stride + g * (G) + 2 * i)));          \
                            dot[r][h][q] = _mm256_fmadd_ps(in, w, dot[r][h][q]);                 \
                        }                                                                        \
                    }                                                                            \
            const float *factors = (const float *)(at + BLOCK * (G));                            \
            _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++)                             \
                _Pragma("GCC unroll 2") for (int q = 0; q < 2; q++) {                            \
                    const int f = (first + h) * 8 + q * 4;                                       \
                    const __m256 scale = spread(factors + f, 0);                                 \
                    const __m256 low = spread(factors + BLOCK + f, 1);                           \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                       \
                        sums[r][h][q] = _mm256_fmadd_ps(scale, dot[r][h][q], sums[r][h][q]);     \
                        sums[r][h][q] = _mm256_fmadd_ps(                                         \
                            low, _mm256_set1_ps(x_sums[r * groups + g]), sums[r][h][q]);         \
                    }                                                                            \
                }                                                                                \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 2") for (int h = 0; h < HALVES; h++) {                           \
                const int64_t at = col + (first + h) * 8;                                        \
                if (at < n)                                                                      \
                    store_half(sums[r][h][0], sums[r][h][1], bias, at, (int)(n - at),            \
                               out + r * out_stride);                                            \
            }                                                                                    \
    }

DEFINE_TILE(1, 2, 16) DEFINE_TILE(2, 1, 16) DEFINE_TILE(3, 1, 16)
DEFINE_TILE(1, 2, 32) DEFINE_TILE(2, 1, 32) DEFINE_TILE(3, 1, 32)
#undef DEFINE_TILE

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const uint8_t *, int,
                        int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* [group 16, 32][rows in the tile - 1]: one row takes the whole block, two or three a half */
static const tile_fn TILES[2][3] = {{tile_1_2_16, tile_2_1_16, tile_3_1_16},
                                    {tile_1_2_32, tile_2_1_32, tile_3_1_32}};

/* a row [k] of bf16 -> float32, and its groups' input sums */
static void widen_row(const uint16_t *row, int64_t k, int group, float *wide, float *sums) {
    for (int64_t g = 0; g < k / group; g++) {
        __m256 total = _mm256_setzero_ps();
        for (int i = 0; i < group; i += 8) {
            const __m256 values = widen_8(row + g * group + i);
            _mm256_storeu_ps(wide + g * group + i, values);
            total = _mm256_add_ps(total, values);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, total);
        sums[g] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                  + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    }
}

#endif

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)

/* the calling thread's scratch for a call (its rows' group sums, on AVX2 their float32 form too)
 * and on AVX-512 each thread's unpacked blocks: grown as needed and kept, as calls repeat the same
 * few sizes */
static __thread void *call_scratch;
static __thread size_t call_capacity;
#ifdef HAVE_DPBF16
static __thread void *strip_scratch;
static __thread size_t strip_capacity;
#endif

static void *grown(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        void *bigger = realloc(*buffer, bytes);
        if (!bigger)
            return 0;
        *buffer = bigger;
        *capacity = bytes;
    }
    return *buffer;
}

#ifdef HAVE_DPBF16

/* the rows of a pass against blocks [first, last), STRIP_BLOCKS blocks unpacked at a time into
 * `unpacked` */
static void unpacked_pass(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *packed,
                          int64_t groups, int group, int64_t n, const uint16_t *bias,
                          uint16_t *out, int64_t out_stride, int64_t first, int64_t last,
                          uint16_t *unpacked) {
    const int64_t pairs = groups * group / 2;
    for (int64_t b = first; b < last; b += STRIP_BLOCKS) {
        const int nr = last - b < STRIP_BLOCKS ? (int)(last - b) : STRIP_BLOCKS;
        for (int j = 0; j < nr; j++)
            unpack_block(packed + (b + j) * groups * GROUP_BYTES(group), groups, group,
                         unpacked + j * pairs * 2 * BLOCK);
        /* the strip as the whole weight of its own: its columns from b * BLOCK */
        const uint16_t *strip_bias = bias ? bias + b * BLOCK : 0;
        bf16_blocks(x, rows, x_stride, unpacked, pairs, n - b * BLOCK, strip_bias,
                    out + b * BLOCK, out_stride, 0, nr);
    }
}

/* more than TILE_MAX_ROWS rows: by the bf16 tiles over unpacked blocks */
static int unpacked_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t *packed, int group, int64_t n, const uint16_t *bias,
                           uint16_t *out, int64_t out_stride) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group, pairs = k / 2;
    const size_t strip_bytes = (size_t)(STRIP_BLOCKS * pairs * 2 * BLOCK) * sizeof(uint16_t);
    int failed = 0;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        uint16_t *unpacked = first < last ? grown(&strip_scratch, &strip_capacity, strip_bytes) : 0;
        if (first < last && !unpacked) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t r = 0; r < m && unpacked; r += UNPACKED_ROWS_PER_PASS) {
            const int64_t rows = m - r < UNPACKED_ROWS_PER_PASS ? m - r : UNPACKED_ROWS_PER_PASS;
            unpacked_pass(x + r * x_stride, rows, x_stride, packed, groups, group, n, bias,
                          out + r * out_stride, out_stride, first, last, unpacked);
        }
    }
    return failed ? -2 : 0;
}

#endif

#endif

/* x [m, k] with rows x_stride apart, packed by int8_matmul_pack, bias [n] or NULL -> out [m, n]
 * with rows out_stride apart. Returns 0, -1 where this build has no kernel (or the header is not
 * one of int8_matmul_pack's for this k and n), -2 where its scratch could not be allocated. */
int int8_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed,
                int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
    int64_t header[4];
    memcpy(header, packed, sizeof header);
    const int group = (int)header[1];
    if (header[0] != MAGIC || (group != 16 && group != 32) || header[2] != k || header[3] != n
        || k <= 0 || k % group)
        return -1;
    if (m <= 0)
        return 0;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group;
    const uint8_t *weights = packed + HEADER_BYTES;
    const int which = group == 32;
#endif
#ifdef HAVE_DPBF16
    if (m > TILE_MAX_ROWS)
        return unpacked_matmul(x, m, k, x_stride, weights, group, n, bias, out, out_stride);
    /* the rows' int16 form, then each group's d and input sum */
    int16_t *xq = grown(&call_scratch, &call_capacity,
                        (size_t)(m * k) * sizeof(int16_t) + (size_t)(2 * m * groups) * sizeof(float));
    if (!xq)
        return -2;
    float *x_scales = (float *)(xq + m * k), *x_sums = x_scales + m * groups;
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * x_stride, k, group, xq + r * k, x_scales + r * groups,
                     x_sums + r * groups);
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        const int level = m >= 8 ? 3 : m >= 4 ? 2 : m >= 2 ? 1 : 0;
        for (int64_t b = first; b < last; b++) {
            int64_t r = 0;
            for (int lv = level; lv >= 0; lv--)
                for (; r + (1 << lv) <= m; r += 1 << lv)
                    TILES[which][lv](xq + r * k, k, x_scales + r * groups, x_sums + r * groups,
                                     groups, weights + b * groups * GROUP_BYTES(group),
                                     b * BLOCK, n, bias, out + r * out_stride, out_stride);
        }
    }
    return 0;
#elif defined(HAVE_AVX2_FMA)
    /* a pass's rows as float32, then their group sums */
    const int64_t pass_rows = m < ROWS_PER_PASS ? m : ROWS_PER_PASS;
    float *wide = grown(&call_scratch, &call_capacity,
                        (size_t)(pass_rows * (k + groups)) * sizeof(float));
    if (!wide)
        return -2;
    float *x_sums = wide + pass_rows * k;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t pass = 0; pass < m; pass += ROWS_PER_PASS) {
            const int64_t rows = m - pass < ROWS_PER_PASS ? m - pass : ROWS_PER_PASS;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                widen_row(x + (pass + i) * x_stride, k, group, wide + i * k, x_sums + i * groups);
            /* (the loop's barrier: every row is widened before any thread reads them) */
            for (int64_t b = first; b < last; b++) {
                const uint8_t *block = weights + b * groups * GROUP_BYTES(group);
                int64_t r = 0;
                for (; r + 3 <= rows; r += 3)
                    for (int h = 0; h < 2; h++)
                        TILES[which][2](wide + r * k, k, x_sums + r * groups, groups, block, h,
                                        b * BLOCK, n, bias, out + (pass + r) * out_stride,
                                        out_stride);
                if (rows - r == 2)
                    for (int h = 0; h < 2; h++)
                        TILES[which][1](wide + r * k, k, x_sums + r * groups, groups, block, h,
                                        b * BLOCK, n, bias, out + (pass + r) * out_stride,
                                        out_stride);
                else if (rows - r == 1)
                    TILES[which][0](wide + r * k, k, x_sums + r * groups, groups, block, 0,
                                    b * BLOCK, n, bias, out + (pass + r) * out_stride, out_stride);
            }
            /* every thread is done with the pass's rows before they are overwritten */
#pragma omp barrier
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out,
        (void)out_stride;
    return -1;
#endif
}
