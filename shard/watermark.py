"""Kirchenbauer et al.'s green-list watermark (arXiv 2301.10226): the previous token seeds a "green list"
of the vocabulary whose logits get +delta, and a z-test on the share of green tokens detects it.
"""
from __future__ import annotations

import math

import torch

GAMMA = 0.5
DELTA = 2.0
_HASH_KEY = 15485863  # a large prime, so that neighbouring token ids give unrelated seeds


def green_list(previous_token: int, vocab_size: int) -> torch.Tensor:
    """Token ids [round(gamma * vocab)] that are green after `previous_token`."""
    generator = torch.Generator().manual_seed(_HASH_KEY * previous_token % (2**63 - 1))
    return torch.randperm(vocab_size, generator=generator)[: round(GAMMA * vocab_size)]


def apply_watermark(scores: torch.Tensor, rows: list[int], previous_tokens: list[int]) -> torch.Tensor:
    """Adds delta to the green logits of each listed row; scores [B, vocab]."""
    bias = torch.zeros_like(scores)
    for row, previous in zip(rows, previous_tokens):
        bias[row, green_list(previous, scores.shape[1]).to(scores.device)] = DELTA
    return scores + bias


def z_score(token_ids: list[int], vocab_size: int, previous_token: int) -> float:
    """How many standard deviations the green-token count sits above chance (> 4: watermarked)."""
    green = 0
    for token in token_ids:
        green += int(bool((green_list(previous_token, vocab_size) == token).any()))
        previous_token = token
    n = len(token_ids)
    return (green - GAMMA * n) / math.sqrt(n * GAMMA * (1 - GAMMA))
