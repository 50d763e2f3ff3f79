"""Device tensors read on the host with one wait for the device: what a step's Python side reads.

`.tolist()` of a CUDA tensor waits for the device once per tensor; a step that reads its tokens,
their log-probabilities and maybe their top tokens would wait that many times.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PendingRead:
    """Copies on their way to the host; `wait` gives their values.

    On CUDA the wait is for an event recorded after the copies, not for the stream: work queued
    after them (the next step's forward) runs on while the host reads."""

    copies: list[torch.Tensor | None]
    done: torch.cuda.Event | None = None

    def wait(self) -> list[list | None]:
        if self.done is not None:
            self.done.synchronize()
        return [None if host is None else host.tolist() for host in self.copies]


def start(*tensors: torch.Tensor | None) -> PendingRead:
    """Each tensor's copy to the host begun (None stays None); on the CPU, the tensors as they are."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda":
        return PendingRead(list(tensors))
    copies = _pinned_copies(tensors)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(present[0].device))
    return PendingRead(copies, done)


def read(*tensors: torch.Tensor | None) -> list[list | None]:
    """Each tensor as nested lists (None stays None), in order.

    On CUDA each is copied into pinned host memory without blocking, then the stream is waited
    for once, after the last copy; elsewhere the values are read as they are."""
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda":
        return [None if t is None else t.tolist() for t in tensors]
    copies = _pinned_copies(tensors)
    torch.cuda.current_stream(present[0].device).synchronize()
    return PendingRead(copies).wait()


def _pinned_copies(tensors: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    copies = []
    for tensor in tensors:
        host = None
        if tensor is not None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        copies.append(host)
    return copies
