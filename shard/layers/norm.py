"""RMS normalisation as Llama defines it (computed in float32, scaled in the activations' dtype)."""
from __future__ import annotations

import torch
from torch import nn

from shard.kernels import layer_ops


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        # in the activations' dtype, so the scaling is not a mixed-dtype op
        self.weight = nn.Parameter(weight.to(dtype or weight.dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.rms_norm(x, self.weight, self.eps)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum and its norm in one pass: (norm of x + residual, x + residual).

        A layer's output joins the residual stream and the next step reads it normed."""
        return layer_ops.rms_norm(x, self.weight, self.eps, residual)
