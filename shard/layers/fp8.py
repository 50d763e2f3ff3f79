"""float8 (e4m3) weights with a scale per output channel, quantized as they load: `--quantize fp8`.

A weight row w is stored as q = w / s in float8 e4m3 with s = max|w| / 448 and stands for q * s.
At each matmul the activations are quantized the same way row by row (a scale per token, found
as they come, as vLLM's and TGI's dynamic fp8 do), and the product of the two float8 operands is
rescaled by both scales. On CUDA GPUs with float8 tensor cores and row-wise scaling (Hopper:
compute capability 9.0 and later) that matmul is torch._scaled_mm on bf16 activations; elsewhere
the same arithmetic runs dequantized, float8 values widened to float32 (exact) and multiplied
there, so the CPU gives the answers the card computes, up to the order of the sums.
"""
from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# torch._scaled_mm wants the inner and output sides in multiples of 16
SIDE = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in float8 e4m3 with a float32 scale each: x [rows, n] -> (float8 [rows, n], [rows]).

    Rounded to nearest (PyTorch's cast); a zero row gets a tiny scale and zeros."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (wide / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def can_quantize(weight: torch.Tensor) -> bool:
    """Whether the scaled matmul takes this weight's shape (both sides multiples of 16)."""
    return weight.dim() == 2 and weight.shape[0] % SIDE == 0 and weight.shape[1] % SIDE == 0


@functools.cache
def scaled_mm_runs(device: torch.device) -> bool:
    """Whether torch._scaled_mm multiplies float8 with row-wise scales on `device` (Hopper on)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the float8 weight (data [out, in], scales [out]) -> [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_rows(rows)
    if x.dtype == torch.bfloat16 and scaled_mm_runs(x.device):
        # the weight transposed is column-major, as the kernel takes its second operand
        out = torch._scaled_mm(x_q, data.t(), scale_a=x_scale.unsqueeze(1),
                               scale_b=scales.unsqueeze(0), out_dtype=torch.bfloat16)
    else:
        out = (x_q.float() @ data.float().t()) * x_scale.unsqueeze(1) * scales.unsqueeze(0)
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], data.shape[0])


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] the form stands for."""
    return data.float() * scales.unsqueeze(1)
