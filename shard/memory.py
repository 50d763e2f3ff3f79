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

    Leaves room for activations and everything else: on the CPU the memory is shared with the
    router, the user's programs and the other ranks, which size their pools at the same moment
    from the same free memory, so each takes its 1/world_size of the share.
    """
    if device.type == "cuda":
        return int(available_bytes(device) * 0.9 * memory_fraction)
    return int(available_bytes(device) * 0.3 * memory_fraction / world_size)
