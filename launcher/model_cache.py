"""Where prepared models live, and the error every step of resolving a model raises."""
from __future__ import annotations

from shard.config import cache_root


class ModelResolutionError(RuntimeError):
    pass


__all__ = ["ModelResolutionError", "cache_root"]
