"""Which files of a Hugging Face Hub repository make its checkpoint.

A repository may hold the same weights twice (the HF shards and a `consolidated.safetensors`, as
Mistral's do): only the files `model.safetensors.index.json` names are downloaded, else the single
`model.safetensors`, and only a repository with neither gets every top-level `*.safetensors`. The
shard's loader applies the same rule to the directory (shard/checkpoint_files.py).
"""
from __future__ import annotations

from pathlib import Path

from shard.checkpoint_files import INDEX_NAME, SINGLE_NAME, index_files

# config, generation config, tokenizer and chat template files: everything but the weights
MODEL_FILE_PATTERNS = ["*.json", "*.jinja", "tokenizer*"]


def weight_files(repo_id: str, revision: str | None, hub_cache: str | None) -> list[str]:
    """The checkpoint's weight files (and its index), as allow_patterns for snapshot_download.

    The index is fetched first (hf_hub_download: kept in the Hub cache like any file). Offline or
    with the Hub unreachable and no index cached, the cached snapshot is all there is: every
    *.safetensors of it is allowed and the shard's loader picks the checkpoint out of them."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    try:
        index = hf_hub_download(repo_id, INDEX_NAME, revision=revision, cache_dir=hub_cache)
    except RemoteEntryNotFoundError:  # the repository has no index
        return single_file_checkpoint(HfApi().list_repo_files(repo_id, revision=revision))
    except EntryNotFoundError:  # offline: not cached, or cached as missing
        return ["*.safetensors"]
    return [INDEX_NAME, *index_files(Path(index))]


def single_file_checkpoint(repo_files: list[str]) -> list[str]:
    """Without an index: model.safetensors, else every top-level *.safetensors listed."""
    if SINGLE_NAME in repo_files:
        return [SINGLE_NAME]
    return sorted(name for name in repo_files if name.endswith(".safetensors") and "/" not in name)


def allow_patterns(weights: list[str]) -> list[str]:
    return [*MODEL_FILE_PATTERNS, *weights]
