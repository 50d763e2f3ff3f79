"""Where prepared models live, and the error every step of resolving a model raises."""
from __future__ import annotations

import os
from pathlib import Path


class ModelResolutionError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where prepared models and downloads live: TGI_PY_CACHE, else ~/.cache/tgi-py."""
    return Path(os.environ.get("TGI_PY_CACHE") or Path.home() / ".cache" / "tgi-py").expanduser()
