"""A GGUF file of a Hugging Face Hub repository, as Jan's and Cortex's names pick it, downloaded.

The name is read by router/lifecycle/hub_names.py: a file's URL names it, `owner/repo:quant` picks
it by its quantization among the repository's files, Cortex's `repo:tag` is the one GGUF of that
branch of cortexso/repo. The file lands in the Hugging Face cache (hf_hub_download), from where
launcher/pull.py converts it.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from launcher.model_cache import ModelResolutionError
from router.lifecycle.hub_names import HubName, pick_gguf

Progress = Callable[[str, int, int], None]  # (stage, bytes done, bytes total)


def fetch_hub_gguf(name: HubName, revision: str | None, hub_cache: str | None,
                   progress: Progress) -> Path:
    """The path of the GGUF file `name` picks, downloaded into the Hub cache.

    `revision` (the pull's) applies when the name gives none."""
    revision = name.revision or revision
    try:
        from huggingface_hub import HfApi, hf_hub_download

        filename = name.filename
        if filename is None:
            filename = pick_gguf(HfApi().list_repo_files(name.repo_id, revision=revision), name)
        progress("downloading", 0, 0)  # the size is known once the file is there
        path = Path(hf_hub_download(name.repo_id, filename, revision=revision,
                                    cache_dir=hub_cache))
    except ValueError as err:  # pick_gguf: no such quantization, or several files for it
        raise ModelResolutionError(str(err)) from None
    except Exception as err:  # offline, unknown repository or file: the same for a user
        reason = (str(err).strip().splitlines() or [""])[0]
        what = name.filename or (f"its {name.quant} GGUF" if name.quant else "its GGUF file")
        raise ModelResolutionError(
            f"the Hugging Face Hub could not provide {what} of {name.repo_id}"
            f"{f' at {revision}' if revision else ''} ({type(err).__name__}: {reason})") from None
    size = path.stat().st_size
    progress("downloading", size, size)
    return path
