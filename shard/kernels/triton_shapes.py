"""What Triton's attention kernels take, and how a decode step shares a row's blocks among programs.

Host-side and free of Triton: shard.kernels.decode_backend selects with it before Triton is
imported, and shard.kernels.triton_attention sizes its grid with it.
"""
from __future__ import annotations

import functools

import torch

TRITON_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
# Split-K decode (flash-decoding): a row's blocks are shared among programs only while each share
# keeps at least this many tokens (a shorter one costs its partial results' round trip more than
# it saves), and among at most MAX_SPLITS (the combining kernel holds them all at once).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# programs per streaming multiprocessor that keep a GPU's memory busy; off CUDA (Triton's
# interpreter), the multiprocessors assumed
PROGRAMS_PER_SM = 2
DEFAULT_SMS = 132


def decode_splits(batch: int, num_kv_heads: int, max_context: int, programs: int) -> int:
    """How many programs share each row's blocks in Triton's decode attention: 1 for none.

    batch x kv_heads programs, one a row and key/value head, read the cache; where they are
    fewer than `programs` (what keeps the GPU busy), each row's blocks are split so that about
    that many run, no share under MIN_SPLIT_TOKENS of `max_context` (the table's width in tokens),
    at most MAX_SPLITS. Shapes only: a CUDA graph replays its split at every step."""
    busy = batch * num_kv_heads
    if busy >= programs:
        return 1
    return max(1, min(-(-programs // busy), max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """The programs that keep `device` busy: PROGRAMS_PER_SM per multiprocessor (host-side)."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else DEFAULT_SMS)
    return PROGRAMS_PER_SM * sms
