"""Tensor-parallel process group: who this rank is, and the collectives the layers call."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveFailed(RuntimeError):
    """A collective between the ranks failed: a peer died, or stalled past the group's timeout.

    The process group is then closed for good (gloo answers every later call with "Application
    timeout caused pair closure"), so only a new group of processes recovers."""


def _collective(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise  # fails its batch, as an out-of-memory elsewhere in the step does
    except RuntimeError as err:
        raise CollectiveFailed(f"{getattr(call, '__name__', 'collective')}: {err}") from err


@dataclass(slots=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: object | None = None

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1


def init_parallel(*, rank: int, world_size: int, master_addr: str, master_port: int,
                  device: torch.device) -> ParallelContext:
    """Joins the process group; a world of one needs none and gets a context without collectives."""
    if world_size == 1:
        return ParallelContext()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives run on the current device
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    return ParallelContext(rank=rank, world_size=world_size, group=dist.group.WORLD)


def all_gather_strings(value: str, ctx: ParallelContext) -> list[str]:
    """Every rank's `value`, in rank order."""
    if not ctx.is_sharded:
        return [value]
    out: list = [None] * ctx.world_size
    _collective(dist.all_gather_object, out, value, group=ctx.group)
    return out


def all_reduce(tensor: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.is_sharded:
        _collective(dist.all_reduce, tensor, group=ctx.group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if not ctx.is_sharded:
        return tensor
    # into one buffer, the ranks' parts one after another along the first dimension (the form
    # gloo takes too), rather than a list of parts: no list to flatten and copy back inside a
    # CUDA graph's capture, as TGI gathers its logits
    shape = tensor.shape
    gathered = tensor.new_empty((ctx.world_size * shape[0], *shape[1:]))
    _collective(_gather_single, gathered, tensor.contiguous(), group=ctx.group)
    return gathered.view(ctx.world_size, *shape).movedim(0, -2).reshape(
        *shape[:-1], ctx.world_size * shape[-1])


# torch 2.13 names it all_gather_single, and deprecates the older name
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
