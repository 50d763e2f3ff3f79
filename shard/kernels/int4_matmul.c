/* y = x W^T (+ b) for bf16 x [m, k] and a 4-bit W [n, k] (groups of 32 input features, each with a
 * scale and a minimum: w = q * scale + low, q in 0..15, the product rounded to float32, then the
 * sum), on CPUs with AVX-512 BF16 or AVX2. Decode-size batches, where reading the weights sets the
 * time, multiply by the 4-bit form itself: a quarter of bf16's bytes for the values, plus the
 * factors, held in one of three modes (a header says which):
 *   F: float32 scale and low per group and feature (any factors: `--quantize int4`, GGUF's Q4_1
 *      widened): 6 bits a weight.
 *   K: GGUF's Q4_K in its own terms: per superblock of 256 inputs (8 groups) and feature, float32 d
 *      and dmin; per group and feature 6-bit sc and m (a byte each); scale = d * sc and low =
 *      -(dmin * m) in float32 (both exact: d is a float16's value, sc and m below 64): 4.75 bits.
 *   H: float16 scale and low per group and feature (Q4_1; Q4_0 with low -8d), widened exactly: 5.
 * Every path computes a group's float32 scale and low from the compact factors as it reaches the
 * group, so each mode's weights are the same float32 values its `restore` (int4_matmul.py) gives.
 *
 * Packing: a 64-byte header (int64 magic, mode, k, n), then per block of 16 output features (blocks
 * after one another; features past n zeros, with zero factors) its groups in order. A group's
 * nibbles are 8 x 32 bytes, byte [i][f][e] holding input 2i + e of feature f in its low half and
 * input 2(i + 8) + e in its high half. F: each group's nibbles, then its 16 scales and 16 lows
 * (384 bytes). H: the same with float16 factors (320 bytes). K: per superblock its 16 d, 16 dmin
 * (float32), sc [8 groups][16], m [8][16], then its 8 groups' nibbles (2,432 bytes: the factors
 * first, so a tile reads d and dmin once a superblock). The header also lets a call refuse a
 * buffer packed for another shape: the matmul's signature (bf16_matmul's, as the C decode step
 * calls each kernel through one function-pointer type) has no room for the mode.
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
 * AVX-512 VNNI (every AVX-512 BF16 CPU so far: Cooper Lake, Sapphire Rapids and later, Zen 4),
 * and AVX2 (no bf16 arithmetic): integer dot products against the rows rounded to int8 a group
 * of 32 inputs, as llama.cpp rounds its activations, for every batch size, so a row's result does
 * not depend on how many rows share the call (see the VNNI and AVX2 sections below). The
 * VDPBF16PS tiles and unpacked blocks above then serve only an AVX-512 BF16 CPU without VNNI.
 * On a Xeon (Emerald Rapids, 2 threads, benchmarks/matmul_bench.py --gguf) VNNI took Q4_K at
 * 4096x4096 from 91 GFLOP/s to 183 at 1 row and from 144-177 to 653-678 at 8-512 rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_rows.h"
#include "matmul_isa.h"
#if defined(HAVE_DPBF16)
#include "bf16_tiles.h"
#elif defined(HAVE_AVX2_FMA)
#include "bf16_store.h"
#endif

#define GROUP 32 /* input features sharing a scale and a minimum */
#define HEADER_BYTES 64
/* "INT4PACK", little-endian: a header this library wrote */
#define MAGIC 0x4b43415034544e49LL
enum { MODE_F = 0, MODE_K = 1, MODE_H = 2 };
/* a group's 4-bit values of 16 features */
#define NIBBLE_BYTES (BLOCK * GROUP / 2)
#define F_GROUP_BYTES (NIBBLE_BYTES + 2 * BLOCK * 4)
#define H_GROUP_BYTES (NIBBLE_BYTES + 2 * BLOCK * 2)
/* groups of a K superblock, the bytes of its factors (d, dmin; sc, m) and of all of it */
#define SUPER_GROUPS 8
#define K_FACTOR_BYTES (2 * BLOCK * 4 + 2 * SUPER_GROUPS * BLOCK)
#define K_SUPER_BYTES (K_FACTOR_BYTES + SUPER_GROUPS * NIBBLE_BYTES)
/* a mode's bytes a group in a block's stream (K: a superblock's over its 8 groups, 304) and the
 * groups a tile's loop takes at once (K: a superblock, its d and dmin read once) */
#define STRIDE(MODE) ((MODE) == MODE_F ? F_GROUP_BYTES                                           \
                      : (MODE) == MODE_H ? H_GROUP_BYTES : K_SUPER_BYTES / SUPER_GROUPS)
#define SPAN(MODE) ((MODE) == MODE_K ? SUPER_GROUPS : 1)
/* group j's nibbles of a span starting at `first` */
#define NIBBLES(MODE, first, j) ((MODE) == MODE_K ? (first) + K_FACTOR_BYTES + (j) * NIBBLE_BYTES \
                                 : (first))
#define PARALLEL_MIN_WORK (1 << 16)
/* how many groups' bytes ahead a tile asks for its block's lines */
#define PREFETCH_GROUPS 4
#if defined(HAVE_DPBF16)
/* up to how many rows the 4-bit tiles below run. A decode step's matmuls of SmolLM2's 30 layers,
 * weights streamed from memory (benchmarks/matmul_bench.py --step), against the bf16 matmul's
 * time: AVX-512 BF16 tiles 0.51x at 1 row, 0.82x at 8, 0.94-0.99x at 12-16, 1.06-1.13x at 24-32,
 * where unpacking took 1.17-1.29x at 12-32 rows and 1.05-1.14x at 48-128 (mode F). (AVX2's
 * integer tiles take every batch: 0.45-0.52x the bf16 matmul's time at 1-8 rows, 0.65-0.80x at
 * 64-4,096.) */
#define TILE_MAX_ROWS 32
#ifdef HAVE_VNNI512
/* (with VNNI, none of that: the integer tiles take every batch) */
#undef TILE_MAX_ROWS
#define TILE_MAX_ROWS 0
#define ROWS_PER_PASS 256
#endif
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

/* 1: AVX-512 BF16 dot products; 2: integer dot products on AVX2; 3: on AVX-512 VNNI; 0: no
 * kernel in this build */
int int4_matmul_supported(void) {
#ifdef HAVE_VNNI512
    return 3;
#else
    return matmul_form();
#endif
}

/* up to how many rows a call runs the 4-bit tiles (more: the unpacked blocks); 0: every batch */
int int4_matmul_tile_rows(void) { return TILE_MAX_ROWS; }

/* 0 where mode, k and n make a packed weight (k whole groups; for K whole superblocks), else -1 */
static int shape_check(int64_t mode, int64_t n, int64_t k) {
    const int64_t inputs = mode == MODE_K ? SUPER_GROUPS * GROUP : GROUP;
    return (mode == MODE_F || mode == MODE_K || mode == MODE_H) && n > 0 && k > 0 && k % inputs == 0
               ? 0 : -1;
}

/* -1 where shape_check refuses them */
int64_t int4_matmul_packed_bytes(int64_t n, int64_t k, int64_t mode) {
    if (shape_check(mode, n, k))
        return -1;
    return HEADER_BYTES + (n + BLOCK - 1) / BLOCK * (k / GROUP) * STRIDE(mode);
}

static void write_header(int64_t mode, int64_t n, int64_t k, uint8_t *out) {
    const int64_t header[4] = {MAGIC, mode, k, n};
    memset(out, 0, HEADER_BYTES);
    memcpy(out, header, sizeof header);
}

/* group g of block b of q [n, k] (values 0..15, one a byte) -> its NIBBLE_BYTES at `to` */
static void pack_nibbles(const uint8_t *q, int64_t n, int64_t k, int64_t b, int64_t g,
                         uint8_t *to) {
    for (int i = 0; i < 8; i++)
        for (int f = 0; f < BLOCK; f++)
            for (int e = 0; e < 2; e++) {
                const int64_t row = b * BLOCK + f, col = g * GROUP + 2 * i + e;
                const uint8_t first = row < n ? q[row * k + col] & 15 : 0;
                const uint8_t second = row < n ? q[row * k + col + 16] & 15 : 0;
                to[(i * BLOCK + f) * 2 + e] = (uint8_t)(first | second << 4);
            }
}

/* mode F: q [n, k], scale and low [n, k / 32] float32 -> out (int4_matmul_packed_bytes of them) */
void int4_matmul_pack(const uint8_t *q, const float *scale, const float *low, int64_t n,
                      int64_t k, uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    write_header(MODE_F, n, k, out);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *to = out + HEADER_BYTES + (b * groups + g) * F_GROUP_BYTES;
            pack_nibbles(q, n, k, b, g, to);
            for (int f = 0; f < BLOCK; f++) {
                const int64_t row = b * BLOCK + f;
                const float s = row < n ? scale[row * groups + g] : 0.0f;
                const float l = row < n ? low[row * groups + g] : 0.0f;
                memcpy(to + NIBBLE_BYTES + 4 * f, &s, sizeof s);
                memcpy(to + NIBBLE_BYTES + 4 * (BLOCK + f), &l, sizeof l);
            }
        }
}

/* mode H: q [n, k], scale and low [n, k / 32] float16 bits -> out */
void int4_matmul_pack_half(const uint8_t *q, const uint16_t *scale, const uint16_t *low,
                           int64_t n, int64_t k, uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    write_header(MODE_H, n, k, out);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *to = out + HEADER_BYTES + (b * groups + g) * H_GROUP_BYTES;
            pack_nibbles(q, n, k, b, g, to);
            for (int f = 0; f < BLOCK; f++) {
                const int64_t row = b * BLOCK + f;
                const uint16_t s = row < n ? scale[row * groups + g] : 0;
                const uint16_t l = row < n ? low[row * groups + g] : 0;
                memcpy(to + NIBBLE_BYTES + 2 * f, &s, sizeof s);
                memcpy(to + NIBBLE_BYTES + 2 * (BLOCK + f), &l, sizeof l);
            }
        }
}

/* mode K: q [n, k], d and dmin [n, k / 256] float32, sc and m [n, k / 32] (0..63) -> out */
void int4_matmul_pack_k(const uint8_t *q, const float *d, const uint8_t *sc, const float *dmin,
                        const uint8_t *m, int64_t n, int64_t k, uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    const int64_t supers = groups / SUPER_GROUPS;
    write_header(MODE_K, n, k, out);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *to = out + HEADER_BYTES + (b * supers + s) * K_SUPER_BYTES;
            for (int f = 0; f < BLOCK; f++) {
                const int64_t row = b * BLOCK + f;
                const float scale = row < n ? d[row * supers + s] : 0.0f;
                const float low = row < n ? dmin[row * supers + s] : 0.0f;
                memcpy(to + 4 * f, &scale, sizeof scale);
                memcpy(to + 4 * (BLOCK + f), &low, sizeof low);
                for (int j = 0; j < SUPER_GROUPS; j++) {
                    const int64_t g = s * SUPER_GROUPS + j;
                    to[2 * BLOCK * 4 + j * BLOCK + f] = row < n ? sc[row * groups + g] & 63 : 0;
                    to[2 * BLOCK * 4 + (SUPER_GROUPS + j) * BLOCK + f] =
                        row < n ? m[row * groups + g] & 63 : 0;
                }
            }
            for (int j = 0; j < SUPER_GROUPS; j++)
                pack_nibbles(q, n, k, b, s * SUPER_GROUPS + j,
                             to + K_FACTOR_BYTES + j * NIBBLE_BYTES);
        }
}

#ifdef HAVE_DPBF16

/* group j's 16 scales and lows in float32, of a span (SPAN groups) starting at `first`; d and dmin
 * its superblock's (mode K; unused otherwise) */
static inline __attribute__((always_inline)) void
factors_512(int mode, const uint8_t *first, int j, __m512 d, __m512 dmin, __m512 *scale,
            __m512 *low) {
    if (mode == MODE_F) {
        *scale = _mm512_loadu_ps(first + NIBBLE_BYTES);
        *low = _mm512_loadu_ps(first + NIBBLE_BYTES + 4 * BLOCK);
    } else if (mode == MODE_H) {
        *scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(first + NIBBLE_BYTES)));
        *low = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(first + NIBBLE_BYTES + 2 * BLOCK)));
    } else {
        const uint8_t *sc = first + 2 * BLOCK * 4 + j * BLOCK;
        const __m512 scs =
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc)));
        const __m512 ms = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + SUPER_GROUPS * BLOCK))));
        *scale = _mm512_mul_ps(d, scs);
        /* -(dmin * m): a negation (a zero product's low is -0, as restore_k's is) */
        *low = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, ms)),
                                                    _mm512_set1_epi32(INT32_MIN)));
    }
}

/* a span's d and dmin (mode K), else zeros */
#define SPAN_FACTORS_512(MODE, first, d, dmin)                                                   \
    const __m512 d = (MODE) == MODE_K ? _mm512_loadu_ps(first) : _mm512_setzero_ps();           \
    const __m512 dmin = (MODE) == MODE_K ? _mm512_loadu_ps((first) + 4 * BLOCK)                   \
                                         : _mm512_setzero_ps()

/* MR rows x one block: sums[r] over the groups so far, dot[r] and dot_high[r] within the group (its
 * low and high halves apart: two dependency chains of 8, not one of 16). One block at a time: one
 * sequential stream of weights per thread ran 1.2-1.3x faster than tiles of 2-4 blocks
 * (interleaved streams) at 1-2 rows. 32 zmm registers: 3 x MR sums, 2 widened halves, 2
 * broadcasts, 3 constants (mode K's d and dmin reloaded where they do not fit). */
#define DEFINE_TILE(MR, MODE)                                                                      \
    static void tile_##MR##_##MODE(const uint16_t *x, int64_t x_stride, const float *x_sums,    \
                                   int64_t groups, const uint8_t *block, int64_t col, int64_t n, \
                                   const uint16_t *bias, uint16_t *out, int64_t out_stride) {    \
        const __m512i nibble = _mm512_set1_epi16(0x000f), offset = _mm512_set1_epi16(0x4300);   \
        const __m512 minus_128 = _mm512_set1_ps(-128.0f);                                       \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t s = 0; s < groups; s += SPAN(MODE)) {                                       \
            const uint8_t *first = block + s * STRIDE(MODE);                                     \
            SPAN_FACTORS_512(MODE, first, d, dmin);                                              \
            for (int j = 0; j < SPAN(MODE); j++) {                                               \
                const int64_t g = s + j;                                                         \
                const uint8_t *at = NIBBLES(MODE, first, j);                                     \
                __m512 dot[MR], dot_high[MR];                                                    \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                             \
                    dot[r] = dot_high[r] = _mm512_setzero_ps();                                  \
                /* the lines PREFETCH_GROUPS groups' bytes ahead (past the block's end:          \
                 * requested for nothing; prefetches do not fault, and the address is an        \
                 * integer) */                                                                   \
                _Pragma("GCC unroll 6") for (int line = 0; line < (STRIDE(MODE) + 63) / 64;      \
                                             line++)                                             \
                    _mm_prefetch((const char *)((uintptr_t)block                                 \
                                 + (uintptr_t)((g + PREFETCH_GROUPS) * STRIDE(MODE) + line * 64)), \
                                 _MM_HINT_T0);                                                   \
                for (int i = 0; i < 8; i++) {                                                    \
                    const __m512i bytes = _mm512_cvtepu8_epi16(                                  \
                        _mm256_loadu_si256((const __m256i *)(at + i * 32)));                     \
                    /* (bytes & 0xf) | 0x4300, and the same of bytes >> 4: bf16 of 128 + q */    \
                    const __m512bh low = (__m512bh)_mm512_ternarylogic_epi32(bytes, nibble,      \
                                                                             offset, 0xea);      \
                    const __m512bh high = (__m512bh)_mm512_ternarylogic_epi32(                   \
                        _mm512_srli_epi16(bytes, 4), nibble, offset, 0xea);                      \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                       \
                        int32_t lo, hi;                                                          \
                        memcpy(&lo, x + r * x_stride + g * GROUP + 2 * i, sizeof lo);            \
                        memcpy(&hi, x + r * x_stride + g * GROUP + 2 * i + 16, sizeof hi);       \
                        dot[r] = _mm512_dpbf16_ps(dot[r], (__m512bh)_mm512_set1_epi32(lo), low); \
                        dot_high[r] = _mm512_dpbf16_ps(dot_high[r],                              \
                                                       (__m512bh)_mm512_set1_epi32(hi), high);   \
                    }                                                                            \
                }                                                                                \
                __m512 scale, low;                                                               \
                factors_512(MODE, first, j, d, dmin, &scale, &low);                              \
                /* low - 128 scale: what each unit of the row's input sum adds */                \
                const __m512 base = _mm512_fmadd_ps(minus_128, scale, low);                      \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    sums[r] = _mm512_fmadd_ps(scale, _mm512_add_ps(dot[r], dot_high[r]),         \
                                              sums[r]);                                          \
                    sums[r] = _mm512_fmadd_ps(base, _mm512_set1_ps(x_sums[r * groups + g]),      \
                                              sums[r]);                                          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

#define DEFINE_TILES(MODE) DEFINE_TILE(1, MODE) DEFINE_TILE(2, MODE) DEFINE_TILE(4, MODE)          \
    DEFINE_TILE(8, MODE)
DEFINE_TILES(MODE_F) DEFINE_TILES(MODE_K) DEFINE_TILES(MODE_H)

typedef void (*tile_fn)(const uint16_t *, int64_t, const float *, int64_t, const uint8_t *,
                        int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* by mode, then rows in the tile: 1, 2, 4, 8 */
static const tile_fn TILES[3][4] = {{tile_1_MODE_F, tile_2_MODE_F, tile_4_MODE_F, tile_8_MODE_F},
                                    {tile_1_MODE_K, tile_2_MODE_K, tile_4_MODE_K, tile_8_MODE_K},
                                    {tile_1_MODE_H, tile_2_MODE_H, tile_4_MODE_H, tile_8_MODE_H}};

/* a block's groups -> the bf16 matmul's layout of its weights ([pairs][16 features][2 inputs]):
 * the 32 bytes i of group g hold pair 16g + i in their low halves and 16g + i + 8 in the high
 * ones, already in feature-major, input-minor order. VCVTNE2PS2BF16 rounds as float_to_bf16
 * (to nearest, ties to even; a NaN quiet) except that it flushes subnormals, which no weight of
 * these forms is (mode F: int4_kernel.quantize, a product is 0 or at least 1e-12, a minimum not
 * subnormal; K and H: every factor, so every weight, is a multiple of float16's least
 * subnormal, 2^-24) */
static inline __attribute__((always_inline)) void unpack_groups(int mode, const uint8_t *block,
                                                                int64_t groups, uint16_t *to) {
    const __m512i nibble = _mm512_set1_epi32(15);
    /* lane 2f + e of 16 float32 lanes takes feature f's factor: features 0-7, then 8-15 */
    const __m512i first_half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
    for (int64_t s = 0; s < groups; s += SPAN(mode)) {
        const uint8_t *first = block + s * STRIDE(mode);
        SPAN_FACTORS_512(mode, first, d, dmin);
        for (int j = 0; j < SPAN(mode); j++) {
            const int64_t g = s + j;
            const uint8_t *at = NIBBLES(mode, first, j);
            __m512 scale, low;
            factors_512(mode, first, j, d, dmin, &scale, &low);
            const __m512 scale_0 = _mm512_permutexvar_ps(first_half, scale);
            const __m512 scale_1 = _mm512_permutexvar_ps(second_half, scale);
            const __m512 low_0 = _mm512_permutexvar_ps(first_half, low);
            const __m512 low_1 = _mm512_permutexvar_ps(second_half, low);
            for (int i = 0; i < 8; i++) {
                /* features 0-7, then 8-15, one byte a lane */
                const __m512i bytes_0 =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32)));
                const __m512i bytes_1 =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32 + 16)));
                /* q * scale, rounded, then + low, rounded (no fused multiply-add:
                 * -ffp-contract=off) */
#define WEIGHTS(q, s, l) _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), l)
                const __m512 low_half_0 =
                    WEIGHTS(_mm512_and_si512(bytes_0, nibble), scale_0, low_0);
                const __m512 low_half_1 =
                    WEIGHTS(_mm512_and_si512(bytes_1, nibble), scale_1, low_1);
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
}

/* unpack_groups, its mode a constant in each case */
__attribute__((noinline)) static void unpack_block(int mode, const uint8_t *block, int64_t groups,
                                                   uint16_t *to) {
    if (mode == MODE_F)
        unpack_groups(MODE_F, block, groups, to);
    else if (mode == MODE_K)
        unpack_groups(MODE_K, block, groups, to);
    else
        unpack_groups(MODE_H, block, groups, to);
}



#ifdef HAVE_VNNI512

/* AVX-512 VNNI: integer dot products for every batch, as on AVX2 (the rows rounded to int8 a
 * group of 32 inputs as int8_rows.h does), with VPDPBUSD: unsigned bytes times signed bytes, four
 * products a 32-bit lane added in int32. A group's 4-bit values are unsigned, so q (0..15) times
 * the row's int8 inputs needs no offset. Each 64 bytes of a group's nibbles hold pairs i and
 * i + 1 ([2][16 features][2 inputs]); one VPERMW gathers each feature's 4 bytes into its 32-bit
 * lane, whose low nibbles are then inputs 4p..4p + 3 and high ones 16 + 4p..: a group of 16
 * features takes 4 permutes, 12 masks or shifts and, per row, 8 VPDPBUSD (64 products each,
 * against VDPBF16PS's 32), then scale * d * D + low * X in float32 as on AVX2. */

/* the VPERMW that puts words f and 16 + f (pairs i and i + 1 of feature f) in lane f */
static inline __attribute__((always_inline)) __m512i pair_gather(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                            22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* the 4 int8 inputs at `at`, in every lane */
static inline __attribute__((always_inline)) __m512i four_inputs(const int8_t *at) {
    int32_t word;
    memcpy(&word, at, sizeof word);
    return _mm512_set1_epi32(word);
}

/* MR rows x one block, against xq [MR][k] int8 rows x_stride apart and their groups' d and input
 * sums [MR][groups]. Up to 4 rows a group's low and high halves accumulate apart (two chains of
 * 4 VPDPBUSD, not one of 8); 8 rows already overlap 8 chains. */
#define DEFINE_INT_TILE(MR, MODE)                                                                  \
    static void int_tile_##MR##_##MODE(const int8_t *xq, int64_t x_stride,                      \
                                       const float *x_scales, const float *x_sums,             \
                                       int64_t groups, const uint8_t *block, int64_t col,       \
                                       int64_t n, const uint16_t *bias, uint16_t *out,          \
                                       int64_t out_stride) {                                     \
        enum { CHAINS = (MR) <= 4 ? 2 : 1 };                                                     \
        const __m512i nibble = _mm512_set1_epi8(15), gather = pair_gather();                    \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t s = 0; s < groups; s += SPAN(MODE)) {                                       \
            const uint8_t *first = block + s * STRIDE(MODE);                                     \
            SPAN_FACTORS_512(MODE, first, d, dmin);                                              \
            for (int j = 0; j < SPAN(MODE); j++) {                                               \
                const int64_t g = s + j;                                                         \
                const uint8_t *at = NIBBLES(MODE, first, j);                                     \
                _Pragma("GCC unroll 6") for (int line = 0; line < (STRIDE(MODE) + 63) / 64;      \
                                             line++)                                             \
                    _mm_prefetch((const char *)((uintptr_t)block                                 \
                                 + (uintptr_t)((g + PREFETCH_GROUPS) * STRIDE(MODE) + line * 64)), \
                                 _MM_HINT_T0);                                                   \
                __m512i dot[CHAINS][MR];                                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                             \
                    _Pragma("GCC unroll 2") for (int c = 0; c < CHAINS; c++)                     \
                        dot[c][r] = _mm512_setzero_si512();                                      \
                _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                            \
                    const __m512i bytes = _mm512_permutexvar_epi16(                              \
                        gather, _mm512_loadu_si512((const void *)(at + p * 64)));                \
                    const __m512i low = _mm512_and_si512(bytes, nibble);                         \
                    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);  \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                       \
                        const int8_t *row = xq + r * x_stride + g * GROUP + 4 * p;               \
                        dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], low, four_inputs(row));       \
                        dot[CHAINS - 1][r] =                                                     \
                            _mm512_dpbusd_epi32(dot[CHAINS - 1][r], high, four_inputs(row + 16)); \
                    }                                                                            \
                }                                                                                \
                __m512 scale, low;                                                               \
                factors_512(MODE, first, j, d, dmin, &scale, &low);                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    const __m512i total = CHAINS == 2 ? _mm512_add_epi32(dot[0][r],              \
                                                                         dot[CHAINS - 1][r])     \
                                                      : dot[0][r];                               \
                    const __m512 dx = _mm512_set1_ps(x_scales[r * groups + g]);                  \
                    sums[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx),                          \
                                              _mm512_cvtepi32_ps(total), sums[r]);               \
                    sums[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x_sums[r * groups + g]),       \
                                              sums[r]);                                          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

#define DEFINE_INT_TILES(MODE) DEFINE_INT_TILE(1, MODE) DEFINE_INT_TILE(2, MODE)                   \
    DEFINE_INT_TILE(4, MODE) DEFINE_INT_TILE(8, MODE)
DEFINE_INT_TILES(MODE_F) DEFINE_INT_TILES(MODE_K) DEFINE_INT_TILES(MODE_H)

typedef void (*int_tile_fn)(const int8_t *, int64_t, const float *, const float *, int64_t,
                            const uint8_t *, int64_t, int64_t, const uint16_t *, uint16_t *,
                            int64_t);

/* by mode, then rows in the tile: 1, 2, 4, 8 */
static const int_tile_fn INT_TILES[3][4] = {
    {int_tile_1_MODE_F, int_tile_2_MODE_F, int_tile_4_MODE_F, int_tile_8_MODE_F},
    {int_tile_1_MODE_K, int_tile_2_MODE_K, int_tile_4_MODE_K, int_tile_8_MODE_K},
    {int_tile_1_MODE_H, int_tile_2_MODE_H, int_tile_4_MODE_H, int_tile_8_MODE_H}};
#define INT_LEVELS 4

#endif

#elif defined(HAVE_AVX2_FMA)

/* AVX2: integer dot products, as llama.cpp multiplies Q4_1 by its Q8_1 activations. Each row's
 * group of 32 inputs is held as int8 (the group's largest magnitude as 127, xq = round(x * 127 /
 * max), d = max / 127, rounded as the VNNI path rounds them: int8_rows.h with float32 products),
 * so a weight's q times an input is one VPMADDUBSW lane: the 32 bytes i of a group, masked (low
 * halves: inputs 2i, 2i + 1 of the 16 features) or shifted and masked (high halves: inputs
 * 16 + 2i, 17 + 2i), against the row's pair of int8 inputs broadcast, give each feature's sum of
 * two products in 16 bits (at most 2 x 15 x 127), eight of them added in 16 bits (at most
 * 30,480) for the low halves and eight for the high ones. A group then adds (scale * d) * D, then
 * low * X, to each feature (two fused multiply-adds, in the VNNI tiles' order, so the two paths
 * give the same results bit for bit: tests/unit/shard/test_int4_kernel_arithmetic.py), D the
 * integer dot product and X the sum of the group's inputs as rounded, d * (sum of xq). Three
 * times fewer instructions a weight than float32 FMAs on the widened nibbles, which held the
 * 4-bit form to 2-3x bf16's arithmetic time on AVX2. The cost: each input's rounding to 1/254 of
 * its group's largest magnitude (the bound in tests/unit/shard/test_int4_kernel.py), an error
 * llama.cpp's 4-bit models carry too. */

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
    store_8(_mm256_permute2f128_ps(first, second, 0x20), bias, col, valid, out);
    if (valid > 8)
        store_8(_mm256_permute2f128_ps(first, second, 0x31), bias, col + 8, valid - 8, out);
}

/* 8 float16s -> float32 */
static inline __attribute__((always_inline)) __m256 widen_halves(const uint8_t *at) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
#else
    /* (an AVX2 CPU without F16C: none known, but the build should not depend on it) */
    float wide[8];
    for (int i = 0; i < 8; i++) {
        uint16_t h;
        memcpy(&h, at + 2 * i, sizeof h);
        const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = h >> 10 & 31;
        const uint32_t mantissa = h & 1023;
        float value = exponent == 31 ? (mantissa ? __builtin_nanf("") : __builtin_inff())
                      : exponent ? __builtin_ldexpf((float)(mantissa | 1024), (int)exponent - 25)
                                 : __builtin_ldexpf((float)mantissa, -24);
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
        memcpy(&wide[i], &bits, sizeof bits);
    }
    return _mm256_loadu_ps(wide);
#endif
}

/* 8 bytes -> float32 */
static inline __attribute__((always_inline)) __m256 widen_bytes(const uint8_t *at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}

/* group j's scales and lows in float32 (features 0-7 in [0], 8-15 in [1]) of a span starting at
 * `first`; d and dmin its superblock's (mode K) */
static inline __attribute__((always_inline)) void
factors_256(int mode, const uint8_t *first, int j, const __m256 *d, const __m256 *dmin,
            __m256 *scale, __m256 *low) {
    for (int h = 0; h < 2; h++) {
        if (mode == MODE_F) {
            scale[h] = _mm256_loadu_ps((const float *)(first + NIBBLE_BYTES) + 8 * h);
            low[h] = _mm256_loadu_ps((const float *)(first + NIBBLE_BYTES) + BLOCK + 8 * h);
        } else if (mode == MODE_H) {
            scale[h] = widen_halves(first + NIBBLE_BYTES + 16 * h);
            low[h] = widen_halves(first + NIBBLE_BYTES + 2 * BLOCK + 16 * h);
        } else {
            const uint8_t *sc = first + 2 * BLOCK * 4 + j * BLOCK + 8 * h;
            scale[h] = _mm256_mul_ps(d[h], widen_bytes(sc));
            /* -(dmin * m), as restore_k negates it */
            low[h] = _mm256_xor_ps(_mm256_mul_ps(dmin[h], widen_bytes(sc + SUPER_GROUPS * BLOCK)),
                                   _mm256_set1_ps(-0.0f));
        }
    }
}

#ifdef __AVXVNNI__
/* MR rows x one block with AVX-VNNI (Alder Lake and later without AVX-512): pairs i and i + 1 of
 * 16 features interleaved a word at a time (VPUNPCKLWD / VPUNPCKHWD: features [0-3, 8-11] and
 * [4-7, 12-15], widen_dots's order) hold 4 inputs of a feature a 32-bit lane, whose low nibbles
 * (inputs 4p..4p + 3) and high ones (16 + 4p..) VPDPBUSD multiplies by the row's 4 int8 inputs
 * into int32: no 16-bit sums to widen, 4 instructions a row for 4 x 32 products where
 * VPMADDUBSW took 8 (a multiply and an add for 2 x 32 products, twice). */
#define DEFINE_TILE(MR, MODE)                                                                      \
    static void tile_##MR##_##MODE(const int8_t *xq, int64_t x_stride, const float *x_scales,   \
                                   const float *x_sums, int64_t groups, const uint8_t *block,   \
                                   int64_t col, int64_t n, const uint16_t *bias, uint16_t *out,  \
                                   int64_t out_stride) {                                         \
        const __m256i nibble = _mm256_set1_epi8(15);                                             \
        __m256 first[MR], second[MR];                                                            \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            first[r] = second[r] = _mm256_setzero_ps();                                          \
        for (int64_t s = 0; s < groups; s += SPAN(MODE)) {                                       \
            const uint8_t *start = block + s * STRIDE(MODE);                                     \
            __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {d[0], d[1]};    \
            if ((MODE) == MODE_K)                                                                \
                for (int h = 0; h < 2; h++) {                                                    \
                    d[h] = _mm256_loadu_ps((const float *)start + 8 * h);                        \
                    dmin[h] = _mm256_loadu_ps((const float *)start + BLOCK + 8 * h);             \
                }                                                                                \
            for (int j = 0; j < SPAN(MODE); j++) {                                               \
                const int64_t g = s + j;                                                         \
                const uint8_t *at = NIBBLES(MODE, start, j);                                     \
                _Pragma("GCC unroll 6") for (int line = 0; line < (STRIDE(MODE) + 63) / 64;      \
                                             line++)                                             \
                    _mm_prefetch((const char *)((uintptr_t)block                                 \
                                 + (uintptr_t)((g + PREFETCH_GROUPS) * STRIDE(MODE) + line * 64)), \
                                 _MM_HINT_T0);                                                   \
                __m256i dots_a[MR], dots_b[MR];                                                  \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                             \
                    dots_a[r] = dots_b[r] = _mm256_setzero_si256();                              \
                _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                            \
                    const __m256i even = _mm256_loadu_si256((const __m256i *)(at + p * 64));     \
                    const __m256i odd = _mm256_loadu_si256((const __m256i *)(at + p * 64 + 32)); \
                    const __m256i a = _mm256_unpacklo_epi16(even, odd);                          \
                    const __m256i b = _mm256_unpackhi_epi16(even, odd);                          \
                    const __m256i a_low = _mm256_and_si256(a, nibble);                           \
                    const __m256i b_low = _mm256_and_si256(b, nibble);                           \
                    const __m256i a_high = _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble);    \
                    const __m256i b_high = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);    \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                       \
                        int32_t low_inputs, high_inputs;                                         \
                        memcpy(&low_inputs, xq + r * x_stride + g * GROUP + 4 * p, 4);           \
                        memcpy(&high_inputs, xq + r * x_stride + g * GROUP + 16 + 4 * p, 4);     \
                        const __m256i lows = _mm256_set1_epi32(low_inputs);                      \
                        const __m256i highs = _mm256_set1_epi32(high_inputs);                    \
                        dots_a[r] = _mm256_dpbusd_avx_epi32(dots_a[r], a_low, lows);             \
                        dots_b[r] = _mm256_dpbusd_avx_epi32(dots_b[r], b_low, lows);             \
                        dots_a[r] = _mm256_dpbusd_avx_epi32(dots_a[r], a_high, highs);           \
                        dots_b[r] = _mm256_dpbusd_avx_epi32(dots_b[r], b_high, highs);           \
                    }                                                                            \
                }                                                                                \
                __m256 scale[2], low[2];                                                         \
                factors_256(MODE, start, j, d, dmin, scale, low);                                \
                /* in widen_dots's order */                                                      \
                const __m256 scale_a = _mm256_permute2f128_ps(scale[0], scale[1], 0x20);         \
                const __m256 scale_b = _mm256_permute2f128_ps(scale[0], scale[1], 0x31);         \
                const __m256 low_a = _mm256_permute2f128_ps(low[0], low[1], 0x20);               \
                const __m256 low_b = _mm256_permute2f128_ps(low[0], low[1], 0x31);               \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                           \
                    const __m256 dot_a = _mm256_cvtepi32_ps(dots_a[r]);                          \
                    const __m256 dot_b = _mm256_cvtepi32_ps(dots_b[r]);                          \
                    const __m256 dx = _mm256_set1_ps(x_scales[r * groups + g]);                  \
                    const __m256 sum = _mm256_set1_ps(x_sums[r * groups + g]);                   \
                    first[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_a, dx), dot_a, first[r]);     \
                    second[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_b, dx), dot_b, second[r]);   \
                    first[r] = _mm256_fmadd_ps(low_a, sum, first[r]);                            \
                    second[r] = _mm256_fmadd_ps(low_b, sum, second[r]);                          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            store_features(first[r], second[r], bias, col, (int)(n - col), out + r * out_stride); \
    }
#else
/* MR rows x one block: xq [MR][k] int8 rows x_stride apart, their groups' d and input sums
 * [MR][groups] */
#define DEFINE_TILE(MR, MODE)                                                                      \
    static void tile_##MR##_##MODE(const int8_t *xq, int64_t x_stride, const float *x_scales,   \
                                   const float *x_sums, int64_t groups, const uint8_t *block,   \
                                   int64_t col, int64_t n, const uint16_t *bias, uint16_t *out,  \
                                   int64_t out_stride) {                                         \
        const __m256i nibble = _mm256_set1_epi8(15);                                             \
        __m256 first[MR], second[MR];                                                            \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            first[r] = second[r] = _mm256_setzero_ps();                                          \
        for (int64_t s = 0; s < groups; s += SPAN(MODE)) {                                       \
            const uint8_t *start = block + s * STRIDE(MODE);                                     \
            __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {d[0], d[1]};    \
            if ((MODE) == MODE_K)                                                                \
                for (int h = 0; h < 2; h++) {                                                    \
                    d[h] = _mm256_loadu_ps((const float *)start + 8 * h);                        \
                    dmin[h] = _mm256_loadu_ps((const float *)start + BLOCK + 8 * h);             \
                }                                                                                \
            for (int j = 0; j < SPAN(MODE); j++) {                                               \
                const int64_t g = s + j;                                                         \
                const uint8_t *at = NIBBLES(MODE, start, j);                                     \
                _Pragma("GCC unroll 6") for (int line = 0; line < (STRIDE(MODE) + 63) / 64;      \
                                             line++)                                             \
                    _mm_prefetch((const char *)((uintptr_t)block                                 \
                                 + (uintptr_t)((g + PREFETCH_GROUPS) * STRIDE(MODE) + line * 64)), \
                                 _MM_HINT_T0);                                                   \
                __m256i low_sums[MR], high_sums[MR];                                             \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                             \
                    low_sums[r] = high_sums[r] = _mm256_setzero_si256();                         \
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                            \
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(at + i * 32));    \
                    const __m256i low = _mm256_and_si256(bytes, nibble);                         \
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble); \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                       \
                        int16_t pair, high_pair;                                                 \
                        memcpy(&pair, xq + r * x_stride + g * GROUP + 2 * i, sizeof pair);       \
                        memcpy(&high_pair, xq + r * x_stride + g * GROUP + 16 + 2 * i,           \
                               sizeof high_pair);                                                \
                        low_sums[r] = _mm256_add_epi16(                                          \
                            low_sums[r], _mm256_maddubs_epi16(low, _mm256_set1_epi16(pair)));    \
                        high_sums[r] = _mm256_add_epi16(                                         \
                            high_sums[r],                                                        \
                            _mm256_maddubs_epi16(high, _mm256_set1_epi16(high_pair)));           \
                    }                                                                            \
                }                                                                                \
                __m256 scale[2], low[2];                                                         \
                factors_256(MODE, start, j, d, dmin, scale, low);                                \
                /* in widen_dots's order */                                                      \
                const __m256 scale_a = _mm256_permute2f128_ps(scale[0], scale[1], 0x20);         \
                const __m256 scale_b = _mm256_permute2f128_ps(scale[0], scale[1], 0x31);         \
                const __m256 low_a = _mm256_permute2f128_ps(low[0], low[1], 0x20);               \
                const __m256 low_b = _mm256_permute2f128_ps(low[0], low[1], 0x31);               \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                           \
                    __m256 dot_a, dot_b;                                                         \
                    widen_dots(low_sums[r], high_sums[r], &dot_a, &dot_b);                       \
                    const __m256 dx = _mm256_set1_ps(x_scales[r * groups + g]);                  \
                    const __m256 sum = _mm256_set1_ps(x_sums[r * groups + g]);                   \
                    first[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_a, dx), dot_a, first[r]);     \
                    second[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale_b, dx), dot_b, second[r]);   \
                    first[r] = _mm256_fmadd_ps(low_a, sum, first[r]);                            \
                    second[r] = _mm256_fmadd_ps(low_b, sum, second[r]);                          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            store_features(first[r], second[r], bias, col, (int)(n - col), out + r * out_stride); \
    }

#endif

#define DEFINE_TILES(MODE) DEFINE_TILE(1, MODE) DEFINE_TILE(2, MODE) DEFINE_TILE(4, MODE)
DEFINE_TILES(MODE_F) DEFINE_TILES(MODE_K) DEFINE_TILES(MODE_H)

typedef void (*int_tile_fn)(const int8_t *, int64_t, const float *, const float *, int64_t,
                            const uint8_t *, int64_t, int64_t, const uint16_t *, uint16_t *,
                            int64_t);

/* by mode, then rows in the tile: 1, 2, 4 */
#define INT_LEVELS 3
static const int_tile_fn INT_TILES[3][INT_LEVELS] = {{tile_1_MODE_F, tile_2_MODE_F, tile_4_MODE_F},
                                    {tile_1_MODE_K, tile_2_MODE_K, tile_4_MODE_K},
                                    {tile_1_MODE_H, tile_2_MODE_H, tile_4_MODE_H}};

#endif

#if defined(HAVE_VNNI512) || defined(HAVE_AVX2_FMA)

#ifdef HAVE_VNNI512
/* quantize_row_int8_scalar with AVX-512: each group in two zmm of float32, scaled by
 * 127 / largest in float32 (the scalar form's double product can differ only at a tie), rounded
 * to nearest even; groups too small for 127 / largest to be a float (below 127 / FLT_MAX), or not
 * finite, by the scalar form */
static void quantize_row_512(const uint16_t *x, int64_t k, int8_t *xq, float *x_scales,
                             float *x_sums) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint16_t *at = x + g * GROUP;
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(at + 16))), 16));
        /* NaNs (0x01, 0x80) and infinities (0x08, 0x10) */
        const int special = _mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99);
        const float largest = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(a, magnitude), _mm512_and_ps(b, magnitude)));
        if (special || largest < 127.0f / 3.4e38f) {
            quantize_row_int8_scalar(at, GROUP, GROUP, xq + g * GROUP, x_scales + g,
                                     x_sums + g, 0);
            continue;
        }
        const __m512 inverse = _mm512_set1_ps((float)(127.0 / largest));
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
        _mm_storeu_si128((__m128i *)(xq + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        const float d = largest / 127.0f;
        x_scales[g] = d;
        x_sums[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}
#define QUANTIZE_ROW quantize_row_512
#else
#define QUANTIZE_ROW(x, k, xq, x_scales, x_sums)                                                   \
    quantize_row_int8_scalar(x, k, GROUP, xq, x_scales, x_sums, 1)
#endif

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
static void unpacked_pass(const uint16_t *x, int64_t rows, int64_t x_stride, int mode,
                          const uint8_t *packed, int64_t groups, int64_t n,
                          const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t first,
                          int64_t last, uint16_t *unpacked) {
    const int64_t pairs = groups * GROUP / 2;
    for (int64_t b = first; b < last; b += STRIP_BLOCKS) {
        const int nr = last - b < STRIP_BLOCKS ? (int)(last - b) : STRIP_BLOCKS;
        for (int j = 0; j < nr; j++)
            unpack_block(mode, packed + (b + j) * groups * STRIDE(mode), groups,
                         unpacked + j * pairs * 2 * BLOCK);
        /* the strip as the whole weight of its own: its columns from b * BLOCK */
        const uint16_t *strip_bias = bias ? bias + b * BLOCK : 0;
        bf16_blocks(x, rows, x_stride, unpacked, pairs, n - b * BLOCK, strip_bias,
                    out + b * BLOCK, out_stride, 0, nr);
    }
}

/* more than TILE_MAX_ROWS rows: by the bf16 tiles over unpacked blocks */
static int unpacked_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, int mode,
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
            unpacked_pass(x + r * x_stride, rows, x_stride, mode, packed, groups, n, bias,
                          out + r * out_stride, out_stride, first, last, unpacked);
        }
    }
    return failed ? -2 : 0;
}

#endif

#endif

#if defined(HAVE_VNNI512) || defined(HAVE_AVX2_FMA)

/* every batch by the integer tiles: the rows rounded to int8, then passes of ROWS_PER_PASS rows
 * against each thread's blocks */
static int int_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, int mode,
                      const uint8_t *weights, int64_t n, const uint16_t *bias, uint16_t *out,
                      int64_t out_stride) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    const int64_t block_bytes = groups * STRIDE(mode);
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
            QUANTIZE_ROW(x + r * x_stride, k, xq + r * k, x_scales + r * groups,
                         x_sums + r * groups);
        /* (the loop's barrier: every row is ready before any thread reads them) */
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t pass = 0; pass < m; pass += ROWS_PER_PASS) {
            const int64_t end = m - pass < ROWS_PER_PASS ? m : pass + ROWS_PER_PASS;
            int level = 0;
            while (level + 1 < INT_LEVELS && end - pass >= 1 << (level + 1))
                level++;
            for (int64_t b = first; b < last; b++) {
                int64_t r = pass;
                for (int lv = level; lv >= 0; lv--)
                    for (; r + (1 << lv) <= end; r += 1 << lv)
                        INT_TILES[mode][lv](xq + r * k, k, x_scales + r * groups,
                                        x_sums + r * groups, groups, weights + b * block_bytes,
                                        b * BLOCK, n, bias, out + r * out_stride, out_stride);
            }
        }
    }
    return 0;
}

#endif

/* x [m, k] with rows x_stride apart, packed by an int4_matmul_pack*, bias [n] or NULL -> out
 * [m, n] with rows out_stride apart. Returns 0, -1 where this build has no kernel (or the header is
 * not one of ours for this k and n), -2 where its scratch could not be allocated. */
int int4_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed,
                int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
    int64_t header[4];
    memcpy(header, packed, sizeof header);
    const int mode = (int)header[1];
    if (header[0] != MAGIC || shape_check(header[1], n, k) || header[2] != k || header[3] != n)
        return -1;
    if (m <= 0)
        return 0;
    const uint8_t *weights = packed + HEADER_BYTES;
#endif
#if defined(HAVE_DPBF16) && !defined(HAVE_VNNI512)
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / GROUP;
    const int64_t block_bytes = groups * STRIDE(mode);
    if (m > TILE_MAX_ROWS)
        return unpacked_matmul(x, m, k, x_stride, mode, weights, n, bias, out, out_stride);
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
                    TILES[mode][lv](x + r * x_stride, x_stride, x_sums + r * groups, groups,
                                    weights + b * block_bytes, b * BLOCK, n, bias,
                                    out + r * out_stride, out_stride);
        }
    }
    return 0;
#endif
#if defined(HAVE_VNNI512) || defined(HAVE_AVX2_FMA)
    return int_matmul(x, m, k, x_stride, mode, weights, n, bias, out, out_stride);
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out,
        (void)out_stride;
    return -1;
#endif
}
