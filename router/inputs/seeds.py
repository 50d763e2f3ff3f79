"""Sampling seeds: drawn when none is given, and one per copy of a request.

Sampling seeds: a request the client gave no seed draws its own, and each of n copies of a
request (OpenAI's `n`, best_of, SGLang's `n`) samples with a seed of its own.
"""
from __future__ import annotations

import random
from dataclasses import replace

from router.schemas import GenerateRequest

SEEDS = 2**64  # the shards' seed is a uint64


def draw_seed() -> int:
    return random.getrandbits(64)


def seed_or_draw(seed: int | None) -> int:
    """The client's seed, or a fresh draw when it gave none."""
    return seed if seed is not None else draw_seed()


def copies(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """n copies of `request`, each with a seed of its own.

    The i-th is seeded with its seed + i: sampled copies differ, and a client's seed reproduces
    every one of them."""
    return [request] + [replace(request, sampling=replace(request.sampling,
                                                          seed=(request.sampling.seed + i) % SEEDS))
                        for i in range(1, n)]
