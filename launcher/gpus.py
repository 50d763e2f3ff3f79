"""Which GPUs a shard group's ranks run on.

Several models served at once spread over the GPUs the launcher sees, the least used first,
instead of all starting at GPU 0."""
from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import takewhile


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this launcher may use, as CUDA_VISIBLE_DEVICES entries.

    That variable's own when set (up to a "-1", past which CUDA sees none), else every GPU
    `nvidia-smi -L` lists by index; none without the driver."""
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
    """`count` distinct GPUs of `gpus` holding the fewest ranks of other groups, in listed order.

    `in_use` has one entry per rank; the first listed wins a tie."""
    if count > len(gpus):
        raise ValueError(f"{count} shard(s) on CUDA need as many GPUs: {len(gpus)} visible")
    load = Counter(in_use)
    chosen = sorted(range(len(gpus)), key=lambda index: (load[gpus[index]], index))[:count]
    return tuple(gpus[index] for index in sorted(chosen))
