"""Linear layers that know which slice of a checkpoint tensor belongs to this rank.

Column-parallel layers split the output features and need no communication; row-parallel layers split
the input features and sum the partial products across ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import ParallelContext, all_reduce
from shard.weights import Weights


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the rows of W (output features) split across ranks.

    Several checkpoint tensors may be fused into one matmul (q/k/v, gate/up): each is split on its own
    and the slices are concatenated, so rank r holds [q_r; k_r; v_r].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str], *, bias: bool) -> "ColumnParallelLinear":
        weight = torch.cat([weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes], dim=0)
        bias_t = None
        if bias:
            bias_t = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes], dim=0)
        return cls(weight, bias_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b once: W's columns (input features) are split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parallel: ParallelContext):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parallel = parallel

    @classmethod
    def load(cls, weights: Weights, prefix: str, *, bias: bool) -> "RowParallelLinear":
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        bias_t = weights.get(f"{prefix}.bias") if bias else None
        return cls(weight, bias_t, weights.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.parallel)
        if self.bias is not None:
            out = out + self.bias
        return out
