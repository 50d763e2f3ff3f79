"""The KV pool: blocks' layout, allocation, and how many bytes (and blocks) it may take here."""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shard.config import kv_ledger_dir
from shard.layers.attention_state import LayerCache


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's (activations'), and the cache's unless int8
    device: torch.device
    # keys and values as int8 with a float32 scale per (token, kv head) (shard.layers.kv_int8;
    # --kv-cache-dtype int8): a row of d values takes d + 4 bytes, not d * dtype.itemsize
    int8: bool = False

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.int8 if self.int8 else self.dtype

    @property
    def bytes_per_block(self) -> int:
        row = self.head_dim + 4 if self.int8 else self.head_dim * self.dtype.itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int) -> list[LayerCache]:
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    if not spec.int8:
        return [LayerCache(zeroed(shape, spec.dtype, spec.device),
                           zeroed(shape, spec.dtype, spec.device))
                for _ in range(spec.num_layers)]
    scales = shape[:3]
    return [LayerCache(zeroed(shape, torch.int8, spec.device),
                       zeroed(shape, torch.int8, spec.device),
                       key_scale=zeroed(scales, torch.float32, spec.device),
                       value_scale=zeroed(scales, torch.float32, spec.device))
            for _ in range(spec.num_layers)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros whose memory, on the CPU, is taken as it is first written.

    There it is an anonymous mapping, which the kernel fills with zeros page by page: a pool sized
    for the most the server may hold (30% of the available memory by default) takes memory as its
    blocks are used, where torch.zeros would write, and keep resident, every page at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # keeps `pages` alive


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


@dataclass(frozen=True, slots=True)
class PoolLedger:
    """Where shards on one machine write down the CPU KV pools they hold.

    A pool is mapped, not written, at start (zeroed): its pages count as used only once its blocks
    are first written, so a second model sizing its pool from the free memory would count the first
    one's pool as free, and several busy models could together outgrow the RAM. Each shard takes the
    others' pools off what is free before taking its share."""

    directory: Path
    group: str  # the shard group (its socket prefix): its own ranks size together, not after

    @classmethod
    def from_environment(cls, group: str) -> "PoolLedger | None":
        """The ledger the launcher named, or None for a shard started alone.

        The ledger is a directory, one file per shard process: "<pid> <group> <bytes>"."""
        directory = kv_ledger_dir()
        return cls(directory, group) if directory else None

    def held_by_others(self) -> int:
        """Bytes of the pools of live shard processes of other groups."""
        total = 0
        for entry in self.directory.glob("*"):
            if entry.suffix:  # an entry being written (record's staged file)
                continue
            try:
                pid, group, size = entry.read_text().split()
                if group == self.group:
                    continue
                if _alive(int(pid)):
                    total += int(size)
                else:
                    entry.unlink(missing_ok=True)  # its process is gone, and its pool with it
            except (OSError, ValueError):
                continue  # not an entry
        return total

    def record(self, size: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / str(os.getpid())
        staged = path.with_suffix(".new")
        staged.write_text(f"{os.getpid()} {self.group} {size}")
        staged.replace(path)  # a reader sees the whole entry or none


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True


def kv_budget_bytes(device: torch.device, memory_fraction: float, world_size: int = 1,
                    held_by_others: int = 0) -> int:
    """Bytes this rank's KV pool may take.

    On CUDA, 90% (the rest is for activations) of what this process may still take: the free
    memory, and no more than its share of the GPU (memory_fraction x its total) less what it holds
    already (its weights, its warm-up's activations). Alone on a GPU that is TGI's rule for its
    --cuda-memory-fraction (free - (1 - fraction) x total), give or take the CUDA context; with
    several models on one GPU each stays within its share, where TGI's rule counted the other
    model's share as taken and gave the second model nothing (two at 0.5), or let the first take
    what the second's weights then needed (two at 1). On
    the CPU the memory is shared with the router, the user's programs and the other ranks, which
    size their pools at the same moment from the same free memory: 30% of what is available,
    scaled by memory_fraction, each rank taking its 1/world_size of it, after taking off what
    other shard groups' pools hold (`held_by_others`, from a PoolLedger).
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share_left = memory_fraction * total - torch.cuda.memory_reserved(device)
        return int(max(0.0, min(available_bytes(device), share_left)) * 0.9)
    free = max(0, available_bytes(device) - held_by_others)
    return int(free * 0.3 * memory_fraction / world_size)


def budget_blocks(device: torch.device, memory_fraction: float, world_size: int,
                  bytes_per_block: int, ledger: PoolLedger | None = None) -> int:
    """The number of KV blocks this rank's pool may hold.

    After the pools other shard groups hold (`ledger`, on the CPU)."""
    others = ledger.held_by_others() if ledger is not None else 0
    budget = kv_budget_bytes(device, memory_fraction, world_size, held_by_others=others)
    return budget // bytes_per_block
