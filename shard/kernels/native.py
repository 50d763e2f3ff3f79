"""C sources of shard/kernels built for this CPU on first use, and loaded with ctypes.

Each library is compiled with the system C compiler for the host CPU and cached by source,
compiler, flags and CPU flags, so a shard builds it once per machine; it shares PyTorch's OpenMP
runtime and thread count. Without a compiler, or when the build fails, the caller logs why and
keeps its PyTorch path.
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

log = logging.getLogger(__name__)

KERNELS = Path(__file__).resolve().parent
# builds the kernels for this -march instead of the host's (e.g. x86-64-v3: as an AVX2-only CPU
# builds them, to run that form on a newer CPU)
MARCH_ENV = "TGI_PY_KERNEL_MARCH"


def cache_dir() -> Path:
    root = os.environ.get("TGI_PY_CACHE") or Path.home() / ".cache" / "tgi-py"
    return Path(root).expanduser() / "kernels"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


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


def load_library(source: Path, flags: list[str], enabled_env: str,
                 fallback: str) -> ctypes.CDLL | None:
    """The compiled library, or None: switched off (`enabled_env`=0), no C compiler, or a failed
    build, the last two logged with `fallback` (what runs instead). `-march=native` in `flags`
    becomes TGI_PY_KERNEL_MARCH's value where that is set."""
    if os.environ.get(enabled_env, "1") == "0":
        return None
    march = os.environ.get(MARCH_ENV)
    if march:
        flags = [f"-march={march}" if flag == "-march=native" else flag for flag in flags]
    name = os.environ.get("CC", "cc")
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
