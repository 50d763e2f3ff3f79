"""RMS normalisation as Llama defines it (computed in float32, scaled in the activations' dtype)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        # in the activations' dtype, so the scaling is not a mixed-dtype op
        self.weight = nn.Parameter(weight.to(dtype or weight.dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
