"""How many bytes the KV pool may take on this device."""
from __future__ import annotations

from pathlib import Path

import torch


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_budget_bytes(device: torch.device, memory_fraction: float, world_size: int = 1) -> int:
    """Bytes this rank's KV pool may take.

    On CUDA, TGI's rule for its --cuda-memory-fraction: what is free less the part of the GPU left
    to others ((1 - memory_fraction) x its total), of which 90% (the rest is for activations). On
    the CPU the memory is shared with the router, the user's programs and the other ranks, which
    size their pools at the same moment from the same free memory: 30% of what is available,
    scaled by memory_fraction, each rank taking its 1/world_size of it.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        usable = available_bytes(device) - (1.0 - memory_fraction) * total
        return int(max(0.0, usable) * 0.9)
    return int(available_bytes(device) * 0.3 * memory_fraction / world_size)
