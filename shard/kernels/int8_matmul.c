/* y = x W^T (+ b) for bf16 x [m, k] and an 8-bit W [n, k] given per group of G = 16 or 32 input
 * features as w = q * scale + low (q in -128..127, scale and low float32: the product rounded,
 * then the sum), on CPUs with AVX-512 BF16 or AVX2. The form holds GGUF's 5-, 6- and 8-bit types
 * exactly (Q8_0: q * d; Q6_K: groups of 16; Q5_0, Q5_1, Q5_K: groups of 32), at 1 byte a weight
 * plus each group's factors, float32 or the type's own compact ones (8.5-8.75 bits a weight where
 * float32 factors take 10-12: a Q4_K_M model's Q6_K quarter then fits near llama.cpp's size):
 * decode-size batches, where reading the weights sets the time, multiply by it directly.
 *
 * Packing: a 64-byte header (int64 magic, group, k, n, mode), then per block of 16 output features
 * its units (blocks after one another; features past n zeros, factors 0). The mode says how a
 * group's factors are held, GGUF's own forms where they fit in fewer bytes than float32 pairs:
 *   F  (0): per group a float32 scale and low (16 of each): 8 bytes a group and feature;
 *   H  (1): a float16 scale, low 0 (Q8_0; Q5_0 as q - 16): 2 bytes;
 *   HL (2): a float16 scale and low (Q5_1): 4 bytes;
 *   K6 (3): groups of 16, per superblock of 256 inputs a float32 d, per group an int8 sc:
 *           scale d * sc (exact in float32: d is a float16's value), low 0 (Q6_K): 1 byte;
 *   K5 (4): groups of 32, per superblock float32 d and dmin, per group uint8 sc and m:
 *           scale d * sc, low -(dmin * m) (Q5_K): 2 bytes.
 * A unit is one group (F, H, HL) or one superblock (K6, K5: its 16 d, and dmin for K5, first).
 * Each group: G / 2 x 32 bytes of q, byte [i][f][e] holding input 2i + e of feature f (the bf16
 * matmul's [pairs][16 features][2 inputs] order), then its factors for the 16 features, each
 * kind 16 in a row (scales, then lows or m). The kernels compute a group's float32 scale and low
 * vectors from these as they reach it, a few instructions a group, so every mode restores the
 * same float32 weights as F would hold. The header carries the group and mode, which the matmul's
 * signature (the int4 kernel's, as the C decode step calls both) has no room for, and lets a
 * call refuse a buffer packed for another shape.
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
 * compiler fuses them; no sum where the mode has no low), and runs that kernel's tiles (bf16_tiles.h) over the rows: a prefill gets
 * what a bf16 layer of those weights gives, bit for bit, as int4_matmul.c does.
 *
 * AVX-512 VNNI (every AVX-512 BF16 CPU so far), in place of both: every batch against the rows
 * rounded to int8 a group, as llama.cpp rounds its activations for Q8_0 and the K-quants, by
 * VPDPBUSD (see the VNNI section below), so a row's result does not depend on the batch; the
 * int16 tiles and unpacked blocks above then serve only an AVX-512 BF16 CPU without VNNI.
 *
 * AVX2 (no bf16 arithmetic): every batch as on AVX-512 VNNI, the rows rounded to int8 alike and
 * the same integer sums and float32 epilogue, so the same results bit for bit (see the AVX2
 * section below: VPMADDWD, or AVX-VNNI's VPDPBUSD). Measured against the float32 FMAs it replaced
 * (q and the rows widened to float32), on a Xeon held to -march=x86-64-v3, 1 thread,
 * benchmarks/matmul_bench.py --gguf: Q6_K and Q8_0 at Llama 3 8B's shapes 1.3-1.5x as fast at 1
 * row and 1.5-1.8x at 8-512; with AVX-VNNI (-march=alderlake) 1.3-1.5x at 1 row, Q6_K 2.5-3.0x
 * and Q8_0 3.4-4.1x at 8-512 (VPDPWSSD on the int16 rows took 2.0-2.3x).
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

#define HEADER_BYTES 64
/* "INT8PACK", little-endian: a header this library wrote */
#define MAGIC 0x4b43415038544e49LL
enum { MODE_F, MODE_H, MODE_HL, MODE_K6, MODE_K5, MODES };
/* inputs of a K6 or K5 superblock */
#define SUPER 256
/* bytes of a group's factors for a block's 16 features (MODE compared as an int: the tiles pass
 * an enum of their own) */
#define FACTOR_BYTES(MODE)                                                                         \
    ((int)(MODE) == MODE_F ? 128 : (int)(MODE) == MODE_H ? 32 : (int)(MODE) == MODE_HL ? 64      \
     : (int)(MODE) == MODE_K6 ? 16 : 32)
/* a block's bytes of one group: its q, then its factors */
#define GROUP_BYTES(MODE, G) (BLOCK * (G) + FACTOR_BYTES(MODE))
#define IS_K(MODE) ((int)(MODE) == MODE_K6 || (int)(MODE) == MODE_K5)
/* groups a unit; the bytes before its first group (the superblock's float32 d, then dmin) */
#define UNIT_GROUPS(MODE, G) (IS_K(MODE) ? SUPER / (G) : 1)
#define HEAD_BYTES(MODE)                                                                           \
    ((int)(MODE) == MODE_K6 ? 4 * BLOCK : (int)(MODE) == MODE_K5 ? 8 * BLOCK : 0)
#define UNIT_BYTES(MODE, G) (HEAD_BYTES(MODE) + UNIT_GROUPS(MODE, G) * GROUP_BYTES(MODE, G))
/* whether the mode's lows can be other than 0 (the others skip their term) */
#define HAS_LOW(MODE) ((int)(MODE) == MODE_F || (int)(MODE) == MODE_HL || (int)(MODE) == MODE_K5)

/* whether a mode holds groups of `group` over k inputs */
static int valid_shape(int64_t k, int64_t group, int64_t mode) {
    if (mode < 0 || mode >= MODES || (group != 16 && group != 32) || k <= 0)
        return 0;
    if ((mode == MODE_K6 && group != 16) || (mode == MODE_K5 && group != 32))
        return 0;
    return k % (group * UNIT_GROUPS(mode, group)) == 0;
}

/* a block's bytes: its units, one after another */
static int64_t block_bytes(int64_t k, int group, int mode) {
    return k / group / UNIT_GROUPS(mode, group) * UNIT_BYTES(mode, group);
}

#define PARALLEL_MIN_WORK (1 << 16)
/* how many groups ahead a tile asks for its block's lines */
#define PREFETCH_GROUPS 4
#if defined(HAVE_DPBF16)
/* up to how many rows the 8-bit tiles run: every decode batch of the router's default 128
 * requests in flight. Not the speed's limit: on a Xeon (Emerald Rapids, 1 thread) the tiles took
 * 0.43x the unpacked blocks' time at 32-256 rows (and 0.57x the bf16 matmul's at 1 row, 0.42x at
 * 8); past it a prefill is what a bf16 layer of the restored weights gives, bit for bit. */
#define TILE_MAX_ROWS 128
#ifdef HAVE_VNNI512
/* (with VNNI, none of that: the int8 tiles take every batch) */
#undef TILE_MAX_ROWS
#define TILE_MAX_ROWS 0
#endif
/* rows a pass over the unpacked blocks takes (their inputs stay in L2 or L3 while each thread
 * unpacks its blocks once a pass) */
#define UNPACKED_ROWS_PER_PASS 256
/* blocks a thread unpacks at a time: the widest bf16 tile at many rows */
#define STRIP_BLOCKS 3
#else
/* no limit: every batch runs the int8 tiles */
#define TILE_MAX_ROWS 0
#endif

/* 1: AVX-512 BF16 dot products; 2: integer dot products on AVX2; 3: on AVX-512 VNNI; 0: no
 * kernel in this build */
int int8_matmul_supported(void) {
#ifdef HAVE_VNNI512
    return 3;
#else
    return matmul_form();
#endif
}

/* up to how many rows a call runs the 8-bit tiles (more: the unpacked blocks); 0: every batch */
int int8_matmul_tile_rows(void) { return TILE_MAX_ROWS; }

/* -1 where the mode does not hold groups of `group` over k inputs (F, H, HL: 16 or 32; K6: 16;
 * K5: 32; k a multiple of the group, of 256 for K6 and K5) */
int64_t int8_matmul_packed_bytes_mode(int64_t n, int64_t k, int64_t group, int64_t mode) {
    if (!valid_shape(k, group, mode) || n <= 0)
        return -1;
    return HEADER_BYTES + (n + BLOCK - 1) / BLOCK * block_bytes(k, (int)group, (int)mode);
}

/* mode F's bytes */
int64_t int8_matmul_packed_bytes(int64_t n, int64_t k, int64_t group) {
    return int8_matmul_packed_bytes_mode(n, k, group, MODE_F);
}

/* feature row's value [row, at] of a [n, columns] factor of `size` bytes a value (0 past n) */
static void copy_factor(uint8_t *to, const void *factor, int size, int64_t row, int64_t n,
                        int64_t columns, int64_t at) {
    if (row < n)
        memcpy(to, (const uint8_t *)factor + (row * columns + at) * size, size);
    else
        memset(to, 0, size);
}

/* q [n, k] and the mode's factors -> out (int8_matmul_packed_bytes_mode of them). F: a = scale,
 * b = low, float32 [n, k / group]; H: a = scale float16 [n, k / group]; HL: a, b = scale, low
 * float16; K6: a = d float32 [n, k / 256], b = sc int8 [n, k / 16]; K5: a = d, c = dmin float32
 * [n, k / 256], b = sc, d = m uint8 [n, k / 32]. The factors are copied as they are. */
void int8_matmul_pack_mode(const int8_t *q, const void *a, const void *b, const void *c,
                           const void *d, int64_t n, int64_t k, int64_t group, int64_t mode,
                           uint8_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group;
    const int64_t per_unit = UNIT_GROUPS(mode, group), supers = k / SUPER;
    const int64_t header[5] = {MAGIC, group, k, n, mode};
    /* bytes a value of each per-group factor (scale, then low or m): 4, 2 or 1 */
    const int size = mode == MODE_F ? 4 : mode == MODE_H || mode == MODE_HL ? 2 : 1;
    const int kinds = mode == MODE_H || mode == MODE_K6 ? 1 : 2;
    memset(out, 0, HEADER_BYTES);
    memcpy(out, header, sizeof header);
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        uint8_t *to = out + HEADER_BYTES + blk * block_bytes(k, (int)group, (int)mode);
        for (int64_t g = 0; g < groups; g++) {
            if (g % per_unit == 0 && (mode == MODE_K6 || mode == MODE_K5))
                for (int f = 0; f < BLOCK; f++) {
                    copy_factor(to + 4 * f, a, 4, blk * BLOCK + f, n, supers, g / per_unit);
                    if (mode == MODE_K5)
                        copy_factor(to + 4 * (BLOCK + f), c, 4, blk * BLOCK + f, n, supers,
                                    g / per_unit);
                }
            to += HEAD_BYTES(mode) * (g % per_unit == 0);
            for (int64_t i = 0; i < group / 2; i++)
                for (int f = 0; f < BLOCK; f++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t row = blk * BLOCK + f, col = g * group + 2 * i + e;
                        to[(i * BLOCK + f) * 2 + e] = row < n ? (uint8_t)q[row * k + col] : 0;
                    }
            to += BLOCK * group;
            const void *factor[2] = {mode == MODE_K5 ? b : a, mode == MODE_K5 ? d : b};
            if (mode == MODE_K6)
                factor[0] = b;
            for (int kind = 0; kind < kinds; kind++)
                for (int f = 0; f < BLOCK; f++)
                    copy_factor(to + (kind * BLOCK + f) * size, factor[kind], size,
                                blk * BLOCK + f, n, groups, g);
            to += kinds * BLOCK * size;
        }
    }
}

/* q [n, k], scale and low [n, k / group] float32 -> out (int8_matmul_packed_bytes of them) */
void int8_matmul_pack(const int8_t *q, const float *scale, const float *low, int64_t n, int64_t k,
                      int64_t group, uint8_t *out) {
    int8_matmul_pack_mode(q, scale, low, 0, 0, n, k, group, MODE_F, out);
}

/* the row of TILES for a mode and group: F, H, HL at 16 and 32, then K6 and K5 */
static inline int tile_variant(int mode, int group) {
    return mode <= MODE_HL ? 2 * mode + (group == 32) : mode == MODE_K6 ? 6 : 7;
}

/* the (group, mode) of each row of the integer tiles' table, in tile_variant's order: each form
 * makes its tiles for all of them */
#define INT_VARIANTS(X) X(16, F) X(32, F) X(16, H) X(32, H) X(16, HL) X(32, HL) X(16, K6) X(32, K5)

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
/* a tile's prefetch of the `lines` cache lines `ahead` bytes past a group (past the block's end:
 * requested for nothing; prefetches do not fault, and the address is an integer) */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *at, int64_t ahead,
                                                                 int lines) {
    _Pragma("GCC unroll 10") for (int line = 0; line < lines; line++)
        _mm_prefetch((const char *)((uintptr_t)at + (uintptr_t)(ahead + line * 64)), _MM_HINT_T0);
}
#endif

#ifdef HAVE_DPBF16

/* acc + each lane's two products of 16-bit a and b (VPDPWSSD, or its two AVX-512 BW steps) */
static inline __attribute__((always_inline)) __m512i dot_words(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* a superblock's d and dmin for 16 features (K6, K5; the other modes have none) */
static inline __attribute__((always_inline)) void head_512(int mode, const uint8_t *unit,
                                                           __m512 *d, __m512 *dmin) {
    *d = *dmin = _mm512_setzero_ps();
    if (mode == MODE_K6 || mode == MODE_K5)
        *d = _mm512_loadu_ps((const float *)unit);
    if (mode == MODE_K5)
        *dmin = _mm512_loadu_ps((const float *)unit + BLOCK);
}

/* -x: the sign flipped, so -(+0) is -0 as -(dmin * m) is in Python */
static inline __attribute__((always_inline)) __m512 negated_512(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32((int)0x80000000u)));
}

/* a group's float32 scale and low for 16 features from its factors (`at`) and its superblock's
 * d and dmin: float16s widened (exact), d * sc and dmin * m rounded as Python's float32 */
static inline __attribute__((always_inline)) void
factors_512(int mode, const uint8_t *at, __m512 d, __m512 dmin, __m512 *scale, __m512 *low) {
    *low = _mm512_setzero_ps();
    if (mode == MODE_F) {
        *scale = _mm512_loadu_ps((const float *)at);
        *low = _mm512_loadu_ps((const float *)at + BLOCK);
    } else if (mode == MODE_H || mode == MODE_HL) {
        *scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
        if (mode == MODE_HL)
            *low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 2 * BLOCK)));
    } else if (mode == MODE_K6) {
        *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                      _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at))));
    } else {
        const __m128i sc = _mm_loadu_si128((const __m128i *)at);
        const __m128i m = _mm_loadu_si128((const __m128i *)(at + BLOCK));
        *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        *low = negated_512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m))));
    }
}

/* MR rows (int16) x one block, groups of G, factors held as MODE: sums[r] over the groups so
 * far, dot[c][r] the group's integer dot products (CHAINS dependency chains a row, pairs
 * alternating between them, so that one or two rows are not held to VPDPWSSD's latency). Each
 * 32 bytes of q, sign-extended, are 16 features x 2 inputs in VPDPWSSD's operand layout; a row's
 * pair of inputs is one broadcast. One block at a time: one sequential stream of weights per
 * thread, as int4_matmul.c measured best at few rows. A superblock's d and dmin are loaded once,
 * each group's scale and low computed from them as the group is reached. */
#define DEFINE_TILE(MR, G, MODE)                                                                   \
    static void tile_##MR##_##G##_##MODE(const int16_t *xq, int64_t x_stride,                   \
                                         const float *x_scales, const float *x_sums,            \
                                         int64_t groups, const uint8_t *block, int64_t col,     \
                                         int64_t n, const uint16_t *bias, uint16_t *out,        \
                                         int64_t out_stride) {                                  \
        enum { CHAINS = MR == 1 ? 4 : MR == 2 ? 2 : 1, M = MODE_##MODE,                          \
               PER_UNIT = UNIT_GROUPS(M, G), STRIDE = GROUP_BYTES(M, G),                         \
               /* a group's lines, and one more where superblocks have a head */                 \
               LINES = (STRIDE + 63) / 64 + (HEAD_BYTES(M) > 0) };                               \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t u = 0; u < groups / PER_UNIT; u++) {                                        \
            const uint8_t *unit = block + u * UNIT_BYTES(M, G);                                  \
            __m512 d, dmin;                                                                      \
            head_512(M, unit, &d, &dmin);                                                        \
            for (int64_t g = u * PER_UNIT; g < (u + 1) * PER_UNIT; g++) {                        \
                const uint8_t *at = unit + HEAD_BYTES(M) + (g - u * PER_UNIT) * STRIDE;          \
                __m512i dot[CHAINS][MR];                                                         \
                _Pragma("GCC unroll 4") for (int c = 0; c < CHAINS; c++)                         \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                         \
                        dot[c][r] = _mm512_setzero_si512();                                      \
                prefetch_ahead(at, PREFETCH_GROUPS * STRIDE, LINES);                             \
                _Pragma("GCC unroll 16") for (int i = 0; i < (G) / 2; i++) {                     \
                    const __m512i w = _mm512_cvtepi8_epi16(                                      \
                        _mm256_loadu_si256((const __m256i *)(at + i * 32)));                     \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                       \
                        int32_t pair;                                                            \
                        memcpy(&pair, xq + r * x_stride + g * (G) + 2 * i, sizeof pair);         \
                        dot[i % CHAINS][r] = dot_words(dot[i % CHAINS][r], w,                    \
                                                       _mm512_set1_epi32(pair));                 \
                    }                                                                            \
                }                                                                                \
                __m512 scale, low;                                                               \
                factors_512(M, at + BLOCK * (G), d, dmin, &scale, &low);                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    __m512i dr = dot[0][r];                                                      \
                    _Pragma("GCC unroll 4") for (int c = 1; c < CHAINS; c++)                     \
                        dr = _mm512_add_epi32(dr, dot[c][r]);                                    \
                    const __m512 product = _mm512_mul_ps(                                        \
                        _mm512_cvtepi32_ps(dr), _mm512_set1_ps(x_scales[r * groups + g]));       \
                    sums[r] = _mm512_fmadd_ps(scale, product, sums[r]);                          \
                    if (HAS_LOW(M))                                                              \
                        sums[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x_sums[r * groups + g]),   \
                                                  sums[r]);                                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

/* the tiles of 1, 2, 4 and 8 rows for one group and mode, and their row of TILES */
#define DEFINE_TILES(G, MODE)                                                                      \
    DEFINE_TILE(1, G, MODE) DEFINE_TILE(2, G, MODE) DEFINE_TILE(4, G, MODE)                     \
    DEFINE_TILE(8, G, MODE)
#define TILE_ROW(G, MODE)                                                                          \
    {tile_1_##G##_##MODE, tile_2_##G##_##MODE, tile_4_##G##_##MODE, tile_8_##G##_##MODE}
DEFINE_TILES(16, F) DEFINE_TILES(32, F) DEFINE_TILES(16, H) DEFINE_TILES(32, H)
DEFINE_TILES(16, HL) DEFINE_TILES(32, HL) DEFINE_TILES(16, K6) DEFINE_TILES(32, K5)
#undef DEFINE_TILE

typedef void (*tile_fn)(const int16_t *, int64_t, const float *, const float *, int64_t,
                        const uint8_t *, int64_t, int64_t, const uint16_t *, uint16_t *, int64_t);

/* [variant (tile_variant)][rows in the tile: 1, 2, 4, 8] */
static const tile_fn TILES[8][4] = {TILE_ROW(16, F),  TILE_ROW(32, F),  TILE_ROW(16, H),
                                    TILE_ROW(32, H),  TILE_ROW(16, HL), TILE_ROW(32, HL),
                                    TILE_ROW(16, K6), TILE_ROW(32, K5)};

#ifdef HAVE_VNNI512

/* AVX-512 VNNI: every batch against the rows rounded to int8 a group (G inputs: the largest
 * magnitude as 127), as llama.cpp multiplies Q8_0 and the K-quants by int8 activations, with
 * VPDPBUSD (unsigned bytes times signed bytes, four products a 32-bit lane): q + 128 (q's sign
 * bit flipped) is the unsigned operand, and each row's group starts its sum at -128 x (the sum of
 * its int8 inputs), so that D = sum q xq exactly in int32. Each 64 bytes of q hold pairs i and
 * i + 1 ([2][16 features][2 inputs]); one VPERMW gathers each feature's 4 bytes into its lane.
 * Against the int16 rows and VPDPWSSD (32 products an instruction): 64 products an instruction,
 * at the cost of each input's rounding to 1/254 of its group's largest magnitude. */

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

/* MR rows (int8) x one block, groups of G, factors held as MODE; x_offsets[r][g] is -128 x the
 * group's sum of int8 inputs. Up to 2 rows the chunks alternate between two chains. */
#define DEFINE_INT_TILE(MR, G, MODE)                                                               \
    static void int_tile_##MR##_##G##_##MODE(const int8_t *xq, int64_t x_stride,                \
                                             const float *x_scales, const float *x_sums,        \
                                             const int32_t *x_offsets, int64_t groups,          \
                                             const uint8_t *block, int64_t col, int64_t n,      \
                                             const uint16_t *bias, uint16_t *out,               \
                                             int64_t out_stride) {                              \
        enum { CHAINS = MR <= 2 ? 2 : 1, M = MODE_##MODE, PER_UNIT = UNIT_GROUPS(M, G),          \
               STRIDE = GROUP_BYTES(M, G), LINES = (STRIDE + 63) / 64 + (HEAD_BYTES(M) > 0) };   \
        const __m512i gather = pair_gather(), sign = _mm512_set1_epi8((char)0x80);              \
        __m512 sums[MR];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) sums[r] = _mm512_setzero_ps();     \
        for (int64_t u = 0; u < groups / PER_UNIT; u++) {                                        \
            const uint8_t *unit = block + u * UNIT_BYTES(M, G);                                  \
            __m512 d, dmin;                                                                      \
            head_512(M, unit, &d, &dmin);                                                        \
            for (int64_t g = u * PER_UNIT; g < (u + 1) * PER_UNIT; g++) {                        \
                const uint8_t *at = unit + HEAD_BYTES(M) + (g - u * PER_UNIT) * STRIDE;          \
                __m512i dot[CHAINS][MR];                                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    dot[0][r] = _mm512_set1_epi32(x_offsets[r * groups + g]);                    \
                    _Pragma("GCC unroll 2") for (int c = 1; c < CHAINS; c++)                     \
                        dot[c][r] = _mm512_setzero_si512();                                      \
                }                                                                                \
                prefetch_ahead(at, PREFETCH_GROUPS * STRIDE, LINES);                             \
                _Pragma("GCC unroll 8") for (int p = 0; p < (G) / 4; p++) {                      \
                    const __m512i w = _mm512_xor_si512(                                          \
                        _mm512_permutexvar_epi16(gather,                                         \
                                                 _mm512_loadu_si512((const void *)(at + p * 64))), \
                        sign);                                                                   \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                         \
                        dot[p % CHAINS][r] = _mm512_dpbusd_epi32(                                \
                            dot[p % CHAINS][r], w,                                               \
                            four_inputs(xq + r * x_stride + g * (G) + 4 * p));                   \
                }                                                                                \
                __m512 scale, low;                                                               \
                factors_512(M, at + BLOCK * (G), d, dmin, &scale, &low);                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                           \
                    __m512i dr = dot[0][r];                                                      \
                    _Pragma("GCC unroll 2") for (int c = 1; c < CHAINS; c++)                     \
                        dr = _mm512_add_epi32(dr, dot[c][r]);                                    \
                    const __m512 product = _mm512_mul_ps(                                        \
                        _mm512_cvtepi32_ps(dr), _mm512_set1_ps(x_scales[r * groups + g]));       \
                    sums[r] = _mm512_fmadd_ps(scale, product, sums[r]);                          \
                    if (HAS_LOW(M))                                                              \
                        sums[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x_sums[r * groups + g]),   \
                                                  sums[r]);                                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            store_block(sums[r], bias, col, (int)(n - col), out + r * out_stride);               \
    }

#define DEFINE_INT_TILES(G, MODE)                                                                  \
    DEFINE_INT_TILE(1, G, MODE) DEFINE_INT_TILE(2, G, MODE) DEFINE_INT_TILE(4, G, MODE)         \
    DEFINE_INT_TILE(8, G, MODE)
#define INT_TILE_ROW(G, MODE)                                                                      \
    {int_tile_1_##G##_##MODE, int_tile_2_##G##_##MODE, int_tile_4_##G##_##MODE,                  \
     int_tile_8_##G##_##MODE},
INT_VARIANTS(DEFINE_INT_TILES)
/* int_matmul's: tiles of 1, 2, 4 and 8 rows, the rows' int8 form as bytes */
#define INT_LEVELS 4
typedef int8_t row_int;
#define QUANTIZE_INT8 quantize_row_int8

/* a row [k] of bf16 -> its int8 form (xq [k]: each group's inputs as multiples of d, its largest
 * magnitude / 127, rounded to nearest), each group's d, its inputs' sum as rounded (d x the sum
 * of xq) and -128 x the sum of xq. A group with an infinity or a NaN gets NaNs. */
static void quantize_row_int8(const uint16_t *row, int64_t k, int group, int8_t *xq,
                              float *x_scales, float *x_sums, int32_t *x_offsets) {
    const __m512 largest_finite = _mm512_set1_ps(3.4028235e38f);
    for (int64_t g = 0; g < k / group; g++) {
        __m512 values[2], largest = _mm512_setzero_ps();
        __mmask16 infinite = 0;
        for (int h = 0; h < group / 16; h++) {
            values[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(row + g * group + 16 * h))), 16));
            const __m512 magnitude = _mm512_abs_ps(values[h]);
            infinite |= _mm512_cmp_ps_mask(magnitude, largest_finite, _CMP_NLE_UQ);
            largest = _mm512_max_ps(largest, magnitude);
        }
        const float top = _mm512_reduce_max_ps(largest);
        /* in double: 127 / top overflows a float for the smallest subnormals */
        const double inverse = !infinite && top > 0.0f ? 127.0 / top : 0.0;
        __m256i total = _mm256_setzero_si256();
        for (int h = 0; h < group / 16; h++)
            for (int half = 0; half < 2; half++) {
                const __m512d wide = _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(values[h], 1)
                                                          : _mm512_castps512_ps256(values[h]));
                /* to nearest, ties to even; at most 127 in magnitude */
                const __m256i rounded = _mm512_cvtpd_epi32(_mm512_mul_pd(wide,
                                                                         _mm512_set1_pd(inverse)));
                _mm_storel_epi64((__m128i *)(xq + g * group + 16 * h + 8 * half),
                                 _mm256_cvtepi32_epi8(rounded));
                total = _mm256_add_epi32(total, rounded);
            }
        int32_t lanes[8], sum = 0;
        _mm256_storeu_si256((__m256i *)lanes, total);
        for (int i = 0; i < 8; i++)
            sum += lanes[i];
        const float d = top / 127.0f;
        x_scales[g] = infinite ? __builtin_nanf("") : d;
        x_sums[g] = infinite ? __builtin_nanf("") : d * (float)sum;
        x_offsets[g] = -128 * sum;
    }
}

#endif

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
                                                   int mode, uint16_t *to) {
    /* lane 2f + e of 16 float32 lanes takes feature f's factor: features 0-7, then 8-15 */
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const int per_unit = UNIT_GROUPS(mode, group), stride = GROUP_BYTES(mode, group);
    const int has_low = HAS_LOW(mode);
    for (int64_t u = 0; u < groups / per_unit; u++) {
        const uint8_t *unit = block + u * UNIT_BYTES(mode, group);
        __m512 d, dmin;
        head_512(mode, unit, &d, &dmin);
        for (int64_t g = u * per_unit; g < (u + 1) * per_unit; g++) {
            const uint8_t *at = unit + HEAD_BYTES(mode) + (g - u * per_unit) * stride;
            __m512 scale, low;
            factors_512(mode, at + BLOCK * group, d, dmin, &scale, &low);
            const __m512 scale_0 = _mm512_permutexvar_ps(first, scale);
            const __m512 scale_1 = _mm512_permutexvar_ps(second, scale);
            const __m512 low_0 = _mm512_permutexvar_ps(first, low);
            const __m512 low_1 = _mm512_permutexvar_ps(second, low);
            for (int i = 0; i < group / 2; i++) {
                const __m512 q_0 = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32))));
                const __m512 q_1 = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + i * 32 + 16))));
                /* q * scale, rounded, then + low, rounded (no fused multiply-add:
                 * -ffp-contract=off); no sum where the low is 0, as `restore` has none (a -0
                 * product stays -0) */
                __m512 w_0 = _mm512_mul_ps(q_0, scale_0), w_1 = _mm512_mul_ps(q_1, scale_1);
                if (has_low) {
                    w_0 = _mm512_add_ps(w_0, low_0);
                    w_1 = _mm512_add_ps(w_1, low_1);
                }
                _mm512_storeu_si512((void *)(to + (g * group / 2 + i) * 2 * BLOCK),
                                    (__m512i)_mm512_cvtne2ps_pbh(w_1, w_0));
            }
        }
    }
}

#elif defined(HAVE_AVX2_FMA)

/* 8 float16 -> float32 (exact) */
static inline __attribute__((always_inline)) __m256 widen_halves(const uint8_t *at) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
#else
    float values[8];
    for (int i = 0; i < 8; i++) {
        uint16_t bits;
        memcpy(&bits, at + 2 * i, sizeof bits);
        _Float16 half;
        memcpy(&half, &bits, sizeof half);
        values[i] = (float)half;
    }
    return _mm256_loadu_ps(values);
#endif
}

/* 8 bytes -> float32, signed or not */
static inline __attribute__((always_inline)) __m256 widen_bytes(const uint8_t *at, int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)at);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes)
                                        : _mm256_cvtepu8_epi32(bytes));
}

/* the superblock's d and dmin for the 8 features of half `half` (K6, K5) */
static inline __attribute__((always_inline)) void head_256(int mode, const uint8_t *unit, int half,
                                                           __m256 *d, __m256 *dmin) {
    *d = *dmin = _mm256_setzero_ps();
    if (mode == MODE_K6 || mode == MODE_K5)
        *d = _mm256_loadu_ps((const float *)unit + 8 * half);
    if (mode == MODE_K5)
        *dmin = _mm256_loadu_ps((const float *)unit + BLOCK + 8 * half);
}

/* a group's float32 scale and low for the 8 features of half `half`, as factors_512 */
static inline __attribute__((always_inline)) void
factors_256(int mode, const uint8_t *at, int half, __m256 d, __m256 dmin, __m256 *scale,
            __m256 *low) {
    *low = _mm256_setzero_ps();
    if (mode == MODE_F) {
        *scale = _mm256_loadu_ps((const float *)at + 8 * half);
        *low = _mm256_loadu_ps((const float *)at + BLOCK + 8 * half);
    } else if (mode == MODE_H || mode == MODE_HL) {
        *scale = widen_halves(at + 16 * half);
        if (mode == MODE_HL)
            *low = widen_halves(at + 2 * BLOCK + 16 * half);
    } else if (mode == MODE_K6) {
        *scale = _mm256_mul_ps(d, widen_bytes(at + 8 * half, 1));
    } else {
        *scale = _mm256_mul_ps(d, widen_bytes(at + 8 * half, 0));
        /* -(dmin * m): the sign flipped, so -(+0) is -0 */
        *low = _mm256_xor_ps(_mm256_mul_ps(dmin, widen_bytes(at + BLOCK + 8 * half, 0)),
                             _mm256_set1_ps(-0.0f));
    }
}

/* AVX2's integer tiles: every batch against the rows rounded to int8 a group by int8_rows.h (the
 * scalar form of quantize_row_int8: the same float64 products, so the same int8 values), so that
 * each group's D = sum q xq is the same int32 and the float32 epilogue (scale * (D * d), then
 * low * X, per group) the same operations on the same values: the AVX-512 VNNI build's results,
 * bit for bit (tests/unit/shard/test_int8_kernel_arithmetic.py). The int8 inputs are held as
 * int16, and each pair of them is one broadcast 32-bit load against 16 bytes of q sign-extended
 * to 16 bits: VPMADDWD multiplies (signed by signed, so q's -128 needs no care) and adds each
 * feature's two products into its int32 lane, features in order; 32 products a row take two
 * VPMADDWD and two adds. llama.cpp's VPMADDUBSW (unsigned by signed bytes) takes three
 * multiply-port instructions for them (VPSIGNB to make one side non-negative, the multiply,
 * VPMADDWD by ones to widen its 16-bit pair sums) and an add, and its usual sign trick (the
 * weights' sign moved onto the inputs) cannot negate a q of -128. */

/* sum + a group's int32 dot products in float32: times the row's group scale, then the block's
 * scale, plus the block's low times the row's input sum where the mode has lows */
static inline __attribute__((always_inline)) __m256 add_group_256(__m256 sum, __m256i dot,
                                                                  __m256 scale, __m256 low,
                                                                  float x_scale, float x_sum,
                                                                  int has_low) {
    const __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x_scale));
    sum = _mm256_fmadd_ps(scale, product, sum);
    return has_low ? _mm256_fmadd_ps(low, _mm256_set1_ps(x_sum), sum) : sum;
}

#ifdef __AVXVNNI__
/* With AVX-VNNI (Alder Lake and later without AVX-512), VPDPBUSD as on AVX-512: q + 128 (its sign
 * bit flipped) the unsigned operand against 4 int8 inputs, each row's group starting its sums at
 * -128 x (the sum of its int8 inputs), 32 products an instruction where VPDPWSSD on the int16
 * rows takes 16 (measured: 1.4-1.8x VPDPWSSD's speed at 8-512 rows, Q6_K and Q8_0). Each
 * 64 bytes of q hold pairs i and i + 1 ([2][16 features][2 inputs]); VPUNPCKLWD / VPUNPCKHWD of
 * their two halves put a feature's 4 bytes in a 32-bit lane, features [0-3, 8-11] and
 * [4-7, 12-15] (the factors permuted to match, the sums back to order as they are stored). */
typedef int8_t row_int;

/* MR rows (int8) x one block: each row's int32 dot products and float32 sums, in the unpacks'
 * feature order */
#define DEFINE_INT_TILE(MR, G, MODE)                                                               \
    static void int_tile_##MR##_##G##_##MODE(const int8_t *xq, int64_t x_stride,                \
                                             const float *x_scales, const float *x_sums,        \
                                             const int32_t *x_offsets, int64_t groups,          \
                                             const uint8_t *block, int64_t col, int64_t n,      \
                                             const uint16_t *bias, uint16_t *out,               \
                                             int64_t out_stride) {                              \
        enum { M = MODE_##MODE, PER_UNIT = UNIT_GROUPS(M, G), STRIDE = GROUP_BYTES(M, G),         \
               LINES = (STRIDE + 63) / 64 + (HEAD_BYTES(M) > 0) };                               \
        const __m256i sign = _mm256_set1_epi8((char)0x80);                                       \
        __m256 sums[MR][2];                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            sums[r][0] = sums[r][1] = _mm256_setzero_ps();                                       \
        for (int64_t u = 0; u < groups / PER_UNIT; u++) {                                        \
            const uint8_t *unit = block + u * UNIT_BYTES(M, G);                                  \
            __m256 d[2], dmin[2];                                                                \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                  \
                head_256(M, unit, h, &d[h], &dmin[h]);                                           \
            for (int64_t g = u * PER_UNIT; g < (u + 1) * PER_UNIT; g++) {                        \
                const uint8_t *at = unit + HEAD_BYTES(M) + (g - u * PER_UNIT) * STRIDE;          \
                prefetch_ahead(at, PREFETCH_GROUPS * STRIDE, LINES);                             \
                __m256i dot[MR][2];                                                              \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                             \
                    dot[r][0] = dot[r][1] = _mm256_set1_epi32(x_offsets[r * groups + g]);        \
                _Pragma("GCC unroll 8") for (int p = 0; p < (G) / 4; p++) {                      \
                    const __m256i even = _mm256_loadu_si256((const __m256i *)(at + p * 64));     \
                    const __m256i odd = _mm256_loadu_si256((const __m256i *)(at + p * 64 + 32)); \
                    const __m256i w[2] = {                                                       \
                        _mm256_xor_si256(_mm256_unpacklo_epi16(even, odd), sign),                \
                        _mm256_xor_si256(_mm256_unpackhi_epi16(even, odd), sign)};               \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                       \
                        int32_t four;                                                            \
                        memcpy(&four, xq + r * x_stride + g * (G) + 4 * p, sizeof four);         \
                        const __m256i inputs = _mm256_set1_epi32(four);                          \
                        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                      \
                            dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], w[h], inputs);        \
                    }                                                                            \
                }                                                                                \
                __m256 scale[2], low[2];                                                         \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                              \
                    factors_256(M, at + BLOCK * (G), h, d[h], dmin[h], &scale[h], &low[h]);      \
                const __m256 scales[2] = {_mm256_permute2f128_ps(scale[0], scale[1], 0x20),      \
                                          _mm256_permute2f128_ps(scale[0], scale[1], 0x31)};     \
                const __m256 lows[2] = {_mm256_permute2f128_ps(low[0], low[1], 0x20),            \
                                        _mm256_permute2f128_ps(low[0], low[1], 0x31)};           \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                             \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                          \
                        sums[r][h] = add_group_256(sums[r][h], dot[r][h], scales[h], lows[h],    \
                                                   x_scales[r * groups + g],                     \
                                                   x_sums[r * groups + g], HAS_LOW(M));          \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                                   \
            store_8(_mm256_permute2f128_ps(sums[r][0], sums[r][1], 0x20), bias, col,             \
                    (int)(n - col), out + r * out_stride);                                       \
            if (n - col > 8)                                                                     \
                store_8(_mm256_permute2f128_ps(sums[r][0], sums[r][1], 0x31), bias, col + 8,     \
                        (int)(n - col - 8), out + r * out_stride);                               \
        }                                                                                        \
    }
#else
typedef int16_t row_int;

/* MR rows (int16) x one block: each row's int32 dot products of the group's two halves (features
 * 0-7, 8-15) and its float32 sums over the groups so far. x_offsets are VPDPBUSD's (unused here:
 * VPMADDWD's products are signed already). */
#define DEFINE_INT_TILE(MR, G, MODE)                                                               \
    static void int_tile_##MR##_##G##_##MODE(const int16_t *xq, int64_t x_stride,               \
                                             const float *x_scales, const float *x_sums,        \
                                             const int32_t *x_offsets, int64_t groups,          \
                                             const uint8_t *block, int64_t col, int64_t n,      \
                                             const uint16_t *bias, uint16_t *out,               \
                                             int64_t out_stride) {                              \
        enum { M = MODE_##MODE, PER_UNIT = UNIT_GROUPS(M, G), STRIDE = GROUP_BYTES(M, G),         \
               LINES = (STRIDE + 63) / 64 + (HEAD_BYTES(M) > 0) };                               \
        (void)x_offsets;                                                                         \
        __m256 sums[MR][2];                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            sums[r][0] = sums[r][1] = _mm256_setzero_ps();                                       \
        for (int64_t u = 0; u < groups / PER_UNIT; u++) {                                        \
            const uint8_t *unit = block + u * UNIT_BYTES(M, G);                                  \
            __m256 d[2], dmin[2];                                                                \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                  \
                head_256(M, unit, h, &d[h], &dmin[h]);                                           \
            for (int64_t g = u * PER_UNIT; g < (u + 1) * PER_UNIT; g++) {                        \
                const uint8_t *at = unit + HEAD_BYTES(M) + (g - u * PER_UNIT) * STRIDE;          \
                prefetch_ahead(at, PREFETCH_GROUPS * STRIDE, LINES);                             \
                __m256i dot[MR][2];                                                              \
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                             \
                    dot[r][0] = dot[r][1] = _mm256_setzero_si256();                              \
                _Pragma("GCC unroll 4") for (int i = 0; i < (G) / 2; i++) {                      \
                    const __m256i w[2] = {                                                       \
                        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + i * 32))),   \
                        _mm256_cvtepi8_epi16(                                                    \
                            _mm_loadu_si128((const __m128i *)(at + i * 32 + 16)))};              \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {                       \
                        int32_t pair;                                                            \
                        memcpy(&pair, xq + r * x_stride + g * (G) + 2 * i, sizeof pair);         \
                        const __m256i both = _mm256_set1_epi32(pair);                            \
                        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                      \
                            dot[r][h] =                                                          \
                                _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(w[h], both));     \
                    }                                                                            \
                }                                                                                \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                            \
                    __m256 scale, low;                                                           \
                    factors_256(M, at + BLOCK * (G), h, d[h], dmin[h], &scale, &low);            \
                    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                         \
                        sums[r][h] = add_group_256(sums[r][h], dot[r][h], scale, low,            \
                                                   x_scales[r * groups + g],                     \
                                                   x_sums[r * groups + g], HAS_LOW(M));          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                  \
                if (col + 8 * h < n)                                                             \
                    store_8(sums[r][h], bias, col + 8 * h, (int)(n - col - 8 * h),               \
                            out + r * out_stride);                                               \
    }

#endif

#define DEFINE_INT_TILES(G, MODE)                                                                  \
    DEFINE_INT_TILE(1, G, MODE) DEFINE_INT_TILE(2, G, MODE) DEFINE_INT_TILE(4, G, MODE)
#define INT_TILE_ROW(G, MODE)                                                                      \
    {int_tile_1_##G##_##MODE, int_tile_2_##G##_##MODE, int_tile_4_##G##_##MODE},
INT_VARIANTS(DEFINE_INT_TILES)
#define INT_LEVELS 3

/* a row [k] of bf16 -> its int8 form (int8_rows.h's, float64 products as quantize_row_int8's)
 * held as the tiles' row_int, each group's d, input sum and -128 x the sum of its xq (VPDPBUSD's
 * start; VPMADDWD's tiles have no use for it) */
static void quantize_row_avx2(const uint16_t *row, int64_t k, int group, row_int *xq,
                              float *x_scales, float *x_sums, int32_t *x_offsets) {
    for (int64_t g = 0; g < k / group; g++) {
        int8_t rounded[32];
        quantize_row_int8_scalar(row + g * group, group, group, rounded, x_scales + g, x_sums + g,
                                 0);
        int32_t total = 0;
        for (int i = 0; i < group; i++) {
            xq[g * group + i] = rounded[i];
            total += rounded[i];
        }
        x_offsets[g] = -128 * total;
    }
}
#define QUANTIZE_INT8 quantize_row_avx2

#endif

#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)

/* the calling thread's scratch for a call (its rows' integer form and group sums) and on an
 * AVX-512 BF16 CPU without VNNI each thread's unpacked blocks: grown as needed and kept, as calls
 * repeat the same few sizes */
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
                          int64_t groups, int group, int mode, int64_t n, const uint16_t *bias,
                          uint16_t *out, int64_t out_stride, int64_t first, int64_t last,
                          uint16_t *unpacked) {
    const int64_t pairs = groups * group / 2;
    for (int64_t b = first; b < last; b += STRIP_BLOCKS) {
        const int nr = last - b < STRIP_BLOCKS ? (int)(last - b) : STRIP_BLOCKS;
        for (int j = 0; j < nr; j++)
            unpack_block(packed + (b + j) * block_bytes(groups * group, group, mode), groups,
                         group, mode,
                         unpacked + j * pairs * 2 * BLOCK);
        /* the strip as the whole weight of its own: its columns from b * BLOCK */
        const uint16_t *strip_bias = bias ? bias + b * BLOCK : 0;
        bf16_blocks(x, rows, x_stride, unpacked, pairs, n - b * BLOCK, strip_bias,
                    out + b * BLOCK, out_stride, 0, nr);
    }
}

/* more than TILE_MAX_ROWS rows: by the bf16 tiles over unpacked blocks */
static int unpacked_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t *packed, int group, int mode, int64_t n,
                           const uint16_t *bias, uint16_t *out, int64_t out_stride) {
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
            unpacked_pass(x + r * x_stride, rows, x_stride, packed, groups, group, mode, n, bias,
                          out + r * out_stride, out_stride, first, last, unpacked);
        }
    }
    return failed ? -2 : 0;
}

#endif

#endif

#if defined(HAVE_VNNI512) || defined(HAVE_AVX2_FMA)

typedef void (*int_tile_fn)(const row_int *, int64_t, const float *, const float *,
                            const int32_t *, int64_t, const uint8_t *, int64_t, int64_t,
                            const uint16_t *, uint16_t *, int64_t);

/* [variant (tile_variant)][rows in the tile: 1, 2, 4, and 8 on AVX-512] */
static const int_tile_fn INT_TILES[8][INT_LEVELS] = {INT_VARIANTS(INT_TILE_ROW)};

/* rows a pass takes against each thread's blocks: about 1 MB of their int8 form (on AVX2 held as
 * int16), which stays in L2 meanwhile (a multiple of 8 rows, the widest tile) */
static int64_t pass_rows(int64_t k) {
    const int64_t rows = (1 << 20) / (k * (int64_t)sizeof(row_int)) / 8 * 8;
    return rows < 8 ? 8 : rows;
}

/* every batch by the int8 tiles */
static int int_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride,
                      const uint8_t *weights, int group, int mode, int64_t n, const uint16_t *bias,
                      uint16_t *out, int64_t out_stride) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group;
    const int which = tile_variant(mode, group);
    const int64_t stride = block_bytes(k, group, mode), per_pass = pass_rows(k);
    /* the rows' int8 form, then each group's d, input sum and offset */
    const size_t row_bytes = (size_t)(m * k) * sizeof(row_int);
    row_int *xq = grown(&call_scratch, &call_capacity,
                        row_bytes + 64 + (size_t)(3 * m * groups) * sizeof(float));
    if (!xq)
        return -2;
    float *x_scales = (float *)((uint8_t *)xq + (row_bytes + 63) / 64 * 64);
    float *x_sums = x_scales + m * groups;
    int32_t *x_offsets = (int32_t *)(x_sums + m * groups);
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            QUANTIZE_INT8(x + r * x_stride, k, group, xq + r * k, x_scales + r * groups,
                          x_sums + r * groups, x_offsets + r * groups);
        /* (the loop's barrier: every row is ready before any thread reads them) */
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t pass = 0; pass < m; pass += per_pass) {
            const int64_t end = m - pass < per_pass ? m : pass + per_pass;
            int level = 0;
            while (level + 1 < INT_LEVELS && end - pass >= 1 << (level + 1))
                level++;
            for (int64_t b = first; b < last; b++) {
                int64_t r = pass;
                for (int lv = level; lv >= 0; lv--)
                    for (; r + (1 << lv) <= end; r += 1 << lv)
                        INT_TILES[which][lv](xq + r * k, k, x_scales + r * groups,
                                             x_sums + r * groups, x_offsets + r * groups, groups,
                                             weights + b * stride, b * BLOCK, n, bias,
                                             out + r * out_stride, out_stride);
            }
        }
    }
    return 0;
}

#endif

/* x [m, k] with rows x_stride apart, packed by int8_matmul_pack, bias [n] or NULL -> out [m, n]
 * with rows out_stride apart. Returns 0, -1 where this build has no kernel (or the header is not
 * one of int8_matmul_pack's for this k and n), -2 where its scratch could not be allocated. */
int int8_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint8_t *packed,
                int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
    int64_t header[5];
    memcpy(header, packed, sizeof header);
    if (header[0] != MAGIC || !valid_shape(k, header[1], header[4]) || header[2] != k
        || header[3] != n)
        return -1;
    const int group = (int)header[1], mode = (int)header[4];
    if (m <= 0)
        return 0;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = k / group;
    const uint8_t *weights = packed + HEADER_BYTES;
    const int which = tile_variant(mode, group);
    const int64_t stride = block_bytes(k, group, mode);
#endif
#if defined(HAVE_VNNI512) || defined(HAVE_AVX2_FMA)
    (void)blocks, (void)groups, (void)which, (void)stride;
    return int_matmul(x, m, k, x_stride, weights, group, mode, n, bias, out, out_stride);
#elif defined(HAVE_DPBF16)
    if (m > TILE_MAX_ROWS)
        return unpacked_matmul(x, m, k, x_stride, weights, group, mode, n, bias, out,
                               out_stride);
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
                                     groups, weights + b * stride,
                                     b * BLOCK, n, bias, out + r * out_stride, out_stride);
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out,
        (void)out_stride;
    return -1;
#endif
}
