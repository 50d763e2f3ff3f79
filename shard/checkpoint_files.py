"""Which safetensors files of a model directory are its checkpoint.

Hub repositories often ship the same weights twice: Hugging Face shards named by
`model.safetensors.index.json` and a `consolidated.safetensors` for another runtime (Mistral's).
Loading every `*.safetensors` found would read both (twice the memory, and names that clash), so the
index decides when there is one, then the single `model.safetensors`, and only a directory with
neither (a hand-made one, like the tests') is taken whole. The launcher downloads by the same rule.
No torch here: the launcher imports this without the shard's dependencies.
"""
from __future__ import annotations

import json
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(FileNotFoundError):
    pass


def index_files(index_path: Path) -> list[str]:
    """The file names a safetensors index maps its tensors to, sorted, each once."""
    try:
        weight_map = json.loads(Path(index_path).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index_path} is not a safetensors index (a weight_map of tensor "
                              f"name -> file): {type(err).__name__}: {err}") from None
    if not names:
        raise CheckpointError(f"{index_path} maps no tensor to a file")
    for name in names:
        # a file name beside the index, never a path out of the model directory
        if not isinstance(name, str) or not name or Path(name).name != name:
            raise CheckpointError(f"{index_path} names {name!r}, not a file beside it")
    return names


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The index's files (each must exist), else model.safetensors, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        files = [model_dir / name for name in index_files(index)]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir} lacks {', '.join(missing)}, named by {INDEX_NAME}")
        return files
    if (model_dir / SINGLE_NAME).is_file():
        return [model_dir / SINGLE_NAME]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir}")
    return files
