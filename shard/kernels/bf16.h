/* bf16 <-> float32 for the C kernels: a bf16 is the top 16 bits of a float32. */
#ifndef TGI_PY_BF16_H
#define TGI_PY_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* to nearest, ties to even, as PyTorch rounds; a NaN stays a (quiet) NaN */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#endif
