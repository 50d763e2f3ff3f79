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
#include "matmul_isa.h"
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
#include "bf16_tiles.h"
#endif

/* below this many multiply-adds a call stays on the calling thread */
#define PARALLEL_MIN_WORK (1 << 16)
/* rows a pass over the blocks takes: their inputs stay in L2 (147-393 KB at 576-1536 features)
 * while each block panel passes over them; a prefill of thousands of rows would otherwise read
 * its inputs from memory once per panel */
#define ROWS_PER_PASS 128

/* 1: AVX-512 BF16 dot products; 2: float32 FMAs on AVX2; 0: no kernel in this build */
int bf16_matmul_supported(void) { return matmul_form(); }

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

#ifdef HAVE_AVX2_FMA
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
            bf16_blocks(x + r * x_stride, m - r < ROWS_PER_PASS ? m - r : ROWS_PER_PASS,
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
                bf16_blocks_panel(wide, rows, k, packed, pairs, n, bias, out + r * out_stride,
                                    out_stride, first, last, panel + thread * panel_stride);
            else if (first < last)
                bf16_blocks(wide, rows, k, packed, pairs, n, bias, out + r * out_stride,
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
