"""The hash sampling's noise is drawn from: 32-bit values mixed, a request's seed folded to a key.

Its PyTorch form (shard.sampling_noise) and its Triton form (shard.kernels.triton_sampling) read
the same constants, so that both give the same noise to the last bit.
"""
from __future__ import annotations

MASK = 0xFFFFFFFF
# The 32-bit integer hash of Thomas Mueller (two rounds of xor-shift and multiply). Its multiplier
# is below 2**31, so a 32-bit value times it stays within int64: PyTorch has no unsigned 32-bit
# arithmetic on every device.
MIX = 0x45D9F3B
WEYL = 0x9E3779B9  # 2**32 / the golden ratio: consecutive token ids land far apart before mixing
UNIFORM_BITS = 23  # u = (k + 0.5) / 2**23 is exact in float32 and never 0 or 1


def mix32(x):
    """The hash of 32-bit values (Python ints or int64 tensors holding them)."""
    x = ((x >> 16) ^ x) * MIX & MASK
    x = ((x >> 16) ^ x) * MIX & MASK
    return (x >> 16) ^ x


def seed_key(seed: int) -> int:
    """A request's 64-bit seed folded into the 32-bit key its draws start from."""
    return mix32((seed & MASK) ^ mix32(seed >> 32 & MASK))
