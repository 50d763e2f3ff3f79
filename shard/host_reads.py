"""Device tensors read on the host with one wait for the device: what a step's Python side reads.

`.tolist()` of a CUDA tensor waits for the device once per tensor; a step that reads its tokens,
their log-probabilities and maybe their top tokens would wait that many times.
"""
from __future__ import annotations

import torch


def read(*tensors: torch.Tensor | None) -> list[list | None]:
    """Each tensor as nested lists (None stays None), in order.

    On CUDA each is copied into pinned host memory without blocking, then the stream is waited
    for once, after the last copy; elsewhere the values are read as they are."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda":
        return [None if t is None else t.tolist() for t in tensors]
    copies = []
    for tensor in tensors:
        host = None
        if tensor is not None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        copies.append(host)
    torch.cuda.current_stream(present[0].device).synchronize()
    return [None if host is None else host.tolist() for host in copies]
