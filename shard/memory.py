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


def kv_budget_bytes(device: torch.device, memory_fraction: float) -> int:
    # leave room for activations and for everything else on the machine: on the CPU the memory is
    # shared with the router, other shards and the user's programs
    share = 0.9 if device.type == "cuda" else 0.3
    return int(available_bytes(device) * share * memory_fraction)
