/* A bf16 row rounded to int8 a group, as llama.cpp rounds its activations, for the integer dot
 * products of int4_matmul.c and int8_matmul.c: the form every AVX-512 VNNI and AVX2 build of the
 * two kernels multiplies by, so both compute the same integer sums. */
#ifndef TGI_PY_INT8_ROWS_H
#define TGI_PY_INT8_ROWS_H

#include <stdint.h>

#include "bf16.h"

/* a row [k] of bf16 -> its int8 form (xq [k]: each group's inputs as multiples of d, its largest
 * magnitude / 127, rounded to nearest, ties to even), each group's d and the sum of its inputs as
 * rounded, d x (sum of xq) ([k / group]): with that sum a low's term, too, multiplies the rounded
 * inputs, so the result is the weights times the rounded inputs (half the error, at most, of the
 * exact sum beside q's term: q * scale spans twice what a centred weight does). A group of up to
 * 32 inputs. Each input's multiple of d is its product by 127 / largest in float64 (int8_matmul.c's
 * AVX-512 rounding), or with `float_products`, where that quotient is a float, the product in
 * float32 by the quotient rounded to a float (int4_matmul.c's): the two differ at near-ties. */
static inline void quantize_row_int8_scalar(const uint16_t *x, int64_t k, int group, int8_t *xq,
                                            float *x_scales, float *x_sums, int float_products) {
    for (int64_t g = 0; g < k / group; g++) {
        float values[32], largest = 0.0f;
        int finite = 1;
        for (int i = 0; i < group; i++) {
            values[i] = bf16_to_float(x[g * group + i]);
            const float magnitude = values[i] < 0 ? -values[i] : values[i];
            finite &= magnitude <= 3.4e38f; /* false for infinities and NaNs */
            largest = magnitude > largest ? magnitude : largest;
        }
        /* in double: 127 / largest overflows a float for the smallest subnormals */
        const int usable = finite && largest > 0.0f;
        const double inverse = usable ? 127.0 / largest : 0.0;
        const int single = float_products && largest >= 127.0f / 3.4e38f;
        int32_t total = 0;
        for (int i = 0; i < group; i++) {
            const double product = single ? (double)(values[i] * (float)inverse)
                                          : values[i] * inverse;
            const int8_t value = usable ? (int8_t)__builtin_nearbyint(product) : 0;
            xq[g * group + i] = value;
            total += value;
        }
        const float d = largest / 127.0f;
        /* a group with an infinity or a NaN gives NaNs, as a float32 product would */
        x_scales[g] = finite ? d : __builtin_nanf("");
        x_sums[g] = finite ? d * (float)total : __builtin_nanf("");
    }
}

#endif
