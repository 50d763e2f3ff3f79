/* Which form of our matmuls a build has, for bf16_matmul.c and int4_matmul.c alike: HAVE_DPBF16
 * (AVX-512 BF16 dot products), HAVE_AVX2_FMA (float32 FMAs on AVX2) or neither, with the
 * intrinsics and OpenMP where one is; and BLOCK, the output features of a packed block (one zmm of
 * float32 sums), which both kernels' layouts share. */
#ifndef TGI_PY_MATMUL_ISA_H
#define TGI_PY_MATMUL_ISA_H

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_FMA 1
#endif
/* AVX-512 VNNI beside BF16 (every CPU with the one has the other so far): the 4- and 8-bit
 * matmuls' integer dot products */
#if defined(HAVE_DPBF16) && defined(__AVX512VNNI__)
#define HAVE_VNNI512 1
#endif
#if defined(HAVE_DPBF16) || defined(HAVE_AVX2_FMA)
#include <immintrin.h>
#include <omp.h>
#endif

#define BLOCK 16

/* 1: AVX-512 BF16 dot products; 2: float32 FMAs on AVX2; 0: no kernel in this build (what each
 * library's *_supported answers) */
static inline int matmul_form(void) {
#if defined(HAVE_DPBF16)
    return 1;
#elif defined(HAVE_AVX2_FMA)
    return 2;
#else
    return 0;
#endif
}

#endif
