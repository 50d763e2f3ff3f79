"""Kirchenbauer et al.'s green-list watermark (arXiv 2301.10226).

The previous token seeds a "green list" of the vocabulary whose logits get +delta, and a z-test on
the share of green tokens detects it.

gamma (the green share) and delta are the shard's, set once at start (`configure`, from the
launcher's --watermark-gamma/--watermark-delta, TGI's flags): a detector must use the same gamma.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GAMMA = 0.5
DELTA = 2.0
_HASH_KEY = 15485863  # a large prime, so that neighbouring token ids give unrelated seeds


@dataclass(frozen=True, slots=True)
class WatermarkSettings:
    gamma: float = GAMMA  # share of the vocabulary on each green list
    delta: float = DELTA  # added to each green logit


# the process's settings: one shard serves one watermark
_settings = WatermarkSettings()


def configure(settings: WatermarkSettings) -> None:
    global _settings
    _settings = settings


def current() -> WatermarkSettings:
    return _settings


def green_list(previous_token: int, vocab_size: int,
               settings: WatermarkSettings | None = None) -> torch.Tensor:
    """Token ids [round(gamma * vocab)] that are green after `previous_token`."""
    gamma = (settings or _settings).gamma
    generator = torch.Generator().manual_seed(_HASH_KEY * previous_token % (2**63 - 1))
    return torch.randperm(vocab_size, generator=generator)[: round(gamma * vocab_size)]


def apply_watermark(scores: torch.Tensor, rows: list[int], previous_tokens: list[int],
                    settings: WatermarkSettings | None = None) -> torch.Tensor:
    """Adds delta to the green logits of each listed row; scores [B, vocab]."""
    settings = settings or _settings
    bias = torch.zeros_like(scores)
    for row, previous in zip(rows, previous_tokens):
        bias[row, green_list(previous, scores.shape[1], settings).to(scores.device)] = \
            settings.delta
    return scores + bias


def z_score(token_ids: list[int], vocab_size: int, previous_token: int,
            settings: WatermarkSettings | None = None) -> float:
    """How many standard deviations the green-token count sits above chance (> 4: watermarked)."""
    settings = settings or _settings
    gamma = settings.gamma
    green = 0
    for token in token_ids:
        green += int(bool((green_list(previous_token, vocab_size, settings) == token).any()))
        previous_token = token
    n = len(token_ids)
    return (green - gamma * n) / math.sqrt(n * gamma * (1 - gamma))
