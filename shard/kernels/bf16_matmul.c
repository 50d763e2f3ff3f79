/* y = x W^T (+ b) for bf16 x [m, k] and W [n, k]: on CPUs with AVX-512 BF16 dot products, and on
 * AVX2 + FMA CPUs in float32 arithmetic on the bf16 values.
 *
 * oneDNN's prepacked bf16 matmul (what PyTorch calls) spends about 10 us a call building and
 * looking up its primitive, and at decode sizes (1-64 rows) runs at 30-75% of this CPU's bf16
 * rate; a decode step makes 121 such calls on SmolLM2. Here a call is a loop over a tile kernel:
 * the weight is packed once, at load time, as blocks of 16 output features with the input features
 * in adjacent pairs ([n/16][k/2][16][2], the operand layout of VDPBF16PS), so a tile of up to 8
 * rows x 3-8 blocks keeps its float32 sums in registers while it streams its blocks once, reading
 * each pair of a row's inputs as one broadcast. The threads of PyTorch's OpenMP team split the
 * blocks evenly.
 *
 * AVX2 CPUs have no bf16 arithmetic (PyTorch emulates it there, 3-5x slower than float32): the
 * same packed blocks are read 16 bytes (4 features x an input pair) at a time and widened to 8
 * float32 weights (zero-extend, shift), and a row's pair of inputs (each pass of rows widened once
 * to float32) is broadcast as one 64-bit value, so one FMA multiplies 4 features by both inputs;
 * a feature's two lanes are added at the store. A tile holds up to 3 rows x 1 block or 1 row x 3
 * blocks in the 16 ymm registers; from PANEL_MIN_ROWS rows each block is widened once into a
 * float32 panel that tiles of 6 rows x half a block read.
 *
 * Rounding: products and sums in float32 (VDPBF16PS, as oneDNN's bf16 kernels on this CPU; on AVX2
 * each bf16 x bf16 product is exact in float32 and one FMA rounds the sum), the bias added in
 * float32, the result rounded once to bf16 (to nearest, ties to even). Only the order of the sums
 * differs from oneDNN's, which moves a result by one bf16 unit in rare elements. Without either
 * instruction set the library builds but `bf16_matmul_supported` says 0 and the caller keeps
 * PyTorch's matmul.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_FMA 1
#include <stdlib.h>
#endif
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
#include <immintrin.h>
#include <omp.h>

#include "bf16_store.h"
#endif

/* below this many multiply-adds a call stays on the calling thread */
#define PARALLEL_MIN_WORK (1 << 16)
#define BLOCK 16 /* output features a block holds (one zmm of float32 sums) */
/* rows a pass over the blocks takes: their inputs stay in L2 (147-393 KB at 576-1536 features)
 * while each block panel passes over them; a prefill of thousands of rows would otherwise read
 * its inputs from memory once per panel */
#define ROWS_PER_PASS 128
/* how far ahead (in input-feature pairs, one cache line of a block each) a tile asks for its
 * blocks' next lines, into L2: decode-size matmuls 6-14% faster than with the hardware
 * prefetchers alone; lines past a block's end are requested for nothing (prefetches do not fault;
 * the address is computed as an integer, not as a pointer past the buffer) */
#define PREFETCH_PAIRS 32

/* 1: AVX-512 BF16 dot products; 2: float32 FMAs on AVX2; 0: no kernel in this build */
int bf16_matmul_supported(void) {
#if defined(HAVE_DPBF16)
    return 1;
#elif defined(HAVE_AVX2_FMA)
    return 2;
#else
    return 0;
#endif
}

int64_t bf16_matmul_packed_elements(int64_t n, int64_t k) {
    return (n + BLOCK - 1) / BLOCK * (k / 2) * BLOCK * 2;
}

/* w [n, k] (k even) -> out [ceil(n/16)][k/2][16][2]; features past n are zeros */
void bf16_matmul_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < BLOCK; j++) {
                const int64_t row = b * BLOCK + j;
                uint16_t *to = out + ((b * pairs + p) * BLOCK + j) * 2;
                to[0] = row < n ? w[row * k + 2 * p] : 0;
                to[1] = row < n ? w[row * k + 2 * p + 1] : 0;
            }
}

#ifdef HAVE_DPBF16

/* One tile: MR rows x NR blocks, sums in registers. MR and NR are literals in each expansion, so
 * the arrays below become registers (with run-time sizes they would live on the stack). */
#define DEFINE_TILE(MR, NR)                                                                        \
    static void tile_##MR##_##NR(const uint16_t *x, int64_t x_stride, const uint16_t *blocks,   \
                                 int64_t pairs, int64_t col, int64_t n, const uint16_t *bias,    \
                                 uint16_t *out, int64_t out_stride) {                            \
        __m512 sums[MR][NR];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) sums[r][j] = _mm512_setzero_ps(); \
        for (int64_t p = 0; p < pairs; p++) {                                                    \
            __m512bh w[NR];                                                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                 \
                _mm_prefetch((const char *)((uintptr_t)blocks + (uintptr_t)(j * pairs + p          \
                             + PREFETCH_PAIRS) * 2 * BLOCK * sizeof(uint16_t)),                 \
                             _MM_HINT_T1);                                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) w[j] = (__m512bh)               \
                _mm512_loadu_si512((const void *)(blocks + (j * pairs + p) * 2 * BLOCK));        \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                               \
                int32_t pair;                                                                    \
                memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);                            \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                            \
                _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                             \
                    sums[r][j] = _mm512_dpbf16_ps(sums[r][j], a, w[j]);                          \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                               \
                const int64_t at = col + j * BLOCK;                                              \
                store_block(sums[r][j], bias, at, (int)(n - at), out + r * out_stride);          \
            }                                                                                    \
    }

/* 32 zmm registers: MR x NR sums, NR weight blocks and a broadcast */
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3) DEFINE_TILE(1, 4) DEFINE_TILE(1, 5)
DEFINE_TILE(1, 6) DEFINE_TILE(1, 7) DEFINE_TILE(1, 8)
DEFINE_TILE(2, 1) DEFINE_TILE(2, 2) DEFINE_TILE(2, 3) DEFINE_TILE(2, 4) DEFINE_TILE(2, 5)
DEFINE_TILE(2, 6)
DEFINE_TILE(4, 1) DEFINE_TILE(4, 2) DEFINE_TILE(4, 3) DEFINE_TILE(4, 4) DEFINE_TILE(4, 5)
DEFINE_TILE(8, 1) DEFINE_TILE(8, 2) DEFINE_TILE(8, 3)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, int64_t,
                        const uint16_t *, uint16_t *, int64_t);

/* [rows in the tile: 1, 2, 4, 8][blocks - 1] */
static const tile_fn TILES[4][8] = {
    {tile_1_1, tile_1_2, tile_1_3, tile_1_4, tile_1_5, tile_1_6, tile_1_7, tile_1_8},
    {tile_2_1, tile_2_2, tile_2_3, tile_2_4, tile_2_5, tile_2_6, 0, 0},
    {tile_4_1, tile_4_2, tile_4_3, tile_4_4, tile_4_5, 0, 0, 0},
    {tile_8_1, tile_8_2, tile_8_3, 0, 0, 0, 0, 0},
};
/* the widest tile per row count: more blocks share each broadcast when there are few rows */
static const int MAX_BLOCKS[4] = {8, 6, 5, 3};

/* all m rows against blocks [first, last) */
static void matmul_blocks(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                          int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                          int64_t out_stride, int64_t first, int64_t last) {
    const int level = m >= 8 ? 3 : m >= 4 ? 2 : m >= 2 ? 1 : 0;
    const int width = MAX_BLOCKS[level];
    for (int64_t b = first; b < last; b += width) {
        const int nr = last - b < width ? (int)(last - b) : width;
        const uint16_t *blocks = packed + b * pairs * 2 * BLOCK;
        int64_t r = 0;
        /* the block panel stays in cache while the row tiles pass over it */
        for (int lv = level; lv >= 0; lv--) {
            const int mr = 1 << lv;
            const int cols = nr < MAX_BLOCKS[lv] ? nr : MAX_BLOCKS[lv];
            for (; r + mr <= m; r += mr)
                for (int j = 0; j < nr; j += cols) {
                    const int c = nr - j < cols ? nr - j : cols;
                    TILES[lv][c - 1](x + r * x_stride, x_stride, blocks + j * pairs * 2 * BLOCK,
                                     pairs, (b + j) * BLOCK, n, bias, out + r * out_stride,
                                     out_stride);
                }
        }
    }
}

#elif defined(HAVE_AVX2_FMA)

/* One tile: MR rows (widened to float32) x NR blocks. A block's pair of inputs is, widened, four
 * vectors of 4 features x (even input, odd input); a row's pair of inputs is broadcast as one
 * 64-bit (even, odd), so one FMA multiplies 4 features by both inputs and each feature's sum
 * lies in two lanes until the store adds them. */
#define DEFINE_TILE(MR, NR)                                                                        \
    static void tile_##MR##_##NR(const float *x, int64_t x_stride, const uint16_t *blocks,      \
                                 int64_t pairs, int64_t col, int64_t n, const uint16_t *bias,    \
                                 uint16_t *out, int64_t out_stride) {                            \
        __m256 sums[MR][NR][4];                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                 \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)                              \
                    sums[r][j][q] = _mm256_setzero_ps();                                         \
        for (int64_t p = 0; p < pairs; p++) {                                                    \
            __m256 in[MR];                                                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                 \
                _mm_prefetch((const char *)((uintptr_t)blocks + (uintptr_t)(j * pairs + p          \
                             + PREFETCH_PAIRS) * 2 * BLOCK * sizeof(uint16_t)),                 \
                             _MM_HINT_T1);                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                 \
                in[r] = _mm256_castpd_ps(_mm256_broadcast_sd(                                    \
                    (const double *)(x + r * x_stride + 2 * p)));                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++)                                 \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {                            \
                    const __m256 w = widen_8(blocks + (j * pairs + p) * 2 * BLOCK + q * 8);      \
                    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                         \
                        sums[r][j][q] = _mm256_fmadd_ps(in[r], w, sums[r][j][q]);                \
                }                                                                                \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NR; j++) {                               \
                const int64_t at = col + j * BLOCK;                                              \
                store_block(sums[r][j], bias, at, (int)(n - at), out + r * out_stride);          \
            }                                                                                    \
    }

/* 16 ymm registers: 4 x MR x NR sums, MR broadcasts, the widened weight */
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 1)

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t, int64_t,
                        const uint16_t *, uint16_t *, int64_t);

/* [rows in the tile - 1][blocks - 1] */
static const tile_fn TILES[3][3] = {
    {tile_1_1, tile_1_2, tile_1_3},
    {tile_2_1, 0, 0},
    {tile_3_1, 0, 0},
};
static const int MAX_BLOCKS[3] = {3, 1, 1};

/* Prefill-size calls (PANEL_MIN_ROWS rows and more) widen each block once into a float32 panel
 * ([pairs][32]: quarter q of a pair holds features 4q..4q+3 x (even, odd), as the tiles above widen
 * them) and run 6 rows x half a block over it: 12 sums, the half's two weight vectors and a
 * broadcast, 15 of the 16 registers, each weight widened once per pass instead of once per 3 rows.
 * Written with named sums: as arrays GCC spilled one to the stack in the inner loop. */
#define PANEL_MIN_ROWS 24
#define PANEL_ROWS 6

#define PANEL_ROW(r, a, b)                                                                         \
    in = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + (r) * x_stride + 2 * p)));    \
    a = _mm256_fmadd_ps(in, w0, a);                                                              \
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

static void matmul_blocks(const float *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                          int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                          int64_t out_stride, int64_t first, int64_t last);

/* m rows (float32) against blocks [first, last): 6-row tiles over each block's panel, the last
 * m % 6 rows by the tiles above */
static void matmul_blocks_panel(const float *x, int64_t m, int64_t x_stride,
                                const uint16_t *packed, int64_t pairs, int64_t n,
                                const uint16_t *bias, uint16_t *out, int64_t out_stride,
                                int64_t first, int64_t last, float *panel) {
    const int64_t whole = m / PANEL_ROWS * PANEL_ROWS;
    for (int64_t b = first; b < last; b++) {
        widen_block(packed + b * pairs * 2 * BLOCK, pairs, panel);
        for (int h = 0; h < 2 && b * BLOCK + h * 8 < n; h++)
            for (int64_t r = 0; r < whole; r += PANEL_ROWS)
                panel_tile_6(x + r * x_stride, x_stride, panel + h * 16, pairs,
                             b * BLOCK + h * 8, n, bias, out + r * out_stride, out_stride);
    }
    if (whole < m)
        matmul_blocks(x + whole * x_stride, m - whole, x_stride, packed, pairs, n, bias,
                      out + whole * out_stride, out_stride, first, last);
}

/* all m rows (float32) against blocks [first, last) */
static void matmul_blocks(const float *x, int64_t m, int64_t x_stride, const uint16_t *packed,
                          int64_t pairs, int64_t n, const uint16_t *bias, uint16_t *out,
                          int64_t out_stride, int64_t first, int64_t last) {
    const int widest = m >= 3 ? 3 : (int)m;
    const int width = MAX_BLOCKS[widest - 1];
    for (int64_t b = first; b < last; b += width) {
        const int nr = last - b < width ? (int)(last - b) : width;
        const uint16_t *blocks = packed + b * pairs * 2 * BLOCK;
        int64_t r = 0;
        /* the block panel stays in cache while the row tiles pass over it */
        for (int mr = widest; mr >= 1; mr--) {
            const int cols = nr < MAX_BLOCKS[mr - 1] ? nr : MAX_BLOCKS[mr - 1];
            for (; r + mr <= m; r += mr)
                for (int j = 0; j < nr; j += cols) {
                    const int c = nr - j < cols ? nr - j : cols;
                    TILES[mr - 1][c - 1](x + r * x_stride, x_stride,
                                         blocks + j * pairs * 2 * BLOCK, pairs, (b + j) * BLOCK,
                                         n, bias, out + r * out_stride, out_stride);
                }
        }
    }
}

/* the calling thread's buffer for a pass of rows widened to float32, grown as needed and kept
 * (at most ROWS_PER_PASS rows of the widest input) */
static __thread float *wide_rows;
static __thread int64_t wide_capacity;

static float *wide_buffer(int64_t elements) {
    if (elements > wide_capacity) {
        float *grown = realloc(wide_rows, (size_t)elements * sizeof(float));
        if (!grown)
            return 0;
        wide_rows = grown;
        wide_capacity = elements;
    }
    return wide_rows;
}

static void widen_row(const uint16_t *row, int64_t k, float *out) {
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(out + i, widen_8(row + i));
    for (; i < k; i++)
        out[i] = bf16_to_float(row[i]);
}

#endif

/* x [m, k] with rows x_stride apart (k even), packed by bf16_matmul_pack, bias [n] or NULL ->
 * out [m, n] with rows out_stride apart. Returns 0, -1 where this build has no kernel, -2 where
 * the AVX2 form could not allocate its float32 rows. */
int bf16_matmul(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                int64_t n, const uint16_t *bias, uint16_t *out, int64_t out_stride) {
#ifdef HAVE_DPBF16
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = k / 2;
    if (m <= 0 || n <= 0)
        return 0;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t r = 0; first < last && r < m; r += ROWS_PER_PASS)
            matmul_blocks(x + r * x_stride, m - r < ROWS_PER_PASS ? m - r : ROWS_PER_PASS,
                          x_stride, packed, pairs, n, bias, out + r * out_stride, out_stride,
                          first, last);
    }
    return 0;
#elif defined(HAVE_AVX2_FMA)
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = k / 2;
    if (m <= 0 || n <= 0)
        return 0;
    if (k <= 0)
        return -1;
    const int64_t pass_elements = (m < ROWS_PER_PASS ? m : ROWS_PER_PASS) * k;
    /* after the rows, a panel per thread where the panel tiles run */
    const int64_t panel_stride = m >= PANEL_MIN_ROWS ? pairs * 2 * BLOCK : 0;
    const int parallel = m * n * k >= PARALLEL_MIN_WORK;
    float *wide = wide_buffer(pass_elements
                              + (parallel ? omp_get_max_threads() : 1) * panel_stride);
    if (!wide)
        return -2;
    float *panel = wide + pass_elements;
#pragma omp parallel if (parallel)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t r = 0; r < m; r += ROWS_PER_PASS) {
            const int64_t rows = m - r < ROWS_PER_PASS ? m - r : ROWS_PER_PASS;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                widen_row(x + (r + i) * x_stride, k, wide + i * k);
            /* (the loop's barrier: every row is widened before any thread reads them) */
            if (first < last && rows >= PANEL_MIN_ROWS)
                matmul_blocks_panel(wide, rows, k, packed, pairs, n, bias, out + r * out_stride,
                                    out_stride, first, last, panel + thread * panel_stride);
            else if (first < last)
                matmul_blocks(wide, rows, k, packed, pairs, n, bias, out + r * out_stride,
                              out_stride, first, last);
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
