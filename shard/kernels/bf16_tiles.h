/* The tiles of the bf16 matmul (bf16_matmul.c) over blocks of its packed layout ([n/16][k/2][16][2]
 * bf16: 16 output features, input features in adjacent pairs), shared with the int4 matmul
 * (int4_matmul.c), which unpacks its 4-bit blocks into that layout for prefill-size calls. In
 * the form the build has (matmul_isa.h): bf16_blocks multiplies rows (bf16 on AVX-512 BF16, widened
 * to float32 on AVX2) against a range of blocks; on AVX2 bf16_blocks_panel does from
 * PANEL_MIN_ROWS rows. */
#ifndef TGI_PY_BF16_TILES_H
#define TGI_PY_BF16_TILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "bf16_store.h"
#include "matmul_isa.h"

/* how far ahead (in input-feature pairs, one cache line of a block each) a tile asks for its
 * blocks' next lines, into L2: decode-size matmuls 6-14% faster than with the hardware
 * prefetchers alone; lines past a block's end are requested for nothing (prefetches do not fault;
 * the address is computed as an integer, not as a pointer past the buffer) */
#define PREFETCH_PAIRS 32

/* a tile's sums[MR][NR] (its rows x blocks from column col) stored, either form */
#define STORE_TILE(MR, NR)                                                                         \
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                                     \
            const int64_t at = col + j * BLOCK;                                                    \
            store_block(sums[r][j], bias, at, (int)(n - at), out + r * out_stride);                \
        }

#ifdef HAVE_DPBF16

/* One tile: MR rows x NR blocks, sums in registers. MR and NR are literals in each expansion, so
 * the arrays below become registers (with run-time sizes they would live on the stack). */
#define DEFINE_BF16_TILE(MR, NR)                                                                   \
    static void bf16_tile_##MR##_##NR(const uint16_t *x, int64_t x_stride,                         \
                                      const uint16_t *blocks, int64_t pairs, int64_t col,          \
                                      int64_t n, const uint16_t *bias, uint16_t *out,              \
                                      int64_t out_stride) {                                        \
        __m512 sums[MR][NR];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) sums[r][j] = _mm512_setzero_ps(); \
        for (int64_t p = 0; p < pairs; p++) {                                                      \
            __m512bh w[NR];                                                                        \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                   \
                _mm_prefetch((const char *)((uintptr_t)blocks + (uintptr_t)(j * pairs + p          \
                             + PREFETCH_PAIRS) * 2 * BLOCK * sizeof(uint16_t)),                    \
                             _MM_HINT_T1);                                                         \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) w[j] = (__m512bh)                 \
                _mm512_loadu_si512((const void *)(blocks + (j * pairs + p) * 2 * BLOCK));          \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                 \
                int32_t pair;                                                                      \
                memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);                              \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                              \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                               \
                    sums[r][j] = _mm512_dpbf16_ps(sums[r][j], a, w[j]);                            \
            }                                                                                      \
        }                                                                                          \
        STORE_TILE(MR, NR)                                                                         \
    }

/* 32 zmm registers: MR x NR sums, NR weight blocks and a broadcast */
DEFINE_BF16_TILE(1, 1) DEFINE_BF16_TILE(1, 2) DEFINE_BF16_TILE(1, 3) DEFINE_BF16_TILE(1, 4)
DEFINE_BF16_TILE(1, 5) DEFINE_BF16_TILE(1, 6) DEFINE_BF16_TILE(1, 7) DEFINE_BF16_TILE(1, 8)
DEFINE_BF16_TILE(2, 1) DEFINE_BF16_TILE(2, 2) DEFINE_BF16_TILE(2, 3) DEFINE_BF16_TILE(2, 4)
DEFINE_BF16_TILE(2, 5) DEFINE_BF16_TILE(2, 6) DEFINE_BF16_TILE(4, 1) DEFINE_BF16_TILE(4, 2)
DEFINE_BF16_TILE(4, 3) DEFINE_BF16_TILE(4, 4) DEFINE_BF16_TILE(4, 5) DEFINE_BF16_TILE(8, 1)
DEFINE_BF16_TILE(8, 2) DEFINE_BF16_TILE(8, 3)
#undef DEFINE_BF16_TILE

typedef void (*bf16_tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t,
                             int64_t, const uint16_t *, uint16_t *, int64_t);

/* [rows in the tile: 1, 2, 4, 8][blocks - 1] */
static const bf16_tile_fn BF16_TILES[4][8] = {
    {bf16_tile_1_1, bf16_tile_1_2, bf16_tile_1_3, bf16_tile_1_4, bf16_tile_1_5, bf16_tile_1_6,
     bf16_tile_1_7, bf16_tile_1_8},
    {bf16_tile_2_1, bf16_tile_2_2, bf16_tile_2_3, bf16_tile_2_4, bf16_tile_2_5, bf16_tile_2_6, 0,
     0},
    {bf16_tile_4_1, bf16_tile_4_2, bf16_tile_4_3, bf16_tile_4_4, bf16_tile_4_5, 0, 0, 0},
    {bf16_tile_8_1, bf16_tile_8_2, bf16_tile_8_3, 0, 0, 0, 0, 0},
};
/* the widest tile per row count: more blocks share each broadcast when there are few rows */
static const int BF16_MAX_BLOCKS[4] = {8, 6, 5, 3};

/* all m rows against blocks [first, last) */
static void bf16_blocks(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                        int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                        int64_t out_stride, int64_t first, int64_t last) {
    const int level = m >= 8 ? 3 : m >= 4 ? 2 : m >= 2 ? 1 : 0;
    const int width = BF16_MAX_BLOCKS[level];
    for (int64_t b = first; b < last; b += width) {
        const int nr = last - b < width ? (int)(last - b) : width;
        const uint16_t *blocks = packed + b * pairs * 2 * BLOCK;
        int64_t r = 0;
        /* the block panel stays in cache while the row tiles pass over it */
        for (int lv = level; lv >= 0; lv--) {
            const int mr = 1 << lv;
            const int cols = nr < BF16_MAX_BLOCKS[lv] ? nr : BF16_MAX_BLOCKS[lv];
            for (; r + mr <= m; r += mr)
                for (int j = 0; j < nr; j += cols) {
                    const int c = nr - j < cols ? nr - j : cols;
                    BF16_TILES[lv][c - 1](x + r * x_stride, x_stride,
                                          blocks + j * pairs * 2 * BLOCK, pairs, (b + j) * BLOCK,
                                          n, bias, out + r * out_stride, out_stride);
                }
        }
    }
}

#elif defined(HAVE_AVX2_FMA)

/* One tile: MR rows (widened to float32) x NR blocks. A block's pair of inputs is, widened, four
 * vectors of 4 features x (even input, odd input); a row's pair of inputs is broadcast as one
 * 64-bit (even, odd), so one FMA multiplies 4 features by both inputs and each feature's sum
 * lies in two lanes until the store adds them. */
#define DEFINE_BF16_TILE(MR, NR)                                                                   \
    static void bf16_tile_##MR##_##NR(const float *x, int64_t x_stride,                            \
                                      const uint16_t *blocks, int64_t pairs, int64_t col,          \
                                      int64_t n, const uint16_t *bias, uint16_t *out,              \
                                      int64_t out_stride) {                                        \
        __m256 sums[MR][NR][4];                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                   \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)                                \
                    sums[r][j][q] = _mm256_setzero_ps();                                           \
        for (int64_t p = 0; p < pairs; p++) {                                                      \
            __m256 in[MR];                                                                         \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                   \
                _mm_prefetch((const char *)((uintptr_t)blocks + (uintptr_t)(j * pairs + p          \
                             + PREFETCH_PAIRS) * 2 * BLOCK * sizeof(uint16_t)),                    \
                             _MM_HINT_T1);                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                   \
                in[r] = _mm256_castpd_ps(_mm256_broadcast_sd(                                      \
                    (const double *)(x + r * x_stride + 2 * p)));                                  \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                   \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {                              \
                    const __m256 w = widen_8(blocks + (j * pairs + p) * 2 * BLOCK + q * 8);        \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                           \
                        sums[r][j][q] = _mm256_fmadd_ps(in[r], w, sums[r][j][q]);                  \
                }                                                                                  \
        }                                                                                          \
        STORE_TILE(MR, NR)                                                                         \
    }

/* 16 ymm registers: 4 x MR x NR sums, MR broadcasts, the widened weight */
DEFINE_BF16_TILE(1, 1) DEFINE_BF16_TILE(1, 2) DEFINE_BF16_TILE(1, 3) DEFINE_BF16_TILE(2, 1)
DEFINE_BF16_TILE(3, 1)
#undef DEFINE_BF16_TILE

typedef void (*bf16_tile_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t,
                             int64_t, const uint16_t *, uint16_t *, int64_t);

/* [rows in the tile - 1][blocks - 1] */
static const bf16_tile_fn BF16_TILES[3][3] = {
    {bf16_tile_1_1, bf16_tile_1_2, bf16_tile_1_3},
    {bf16_tile_2_1, 0, 0},
    {bf16_tile_3_1, 0, 0},
};
static const int BF16_MAX_BLOCKS[3] = {3, 1, 1};

/* Prefill-size calls (PANEL_MIN_ROWS rows and more) widen each block once into a float32 panel
 * ([pairs][32]: quarter q of a pair holds features 4q..4q+3 x (even, odd), as the tiles above widen
 * them) and run 6 rows x half a block over it: 12 sums, the half's two weight vectors and a
 * broadcast, 15 of the 16 registers, each weight widened once per pass instead of once per 3 rows.
 * Written with named sums: as arrays GCC spilled one to the stack in the inner loop. */
#define PANEL_MIN_ROWS 24
#define PANEL_ROWS 6

#define PANEL_ROW(r, a, b)                                                                         \
    in = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + (r) * x_stride + 2 * p)));      \
    a = _mm256_fmadd_ps(in, w0, a);                                                                \
    b = _mm256_fmadd_ps(in, w1, b);

static void panel_tile_6(const float *x, int64_t x_stride, const float *half, int64_t pairs,
                         int64_t col, int64_t n, const uint16_t *bias, uint16_t *out,
                         int64_t out_stride) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0,
           b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
    for (int64_t p = 0; p < pairs; p++) {
        const __m256 w0 = _mm256_loadu_ps(half + p * 2 * BLOCK);
        const __m256 w1 = _mm256_loadu_ps(half + p * 2 * BLOCK + 8);
        __m256 in;
        PANEL_ROW(0, a0, b0)
        PANEL_ROW(1, a1, b1)
        PANEL_ROW(2, a2, b2)
        PANEL_ROW(3, a3, b3)
        PANEL_ROW(4, a4, b4)
        PANEL_ROW(5, a5, b5)
    }
    const int valid = (int)(n - col);
    store_half(a0, b0, bias, col, valid, out);
    store_half(a1, b1, bias, col, valid, out + out_stride);
    store_half(a2, b2, bias, col, valid, out + 2 * out_stride);
    store_half(a3, b3, bias, col, valid, out + 3 * out_stride);
    store_half(a4, b4, bias, col, valid, out + 4 * out_stride);
    store_half(a5, b5, bias, col, valid, out + 5 * out_stride);
}

/* block -> panel [pairs][32 floats] */
static void widen_block(const uint16_t *block, int64_t pairs, float *panel) {
    for (int64_t i = 0; i < pairs * 2 * BLOCK; i += 8)
        _mm256_storeu_ps(panel + i, widen_8(block + i));
}

static void bf16_blocks(const float *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                        int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                        int64_t out_stride, int64_t first, int64_t last);

/* m rows (float32) against blocks [first, last): 6-row tiles over each block's panel, the last
 * m % 6 rows by the tiles above */
__attribute__((noinline)) static void
bf16_blocks_panel(const float *x, int64_t m, int64_t x_stride, const uint16_t *packed, int64_t pairs,
                  int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t first,
                  int64_t last, float *panel) {
    const int64_t whole = m / PANEL_ROWS * PANEL_ROWS;
    for (int64_t b = first; b < last; b++) {
        widen_block(packed + b * pairs * 2 * BLOCK, pairs, panel);
        for (int h = 0; h < 2 && b * BLOCK + h * 8 < n; h++)
            for (int64_t r = 0; r < whole; r += PANEL_ROWS)
                panel_tile_6(x + r * x_stride, x_stride, panel + h * 16, pairs,
                             b * BLOCK + h * 8, n, bias, out + r * out_stride, out_stride);
    }
    if (whole < m)
        bf16_blocks(x + whole * x_stride, m - whole, x_stride, packed, pairs, n, bias,
                      out + whole * out_stride, out_stride, first, last);
}

/* all m rows (float32) against blocks [first, last) */
static void bf16_blocks(const float *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                        int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                        int64_t out_stride, int64_t first, int64_t last) {
    const int widest = m >= 3 ? 3 : (int)m;
    const int width = BF16_MAX_BLOCKS[widest - 1];
    for (int64_t b = first; b < last; b += width) {
        const int nr = last - b < width ? (int)(last - b) : width;
        const uint16_t *blocks = packed + b * pairs * 2 * BLOCK;
        int64_t r = 0;
        /* the block panel stays in cache while the row tiles pass over it */
        for (int mr = widest; mr >= 1; mr--) {
            const int cols = nr < BF16_MAX_BLOCKS[mr - 1] ? nr : BF16_MAX_BLOCKS[mr - 1];
            for (; r + mr <= m; r += mr)
                for (int j = 0; j < nr; j += cols) {
                    const int c = nr - j < cols ? nr - j : cols;
                    BF16_TILES[mr - 1][c - 1](x + r * x_stride, x_stride,
                                              blocks + j * pairs * 2 * BLOCK, pairs,
                                              (b + j) * BLOCK, n, bias, out + r * out_stride,
                                              out_stride);
                }
        }
    }
}

static void widen_row(const uint16_t *row, int64_t k, float *out) {
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, widen_8(row + i));
    for (; i < k; i++)
        out[i] = bf16_to_float(row[i]);
}

#endif
#endif
