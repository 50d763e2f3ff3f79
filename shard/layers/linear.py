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


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bfloat16 CPU weight, or None where it does not apply.

    F.linear reorders a bf16 weight into that layout on every call; done once at load, decode-size
    matmuls run 1.5-1.8x faster on this machine with the same results. float32 keeps F.linear, whose
    results the parity tests pin to transformers'.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    except (AttributeError, RuntimeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the rows of W (output features) split across ranks.

    Several checkpoint tensors may be fused into one matmul (q/k/v, gate/up): each is split on its own
    and the slices are concatenated, so rank r holds [q_r; k_r; v_r].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed = prepack(weight)

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str], *, bias: bool) -> "ColumnParallelLinear":
        weight = torch.cat([weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes], dim=0)
        bias_t = None
        if bias:
            bias_t = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes], dim=0)
        return cls(weight, bias_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then + b once: W's columns (input features) are split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parallel: ParallelContext):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parallel = parallel
        self.packed = prepack(weight)

    @classmethod
    def load(cls, weights: Weights, prefix: str, *, bias: bool) -> "RowParallelLinear":
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        bias_t = weights.get(f"{prefix}.bias") if bias else None
        return cls(weight, bias_t, weights.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(linear(x, self.weight, None, self.packed), self.parallel)
        if self.bias is not None:
            out = out + self.bias
        return out
