"""Which GPUs a shard group's ranks run on, and how many ranks --sharded asks for.

Several models served at once spread over the GPUs the launcher sees, the least used first,
instead of all starting at GPU 0.
"""
from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import takewhile


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this launcher may use, as CUDA_VISIBLE_DEVICES entries.

    That variable's own when set (up to a "-1", past which CUDA sees none), else every GPU
    `nvidia-smi -L` lists by index; none without the driver.
    """
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return list(takewhile(lambda gpu: gpu != "-1",
                              (gpu.strip() for gpu in listed.split(",") if gpu.strip())))
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if found.returncode != 0:
        return []
    gpus = [line for line in found.stdout.splitlines() if line.startswith("GPU ")]
    return [str(index) for index in range(len(gpus))]


def pick_gpus(gpus: list[str], in_use: Iterable[str], count: int) -> tuple[str, ...]:
    """`count` distinct GPUs of `gpus` holding the fewest ranks of other groups.

    `in_use`: one entry per rank. The first listed wins a tie; the result is in listed order.
    """
    if count > len(gpus):
        raise ValueError(f"{count} shard(s) on CUDA need as many GPUs: {len(gpus)} visible")
    load = Counter(in_use)
    chosen = sorted(range(len(gpus)), key=lambda index: (load[gpus[index]], index))[:count]
    return tuple(gpus[index] for index in sorted(chosen))


def shard_count(sharded: str | None, num_shard: int | None, device: str) -> int:
    """--num-shard as TGI resolves it with --sharded.

    Except that without either it is 1 (TGI takes every visible GPU).
    """
    sharded = (sharded or "").lower()
    if sharded not in ("", "true", "false"):
        raise ValueError(f"--sharded {sharded!r} must be true or false")
    if sharded != "true":
        return 1 if num_shard is None else num_shard
    if num_shard is not None:
        if num_shard <= 1:
            raise ValueError(f"--sharded true with --num-shard {num_shard}: a sharded model "
                             "needs at least 2 shards")
        return num_shard
    gpus = [] if device == "cpu" else visible_gpus(os.environ)
    if len(gpus) < 2:
        where = ("this launcher serves on the CPU (--device cpu)" if device == "cpu"
                 else f"{len(gpus)} GPU(s) are visible")
        raise ValueError(f"--sharded true without --num-shard splits the model over every "
                         f"visible GPU, and {where}. On the CPU give --num-shard N instead: N "
                         "processes then share the cores, each holding 1/N of the weights.")
    return len(gpus)
