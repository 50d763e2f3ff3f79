"""Which local paths a pull may read: those under the directories the operator allows.

`--allowed-local-model-path` names them; tgi-launcher adds its model cache, the registry and the
model it was started with. The router checks a pull's path before it answers, the launcher again
before it reads a file (launcher/pull.py), with the same rule.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# the one answer to any path outside them, whether it exists, is readable or neither: what a
# caller learns must not depend on what lies outside
REFUSAL = ("`model` names a local path this server may not pull from: a model directory or "
           ".gguf file is pulled only from under the directories its operator allows "
           "(--allowed-local-model-path)")


def is_path_like(source: str) -> bool:
    """Whether `source` can only be a local path (never a short name, a Hub id or a Hub URL)."""
    if source.startswith(("https://", "http://")):  # a GGUF's Hub URL ends in .gguf too
        return False
    return source.startswith(("/", "./", "../", "~")) or source.endswith(".gguf")


def split_paths(text: str | None) -> list[str]:
    """The directories of a comma-separated --allowed-local-model-path, in order."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def _real(path: str | Path) -> Path | None:
    """`path` with `~`, symlinks and '..' resolved; None when it cannot be (a bad `~user`)."""
    try:
        return Path(os.path.realpath(Path(path).expanduser()))
    except (OSError, RuntimeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class LocalRoots:
    """The resolved paths under which (or which exactly) local files may be read."""

    roots: tuple[Path, ...] = ()

    @classmethod
    def of(cls, paths: Iterable[str | Path]) -> LocalRoots:
        return cls(tuple(dict.fromkeys(real for p in paths if (real := _real(p)) is not None)))

    def allows(self, path: str | Path) -> bool:
        """Whether `path`, resolved, is one of the roots or lies under one.

        Compared part by part: /allowed-evil is not under /allowed."""
        real = _real(path)
        return real is not None and any(real == root or root in real.parents
                                        for root in self.roots)

    def as_flag(self) -> str:
        """The roots as --allowed-local-model-path takes them."""
        return ",".join(str(root) for root in self.roots)
