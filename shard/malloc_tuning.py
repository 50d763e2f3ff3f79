"""glibc's allocator, tuned for a process that allocates and frees large tensors every step.

Freed memory stays in the process for the next op, where by default a prefill's activations are
mmapped, unmapped and faulted in anew on every op (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

from shard.config import malloc_set_by_hand

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# the largest mmap threshold glibc accepts on 64-bit systems: an op's output up to this size is
# reused from the heap (a long prefill's largest ones stay mmapped, as they were)
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024


def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":  # musl has a mallopt that does nothing
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def return_freed_memory() -> bool:
    """The return of what is free in glibc's heap to the system (malloc_trim); whether it could.

    Called once the model is loaded: the checkpoint's and quantization's temporaries, freed by
    then, would otherwise stay resident under the raised trim threshold (up to 1 GiB)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def keep_freed_memory() -> bool:
    """The raise of glibc's mmap and trim thresholds; whether it did.

    Not glibc, or set by hand: no. The memory kept is at most the largest set of activations the
    process ever held at once."""
    if malloc_set_by_hand():
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
               and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not applied:
        log.warning("glibc refused the allocator settings: large tensors stay mmapped per op")
    return applied
