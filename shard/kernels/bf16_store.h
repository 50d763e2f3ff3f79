/* Storing float32 sums as bf16 rows, shared by the matmul kernels (bf16_matmul.c, int4_matmul.c,
 * int8_matmul.c): the bias added in float32, one rounding to bf16 (to nearest, ties to even, as
 * float_to_bf16), `valid` of the features stored, in the form the build has (matmul_isa.h). */
#ifndef TGI_PY_BF16_STORE_H
#define TGI_PY_BF16_STORE_H

#include <stdint.h>

#include "bf16.h"
#include "matmul_isa.h"

#if defined(HAVE_DPBF16)

/* 16 features' sums (one zmm) */
static inline __attribute__((always_inline)) void
store_block(__m512 sums, const uint16_t *bias, int64_t col, int valid, uint16_t *out) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
    if (bias) {
        __m256i b = _mm256_maskz_loadu_epi16(mask, bias + col);
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(b), 16)));
    }
    _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

#elif defined(HAVE_AVX2_FMA)

/* 8 float32 sums -> 8 bf16 (a NaN stays a quiet NaN), as float_to_bf16 */
static inline __attribute__((always_inline)) __m128i round_to_bf16(__m256 sums) {
    const __m256i bits = _mm256_castps_si256(sums);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i out = _mm256_blendv_epi8(rounded, nan, is_nan);
    /* every value fits 16 bits, so the saturating pack keeps them */
    return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}

/* 8 bf16 -> 8 float32 (exact) */
static inline __attribute__((always_inline)) __m256 widen_8(const uint16_t *values) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)values)), 16));
}

/* 8 features' sums, in order */
static inline __attribute__((always_inline)) void
store_8(__m256 sums, const uint16_t *bias, int64_t col, int valid, uint16_t *out) {
    if (valid >= 8) {
        if (bias)
            sums = _mm256_add_ps(sums, widen_8(bias + col));
        _mm_storeu_si128((__m128i *)(out + col), round_to_bf16(sums));
        return;
    }
    float feature[8];
    _mm256_storeu_ps(feature, sums);
    for (int i = 0; i < valid; i++) {
        if (bias)
            feature[i] += bf16_to_float(bias[col + i]);
        out[col + i] = float_to_bf16(feature[i]);
    }
}

/* 8 features' sums as two vectors of 4 features x (even input, odd input) lanes: hadd adds each
 * feature's two lanes (giving features 0, 1, 4, 5, 2, 3, 6, 7), the permute orders them */
static inline __attribute__((always_inline)) void
store_half(__m256 first, __m256 second, const uint16_t *bias, int64_t col, int valid,
           uint16_t *out) {
    store_8(_mm256_castpd_ps(_mm256_permute4x64_pd(
                _mm256_castps_pd(_mm256_hadd_ps(first, second)), 0xd8)),
            bias, col, valid, out);
}

/* 16 features' sums, sums[q] holding features 4q..4q+3 as above */
static inline __attribute__((always_inline)) void
store_block(const __m256 sums[4], const uint16_t *bias, int64_t col, int valid, uint16_t *out) {
    store_half(sums[0], sums[1], bias, col, valid, out);
    if (valid > 8)
        store_half(sums[2], sums[3], bias, col + 8, valid - 8, out);
}

#endif
#endif
