/* y = x W^T (+ b) for bf16 x [m, k] and a 4-bit W [n, k] (groups of 32 input features, each with a
 * float32 scale and minimum: w = q * scale + low, q in 0..15, GGUF's Q4_1 form), on CPUs with
 * AVX-512 BF16 or AVX2. Decode-size batches, where reading the weights sets the time, multiply by
 * the 4-bit form itself: a quarter of bf16's bytes for the values, plus 8 bytes a group.
 *
 * Packing, per block of 16 output features and group of 32 inputs (384 bytes, blocks after one
 * another, a block's groups in order): 8 x 32 bytes of 4-bit values, byte [i][f][e] holding input
 * 2i + e of feature f in its low half and input 2(i + 8) + e in its high half, then the 16 scales
 * and the 16 minimums.
 *
 * AVX-512 BF16: widened to 16-bit lanes, masked and or-ed with 0x4300, a half is the bf16 of
 * 128 + q (bf16 holds 128..143 exactly), in VDPBF16PS's operand layout ([16 features][2 inputs]).
 * So a group's dot product D = sum (128 + q) x comes from 16 VDPBF16PS per row, and the row's
 * result gains scale * D + (low - 128 scale) * X, X the row's sum of the group's inputs. D and X
 * in float32 (each product exact, the sums rounded), the group's terms added in float32, the
 * result rounded once to bf16. The 128 offset costs about 7 bits of D's float32 precision, far
 * below the 4-bit weights' own error. Past TILE_MAX_ROWS rows (prefills, large decode batches),
 * where the arithmetic, not reading the weights, sets the time, each thread unpacks a few blocks
 * at a time into the bf16 matmul's layout, the bf16 of q * scale + low (a float32 product, then a
 * float32 sum: built with -ffp-contract=off, so no compiler fuses them), and runs that kernel's
 * tiles (bf16_tiles.h) over the rows: a large batch gets what a bf16 layer of those weights
 * gives, bit for bit.
 *
 * AVX2 (no bf16 arithmetic): integer dot products against the rows rounded to int8, for every
 * batch size (see the AVX2 section below).
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

#define GROUP 32 /* input features sharing a scale and a minimum */
#define GROUP_BYTES (BLOCK * GROUP / 2 + 2 * BLOCK * 4)
#define PARALLEL_MIN_WORK (1 << 16)
/* how many groups (384 bytes each) ahead a tile asks for its blocks' lines */
#define PREFETCH_GROUPS 4
#if defined(HAVE_DPBF16)
/* up to how many rows the 4-bit tiles below run. A decode step's matmuls of SmolLM2's 30 layers,
 * weights streamed from memory (benchmarks/matmul_bench.py --step), against the bf16 matmul's
 * time: AVX-512 BF16 tiles 0.51x at 1 row, 0.82x at 8, 0.94-0.99x at 12-16, 1.06-1.13x at 24-32,
 * where unpacking took 1.17-1.29x at 12-32 rows and 1.05-1.14x at 48-128. (AVX2's integer tiles
 * take every batch: 0.45-0.52x the bf16 matmul's time at 1-8 rows, 0.65-0.80x at 64-4,096.) */
#define TILE_MAX_ROWS 32
/* rows a pass over the unpacked blocks takes (their inputs stay in L2 or L3 while each thread
 * unpacks its blocks once a pass) */
#define UNPACKED_ROWS_PER_PASS 256
/* blocks a thread unpacks at a time: the widest bf16 tile at many rows */
#define STRIP_BLOCKS 3
#else
/* no limit: every batch runs the integer tiles */
#define TILE_MAX_ROWS 0
/* rows the integer tiles take against each thread's blocks before the next rows (their int8 form
 * stays in L2 meanwhile) */
#define ROWS_PER_PASS 256
#endif

/* 1: AVX-512 BF16 dot products; 2: integer dot products on AVX2; 0: no kernel in this build */
int int4_matmul_supported(void) { return matmul_form(); }

/* up to how many rows a call runs the 4-bit tiles (more: the unpacked blocks); 0: every batch */
int int4_matmul_tile_rows(void) { return TILE_MAX_ROWS; }

int64_t int4_matmul_packed_bytes(int64_t n, int64_t k) {
    return (n + BLOCK - 1) / BLOCK * (k / GROUP) * GROUP_BYTES;
}

/* q [n, k] (values 0..15, one a byte), scale and low [n, k / 32] -> out (k a multiple of 32);
 * features past n are zeros with scale and minimum 0 */
void int4_matmul_pack(const uint8_t *q, const float *scale, const float *low, int64_t n,
                      int64_t k, uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *to = out + (b * groups + g) * GROUP_BYTES;
            for (int i = 0; i < 8; i++)
                for (int f = 0; f < BLOCK; f++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t row = b * BLOCK + f, col = g * GROUP + 2 * i + e;
                        const uint8_t first = row < n ? q[row * k + col] & 15 : 0;
                        const uint8_t second = row < n ? q[row * k + col + 16] & 15 : 0;
                        to[(i * BLOCK + f) * 2 + e] = (uint8_t)(first | second << 4);
                    }
            float *factors = (float *)(to + BLOCK * GROUP / 2);
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

/* MR rows x one block: sums[r] over the groups so far, dot[r] and dot_high[r] within the group (its
 * low and high halves apart: two dependency chains of 8, not one of 16). One block at a time: one
 * sequential stream of weights per thread ran 1.2-1.3x faster than tiles of 2-4 blocks
 * (interleaved streams) at 1-2 rows. 32 zmm registers: 3 x MR sums, 2 widened halves, 2
 * broadcasts, 3 constants. */
#define DEFINE_TILE(MR)                                                                            \
    static void tile_##MR(const uint16_t *x, int64_t x_stride, const float *x_sums,             \
                          int64_t groups, const uint8_t *block, int64_t col, int64_t n,          \
                          const uint16_t *bias, uint16_t *out, int64_t out_stride) {             \
        const __m512i nibble = _mm512_set1_epi16(0x000f), offset = _mm512_set1_epi16(0x4300);   \
        const __m512 minus_128 = _mm512_set1_ps(-128.0f);                                       \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t g = 0; g < groups; g++) {                                                   \
            const uint8_t *at = block + g * GROUP_BYTES;                                         \
            __m512 dot[MR], dot_high[MR];                                                        \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                 \
                dot[r] = dot_high[r] = _mm512_setzero_ps();                                      \
            /* the lines PREFETCH_GROUPS groups ahead (past the block's end: requested for       \
             * nothing; prefetches do not fault, and the address is an integer) */               \
            _Pragma("GCC unroll 6") for (int line = 0; line < GROUP_BYTES / 64; line++)          \
                _mm_prefetch((const char *)((uintptr_t)at                                        \
                             + (uintptr_t)(PREFETCH_GROUPS * GROUP_BYTES + line * 64)),           \
                             _MM_HINT_T0);                                                       \
            for (int i = 0; i < 8; i++) {                                                        \
                const __m512i bytes = _mm512_cvtepu8_epi16(                                      \
                    _mm256_loadu_si256((const __m256i *)(at + i * 32)));                         \
                /* (bytes & 0xf) | 0x4300, and the same of bytes >> 4: bf16 of 128 + q */        \
                const __m512bh low = (__m512bh)_mm512_ternarylogic_epi32(bytes, nibble, offset,  \
                                                                         0xea);                  \
                const __m512bh high = (__m512bh)_mm512_ternarylogic_epi32(                       \
                    _mm512_srli_epi16(bytes, 4), nibble, offset, 0xea);                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    int32_t first, second;                                                       \
                    memcpy(&first, x + r * x_stride + g * GROUP + 2 * i, sizeof first);          \
                    memcpy(&second, x + r * x_stride + g * GROUP + 2 * i + 16, sizeof second);   \
                    dot[r] = _mm512_dpbf16_ps(dot[r], (__m512bh)_mm512_set1_epi32(first), low);  \
                    dot_high[r] = _mm512_dpbf16_ps(dot_high[r],                                  \
                                                   (__m512bh)_mm512_set1_epi32(second), high);   \
                }                                                                                \
            }                                                                                    \
            const float *factors = (const float *)(at + BLOCK * GROUP / 2);                      \
            const __m512 scale = _mm512_loadu_ps(factors);                                       \
            /* low - 128 scale: what each unit of the row's input sum adds */                    \
            const __m512 base = _mm512_fmadd_ps(minus_128, scale,                                \
                                                _mm512_loadu_ps(factors + BLOCK));               \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                               \
                sums[r] = _mm512_fmadd_ps(scale, _mm512_add_ps(dot[r], dot_high[r]), sums[r]);   \
                sums[r] = _mm512_fmadd_ps(base, _mm512_set1_ps(x_sums[r * groups + g]), sums[r]); \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(4) DEFINE_TILE(8)

typedef void (*tile_fn)(const uint16_t *, int64_t, const float *, int64_t, const uint8_t *,
                        int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* by rows in the tile: 1, 2, 4, 8 */
static const tile_fn TILES[4] = {tile_1, tile_2, tile_4, tile_8};

/* a block's groups -> the bf16 matmul's layout of its weights ([pairs][16 features][2 inputs]):
 * the 32 bytes i of group g hold pair 16g + i in their low halves and 16g + i + 8 in the high
 * ones, already in feature-major, input-minor order. VCVTNE2PS2BF16 rounds as float_to_bf16
 * (to nearest, ties to even; a NaN quiet) except that it flushes subnormals, which no weight of
 * this form is (int4_kernel.quantize: a product is 0 or at least 1e-12, a minimum not subnormal) */
__attribute__((noinline)) static void unpack_block(const uint8_t *block, int64_t groups,
                                                   uint16_t *to) {
    const __m512i nibble = _mm512_set1_epi32(15);
    /* lane 2f + e of 16 float32 lanes takes feature f's factor: features 0-7, then 8-15 */
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *at = block + g * GROUP_BYTES;
        const float *factors = (const float *)(at + BLOCK * GROUP / 2);
        const __m512 scale = _mm512_loadu_ps(factors), low = _mm512_loadu_ps(factors + BLOCK);
        const __m512 scale_0 = _mm512_permutexvar_ps(first, scale);
        const __m512 scale_1 = _mm512_permutexvar_ps(second, scale);
        const __m512 low_0 = _mm512_permutexvar_ps(first, low);
        const __m512 low_1 = _mm512_permutexvar_ps(second, low);
        for (int i = 0; i < 8; i++) {
            /* features 0-7, then 8-15, one byte a lane */
            const __m512i bytes_0 =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32)));
            const __m512i bytes_1 =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32 + 16)));
            /* q * scale, rounded, then + low, rounded (no fused multiply-add: -ffp-contract=off) */
#define WEIGHTS(q, s, l) _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), l)
            const __m512 low_half_0 = WEIGHTS(_mm512_and_si512(bytes_0, nibble), scale_0, low_0);
            const __m512 low_half_1 = WEIGHTS(_mm512_and_si512(bytes_1, nibble), scale_1, low_1);
            const __m512 high_half_0 = WEIGHTS(_mm512_srli_epi32(bytes_0, 4), scale_0, low_0);
            const __m512 high_half_1 = WEIGHTS(_mm512_srli_epi32(bytes_1, 4), scale_1, low_1);
#undef WEIGHTS
            _mm512_storeu_si512((void *)(to + (16 * g + i) * 2 * BLOCK),
                                (__m512i)_mm512_cvtne2ps_pbh(low_half_1, low_half_0));
            _mm512_storeu_si512((void *)(to + (16 * g + i + 8) * 2 * BLOCK),
                                (__m512i)_mm512_cvtne2ps_pbh(high_half_1, high_half_0));
        }
    }
}


#elif defined(HAVE_AVX2_FMA)

/* AVX2: integer dot products, as llama.cpp multiplies Q4_1 by its Q8_1 activations. Each row's
 * group of 32 inputs is held as int8 (the group's largest magnitude as 127, xq = round(x * 127 /
 * max), d = max / 127), so a weight's q times an input is one VPMADDUBSW lane: the 32 bytes i of a
 * group, masked (low halves: inputs 2i, 2i + 1 of the 16 features) or shifted and masked (high
 * halves: inputs 16 + 2i, 17 + 2i), against the row's pair of int8 inputs broadcast, give each
 * feature's sum of two products in 16 bits (at most 2 x 15 x 127), eight of them added in 16 bits
 * (at most 30,480) for the low halves and eight for the high ones. A group then adds
 * scale * d * D + low * X to each feature, D the integer dot product and X the sum of the
 * group's inputs as rounded, d * (sum of xq). Three times fewer instructions a weight than float32 FMAs on the widened
 * nibbles, which held the 4-bit form to 2-3x bf16's arithmetic time on AVX2. The cost: each
 * input's rounding to 1/254 of its group's largest magnitude (the bound in
 * tests/unit/shard/test_int4_kernel.py), an error llama.cpp's 4-bit models carry too. */

/* int16 lanes f of the low and high sums -> float32 features [0-3, 8-11] and [4-7, 12-15] */
static inline __attribute__((always_inline)) void
widen_dots(__m256i low_sums, __m256i high_sums, __m256 *first, __m256 *second) {
    const __m256i ones = _mm256_set1_epi16(1);
    *first = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpacklo_epi16(low_sums, high_sums), ones));
    *second = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpackhi_epi16(low_sums, high_sums), ones));
}

/* 16 features' sums in widen_dots's order ([0-3, 8-11], [4-7, 12-15]) -> bf16 out[col..] */
static inline __attribute__((always_inline)) void
store_features(__m256 first, __m256 second, const uint16_t *bias, int64_t col, int valid,
               uint16_t *out) {
    __m256 halves[2] = {_mm256_permute2f128_ps(first, second, 0x20),
                        _mm256_permute2f128_ps(first, second, 0x31)};
    for (int h = 0; h < 2 && valid > 8 * h; h++) {
        const int64_t at = col + 8 * h;
        if (valid - 8 * h >= 8) {
            __m256 sums = halves[h];
            if (bias)
                sums = _mm256_add_ps(sums, widen_8(bias + at));
            _mm_storeu_si128((__m128i *)(out + at), round_to_bf16(sums));
            continue;
        }
        float feature[8];
        _mm256_storeu_ps(feature, halves[h]);
        for (int i = 0; i < valid - 8 * h; i++)
            out[at + i] = float_to_bf16(feature[i] + (bias ? bf16_to_float(bias[at + i]) : 0.0f));
    }
}

/* MR rows x one block: xq [MR][k] int8 rows x_stride apart, their groups' d and input sums
 * [MR][groups] */
#define DEFINE_TILE(MR)                                                                            \
    static void tile_##MR(const int8_t *xq, int64_t x_stride, const float *x_scales,            \
                          const float *x_sums, int64_t groups, const uint8_t *block, int64_t col, \
                          int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {  \
        const __m256i nibble = _mm256_set1_epi8(15);                                             \
        __m256 first[MR], second[MR];                                                            \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            first[r] = second[r] = _mm256_setzero_ps();                                          \
        for (int64_t g = 0; g < groups; g++) {                                                   \
            const uint8_t *at = block + g * GROUP_BYTES;                                         \
            _Pragma("GCC unroll 6") for (int line = 0; line < GROUP_BYTES / 64; line++)          \
                _mm_prefetch((const char *)((uintptr_t)at                                        \
                             + (uintptr_t)(PREFETCH_GROUPS * GROUP_BYTES + line * 64)),           \
                             _MM_HINT_T0);                                                       \
            __m256i low_sums[MR], high_sums[MR];                                                 \
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                 \
                low_sums[r] = high_sums[r] = _mm256_setzero_si256();                             \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                \
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(at + i * 32));        \
                const __m256i low = _mm256_and_si256(bytes, nibble);                             \
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);     \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                           \
                    int16_t pair, high_pair;                                                     \
                    memcpy(&pair, xq + r * x_stride + g * GROUP + 2 * i, sizeof pair);           \
                    memcpy(&high_pair, xq + r * x_stride + g * GROUP + 16 + 2 * i,               \
                           sizeof high_pair);                                                    \
                    low_sums[r] = _mm256_add_epi16(                                              \
                        low_sums[r], _mm256_maddubs_epi16(low, _mm256_set1_epi16(pair)));        \
                    high_sums[r] = _mm256_add_epi16(                                             \
                        high_sums[r], _mm256_maddubs_epi16(high, _mm256_set1_epi16(high_pair))); \
                }                                                                                \
            }                                                                                    \
            const float *factors = (const float *)(at + BLOCK * GROUP / 2);                      \
            const __m256 scale_0 = _mm256_loadu_ps(factors), scale_1 = _mm256_loadu_ps(factors + 8); \
            const __m256 low_0 = _mm256_loadu_ps(factors + BLOCK);                               \
            const __m256 low_1 = _mm256_loadu_ps(factors + BLOCK + 8);                           \
            /* in widen_dots's order */                                                          \
            const __m256 scale_a = _mm256_permute2f128_ps(scale_0, scale_1, 0x20);               \
            const __m256 scale_b = _mm256_permute2f128_ps(scale_0, scale_1, 0x31);               \
            const __m256 low_a = _mm256_permute2f128_ps(low_0, low_1, 0x20);                     \
            const __m256 low_b = _mm256_permute2f128_ps(low_0, low_1, 0x31);                     \
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                               \
                __m256 dot_a, dot_b;                                                             \
                widen_dots(low_sums[r], high_sums[r], &dot_a, &dot_b);                           \
                const __m256 d = _mm256_set1_ps(x_scales[r * groups + g]);                       \
                const __m256 sum = _mm256_set1_ps(x_sums[r * groups + g]);                       \
                first[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_a, dot_a), d,                     \
                                           _mm256_fmadd_ps(low_a, sum, first[r]));               \
                second[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_b, dot_b), d,                    \
                                            _mm256_fmadd_ps(low_b, sum, second[r]));             \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            store_features(first[r], second[r], bias, col, (int)(n - col), out + r * out_stride); \
    }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(4)

typedef void (*tile_fn)(const int8_t *, int64_t, const float *, const float *, int64_t,
                        const uint8_t *, int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* by rows in the tile: 1, 2, 4 */
static const tile_fn TILES[3] = {tile_1, tile_2, tile_4};

/* a row [k] of bf16 -> its int8 form (xq [k]), each group's d and the sum of its inputs as
 * rounded, d x (sum of xq) ([k / 32]): with that sum the minimum's term, too, multiplies the
 * rounded inputs, so the result is the weights times the rounded inputs (half the error, at most,
 * of the exact sum beside q's term: q * scale spans twice what a centred weight does) */
static void quantize_row(const uint16_t *x, int64_t k, int8_t *xq, float *x_scales,
                         float *x_sums) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        float values[GROUP], largest = 0.0f;
        int finite = 1;
        for (int i = 0; i < GROUP; i++) {
            values[i] = bf16_to_float(x[g * GROUP + i]);
            const float magnitude = values[i] < 0 ? -values[i] : values[i];
            finite &= magnitude <= 3.4e38f; /* false for infinities and NaNs */
            largest = magnitude > largest ? magnitude : largest;
        }
        /* in double: 127 / largest overflows a float for the smallest subnormals */
        const int usable = finite && largest > 0.0f;
        const double inverse = usable ? 127.0 / largest : 0.0;
        int32_t total = 0;
        for (int i = 0; i < GROUP; i++) {
            const int8_t value = usable ? (int8_t)__builtin_nearbyint(values[i] * inverse) : 0;
            xq[g * GROUP + i] = value;
            total += value;
        }
        const float d = largest / 127.0f;
        /* a group with an infinity or a NaN gives NaNs, as a float32 product would */
        x_scales[g] = finite ? d : __builtin_nanf("");
        x_sums[g] = finite ? d * (float)total : __builtin_nanf("");
    }
}

#endif

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)

/* the calling thread's scratch for a call (its rows' group sums, or on AVX2 their int8 form too)
 * and each thread's unpacked blocks: grown as needed and kept, as calls repeat the same few sizes
 * (STRIP_BLOCKS blocks) */
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
static void unpacked_pass(const uint16_t *x, int64_t rows, int64_t x_stride,
                          const uint8_t *packed, int64_t groups, int64_t n,
                          const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t first,
                          int64_t last, uint16_t *unpacked) {
    const int64_t pairs = groups * GROUP / 2;
    for (int64_t b = first; b < last; b += STRIP_BLOCKS) {
        const int nr = last - b < STRIP_BLOCKS ? (int)(last - b) : STRIP_BLOCKS;
        for (int j = 0; j < nr; j++)
            unpack_block(packed + (b + j) * groups * GROUP_BYTES, groups,
                         unpacked + j * pairs * 2 * BLOCK);
        /* the strip as the whole weight of its own: its columns from b * BLOCK */
        const uint16_t *strip_bias = bias ? bias + b * BLOCK : 0;
        bf16_blocks(x, rows, x_stride, unpacked, pairs, n - b * BLOCK, strip_bias,
                    out + b * BLOCK, out_stride, 0, nr);
    }
}

/* more than TILE_MAX_ROWS rows: by the bf16 tiles over unpacked blocks */
static int unpacked_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t *packed, int64_t n, const uint16_t *bias, uint16_t *out,
                           int64_t out_stride) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP, pairs = k / 2;
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
            unpacked_pass(x + r * x_stride, rows, x_stride, packed, groups, n, bias,
                          out + r * out_stride, out_stride, first, last, unpacked);
        }
    }
    return failed ? -2 : 0;
}

#endif

#endif

/* x [m, k] with rows x_stride apart, packed by int4_matmul_pack, bias [n] or NULL -> out [m, n]
 * with rows out_stride apart. Returns 0, -1 where this build has no kernel (or k is not a
 * positive multiple of 32), -2 where its scratch could not be allocated. */
int int4_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed,
                int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    if (m <= 0 || n <= 0)
        return 0;
    if (k <= 0 || k % GROUP)
        return -1;
#endif
#ifdef HAVE_DPBF16
    if (m > TILE_MAX_ROWS)
        return unpacked_matmul(x, m, k, x_stride, packed, n, bias, out, out_stride);
    float *x_sums = grown(&call_scratch, &call_capacity, (size_t)(m * groups) * sizeof(float));
    if (!x_sums)
        return -2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int i = 0; i < GROUP; i++)
                sum += bf16_to_float(x[r * x_stride + g * GROUP + i]);
            x_sums[r * groups + g] = sum;
        }
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        const int level = m >= 8 ? 3 : m >= 4 ? 2 : m >= 2 ? 1 : 0;
        for (int64_t b = first; b < last; b++) {
            int64_t r = 0;
            for (int lv = level; lv >= 0; lv--)
                for (; r + (1 << lv) <= m; r += 1 << lv)
                    TILES[lv](x + r * x_stride, x_stride, x_sums + r * groups, groups,
                              packed + b * groups * GROUP_BYTES, b * BLOCK, n, bias,
                              out + r * out_stride, out_stride);
        }
    }
    return 0;
#elif defined(HAVE_AVX2_FMA)
    /* the rows' int8 form, then each group's d and input sum */
    int8_t *xq = grown(&call_scratch, &call_capacity,
                       (size_t)(m * k) + (size_t)(2 * m * groups) * sizeof(float) + 64);
    if (!xq)
        return -2;
    float *x_scales = (float *)(xq + (m * k + 63) / 64 * 64), *x_sums = x_scales + m * groups;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            quantize_row(x + r * x_stride, k, xq + r * k, x_scales + r * groups,
                         x_sums + r * groups);
        /* (the loop's barrier: every row is ready before any thread reads them) */
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t pass = 0; pass < m; pass += ROWS_PER_PASS) {
            const int64_t end = m - pass < ROWS_PER_PASS ? m : pass + ROWS_PER_PASS;
            const int level = end - pass >= 4 ? 2 : end - pass >= 2 ? 1 : 0;
            for (int64_t b = first; b < last; b++) {
                int64_t r = pass;
                for (int lv = level; lv >= 0; lv--)
                    for (; r + (1 << lv) <= end; r += 1 << lv)
                        TILES[lv](xq + r * k, k, x_scales + r * groups, x_sums + r * groups,
                                  groups, packed + b * groups * GROUP_BYTES, b * BLOCK, n, bias,
                                  out + r * out_stride, out_stride);
            }
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out,
        (void)out_stride;
    return -1;
#endif
}
