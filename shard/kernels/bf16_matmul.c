/* y = x W^T (+ b) for bf16 x [m, k] and W [n, k] on CPUs with AVX-512 BF16 dot products.
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
 * Rounding: products and sums in float32 (VDPBF16PS, as oneDNN's bf16 kernels on this CPU), the
 * bias added in float32, the result rounded once to bf16 (to nearest, ties to even). Only the
 * order of the sums differs from oneDNN's, which moves a result by one bf16 unit in rare elements.
 * Without AVX-512 BF16 the library builds but `bf16_matmul_supported` says 0 and the caller keeps
 * PyTorch's matmul.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#include <immintrin.h>
#include <omp.h>
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

int bf16_matmul_supported(void) {
#ifdef HAVE_DPBF16
    return 1;
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

/* the sums of one block, plus the bias, rounded to bf16; `valid` of its 16 features are stored */
static inline __attribute__((always_inline)) void
store_block(__m512 sums, const uint16_t *bias, int64_t col, int valid, uint16_t *out) {
    const __mmask16 mask = valid >= BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
    if (bias) {
        __m256i b = _mm256_maskz_loadu_epi16(mask, bias + col);
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(b), 16)));
    }
    _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

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

#endif

/* x [m, k] with rows x_stride apart (k even), packed by bf16_matmul_pack, bias [n] or NULL ->
 * out [m, n] with rows out_stride apart. Returns 0, or -1 where this build has no kernel. */
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
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out,
        (void)out_stride;
    return -1;
#endif
}
