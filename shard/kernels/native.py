"""C sources of shard/kernels built for this CPU on first use, and loaded with ctypes.

Builds are cached by source, compiler, flags and CPU flags: once per machine. Without a compiler,
or when a build fails, the caller logs why and keeps its PyTorch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shard.config import (c_compiler, cache_root, cpu_flags, kernel_enabled,
                          kernel_march)

log = logging.getLogger(__name__)

KERNELS = Path(__file__).resolve().parent


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _build(source: Path, compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    # the headers next to the sources are part of every build (a changed one rebuilds them all)
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, version.encode(),
                                     " ".join(flags).encode(), cpu_flags().encode()]
                                    )).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # every shard may build at once: each writes its own file and renames it into place
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], capture_output=True,
                       text=True, check=True)
        os.replace(built, target)
    return target


def build_flags(flags: list[str]) -> list[str]:
    """`flags` as TGI_PY_KERNEL_MARCH asks.

    `-march=native` becomes its first word, and its further words follow the flags
    (`native -mno-avx512vnni`: this CPU less one extension)."""
    words = (kernel_march() or "").split()
    if not words:
        return flags
    return [f"-march={words[0]}" if flag == "-march=native" else flag for flag in flags] + words[1:]


def load_library(source: Path, flags: list[str], enabled_env: str,
                 fallback: str) -> ctypes.CDLL | None:
    """The compiled library, or None: switched off, no C compiler, or a failed build.

    Switched off is `enabled_env`=0; the last two are logged with `fallback` (what runs instead).
    The flags go through build_flags."""
    if not kernel_enabled(enabled_env):
        return None
    flags = build_flags(flags)
    name = c_compiler()
    compiler = shutil.which(name)
    if compiler is None:
        log.warning("no C compiler (%s): %s", name, fallback)
        return None
    try:
        return ctypes.CDLL(str(_build(source, compiler, flags)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = str(getattr(err, "stderr", "") or err).strip()[:500]
        log.warning("%s did not build (%s): %s", source.name, detail, fallback)
        return None
