"""The random draws of sampling rows: noise keyed by each request's seed and token position.

A row's token is argmax(p / E) over its vocabulary, E ~ Exp(1) (the exponential race). E comes from
a counter-based hash of (seed, position, token id) rather than a generator per request: every row of
a batch draws in one pass of tensor ops, with no Python loop over rows and no generator state to
carry, and a seed gives the same tokens in any batch, on any device, speculating or not (a
speculative step draws each position's noise as a plain step would).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from shard.config import kernel_enabled
from shard.kernels import decode_backend, layer_ops
from shard.noise_hash import MASK, MIX, UNIFORM_BITS, WEYL, mix32

@functools.lru_cache(maxsize=8)
def _token_offsets(vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64: each token id's step along its row's Weyl sequence."""
    return torch.arange(vocab, dtype=torch.int64, device=device) * WEYL & MASK


def exponentials(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """E ~ Exp(1) [rows, vocab] float32 for rows of seed keys and token positions, both [rows] int64.

    The same (key, position, token id) always gives the same value; any other change of one of
    them gives an independent one."""
    rows = mix32(keys ^ (positions & MASK))  # [rows]
    x = rows.unsqueeze(1) + _token_offsets(vocab, keys.device)  # [rows, vocab]
    x.bitwise_and_(MASK)
    for _ in range(2):  # mix32, in place on the large tensor
        x.bitwise_xor_(x >> 16).mul_(MIX).bitwise_and_(MASK)
    x.bitwise_xor_(x >> 16).bitwise_right_shift_(32 - UNIFORM_BITS)
    uniform = (x + 0.5).mul_(2.0 ** -UNIFORM_BITS)  # float32 from the add: no conversion pass
    return uniform.log_().neg_()


def draw(logprobs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
         rows: torch.Tensor | None, greedy_ids: torch.Tensor) -> torch.Tensor:
    """greedy_ids [B] with each sampling row's token: argmax(p / E) over logprobs [B, vocab].

    `keys` and `positions` [B] key each row's noise; `rows`: the sampling rows (None: all). One
    Triton launch on CUDA, else the PyTorch form; nothing is read back to the host."""
    on_cuda = logprobs.is_cuda and not decode_backend.triton_refused()
    triton_form = _triton_form() if on_cuda else None
    if triton_form is not None:
        return triton_form.draw(logprobs, keys, positions, rows, greedy_ids)
    if rows is not None:
        logprobs, keys, positions = (logprobs.index_select(0, rows), keys.index_select(0, rows),
                                     positions.index_select(0, rows))
    drawn = (logprobs.exp() / exponentials(keys, positions, logprobs.shape[1])).argmax(dim=-1)
    return drawn if rows is None else greedy_ids.index_copy(0, rows, drawn)


@functools.cache
def _triton_form() -> ModuleType | None:
    """shard.kernels.triton_sampling, or None (TGI_PY_FUSED_OPS=0, or no Triton)."""
    if not kernel_enabled(layer_ops.ENABLED_ENV):
        return None
    try:
        from shard.kernels import triton_sampling
    except ImportError:  # CPU builds of PyTorch come without Triton
        return None
    return triton_sampling
