"""An encoder's `--quantize int8`: fbgemm's int8 matmuls, the activations rounded at each call.

An encoder only runs prompt-sized batches, whose float32 matmuls are bound by arithmetic, not by
reading weights: int8 weights alone (the decoders' form) make them no faster. fbgemm's dynamic
quantized linear multiplies int8 by int8 instead (VNNI's dot products where the CPU has them):
the weight held as int8 with a scale per output feature, packed once at load, and the
activations rounded to uint8 at every call, one scale and zero point for the whole call, found
as they come. all-MiniLM-L6-v2's layers over 4,096 rows ran 1.4-2.4x faster so than in oneDNN's
float32, its forward 1.65x (benchmarks/RESULTS.md).

One scale for a whole call is the error: BERT's [CLS] row (and a few others) carries values up to
3-10x the median row's largest (28 against 4 at the feed-forward's input, in one feature), which
would set the step every row is rounded to. Rows whose largest magnitude is over OUTLIER_FACTOR
times the median row's are multiplied in a call of their own, so the others keep a step their own
size: on 40 English sentences the least cosine to float32 embeddings rose from 0.9886 to 0.9968.
"""
from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch

from shard.config import cpu_flags

log = logging.getLogger(__name__)

# what shard.layers.linear takes as a quantize kind for this form (an encoder's --quantize int8)
KIND = "int8-dynamic"
# a row this many times the median row's largest magnitude gets a call of its own: on
# all-MiniLM-L6-v2, 2 split off 3% of the rows of 128-token texts (each text's [CLS] and a few
# others) and gave the best cosine of 1.25, 1.5, 2 and 3
OUTLIER_FACTOR = 2.0
# PyTorch's quantized engines that hold fbgemm's kernels (x86 builds)
_ENGINES = ("x86", "fbgemm")


@dataclass(slots=True)
class DynamicInt8:
    packed: torch.ScriptObject  # fbgemm's packed weight: int8 [out, in], its scales and the bias
    out_features: int


def engine_refusal() -> str | None:
    """Why fbgemm's int8 matmul cannot run in this process, or None."""
    engine = torch.backends.quantized.engine
    if engine not in _ENGINES:
        return (f"--quantize int8 multiplies an encoder by fbgemm's int8 kernels, which this "
                f"PyTorch does not run (its quantized engine is {engine!r}, not x86 or fbgemm: "
                f"a build for another CPU); serve the encoder without --quantize")
    try:
        linear(torch.ones(2, 4), pack(torch.ones(3, 4), torch.zeros(3)))
    except (RuntimeError, AttributeError) as err:  # a build without the kernels, or they moved
        return (f"--quantize int8 multiplies an encoder by fbgemm's int8 kernels, which failed "
                f"here ({err}); serve the encoder without --quantize")
    return None


def encoder_quantize(quantize: str | None) -> str | None:
    """The linear layers' form of an encoder loaded with --quantize `quantize`.

    int8: this module's (KIND), or a ValueError saying why it cannot run here. Other kinds as a
    decoder's."""
    if quantize != "int8":
        return quantize
    refusal = engine_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    log.info("int8 encoder: fbgemm's int8 matmuls (activations rounded per call%s)",
             "" if _full_range() else ", to 7 bits: this CPU has no AVX-512 VNNI")
    return KIND


@functools.cache
def _full_range() -> bool:
    """Whether activations take all 8 bits: on AVX-512 VNNI's dot products.

    Without it fbgemm sums pairs of products in 16 bits, which 8-bit activations can overflow:
    they are rounded to 7 bits there, as PyTorch's own dynamic quantization does on x86."""
    return "avx512_vnni" in cpu_flags().split()


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> DynamicInt8:
    """weight [out, in] as int8 with a scale per output feature (max |w| / 127), and the bias."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    with warnings.catch_warnings():
        # quantized tensors are deprecated; fbgemm's prepack takes no other form, and the
        # tensor lives only for this call (what is kept is fbgemm's packed weight)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
        q = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long),
                                       0, torch.qint8)
    bias = None if bias is None else bias.float().contiguous()
    return DynamicInt8(torch.ops.quantized.linear_prepack(q, bias), weight.shape[0])


def linear(x: torch.Tensor, w: DynamicInt8) -> torch.Tensor:
    """x [..., in] -> x W^T + b [..., out] in x's dtype, outlier rows multiplied on their own.

    Their rows of x are zeroed for the main call and put back after it (x is the caller's, and
    unchanged when this returns): a copy of x would cost a pass over it per call."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows.float().contiguous() if rows.dtype != torch.float32 else rows.contiguous()
    peaks = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
    outliers = (peaks > OUTLIER_FACTOR * peaks.median()).nonzero().squeeze(1)
    if len(outliers) == 0:
        out = _matmul(rows, w)
    else:
        kept = rows.index_select(0, outliers)
        rows.index_fill_(0, outliers, 0.0)
        try:
            out = _matmul(rows, w)
        finally:
            rows.index_copy_(0, outliers, kept)
        out.index_copy_(0, outliers, _matmul(kept, w))
    return out.reshape(*x.shape[:-1], w.out_features).to(x.dtype)


def _matmul(rows: torch.Tensor, w: DynamicInt8) -> torch.Tensor:
    # reduce_range: the activations in 7 bits where 8 could overflow (_full_range)
    return torch.ops.quantized.linear_dynamic(rows, w.packed, not _full_range())
