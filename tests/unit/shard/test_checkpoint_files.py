"""The loader reads the checkpoint only: the files its index names, else model.safetensors, else
every *.safetensors; a stray consolidated.safetensors beside HF shards is never opened."""
import json

import pytest
import torch
from safetensors.torch import save_file

from shard import weights as weights_module
from shard.checkpoint_files import INDEX_NAME, CheckpointError, checkpoint_files
from shard.distributed import ParallelContext
from shard.weights import Weights

TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4),
           "c.weight": torch.full((2, 2), 3.0)}


def _write(model_dir, layout: dict[str, list[str]], *, index: bool) -> None:
    model_dir.mkdir(exist_ok=True)
    for file_name, names in layout.items():
        save_file({n: TENSORS[n] for n in names}, model_dir / file_name)
    if index:
        weight_map = {n: f for f, names in layout.items() for n in names
                      if f != "consolidated.safetensors"}
        (model_dir / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The file names the loader opens, in order."""
    names = []
    real = weights_module.safe_open

    def safe_open(path, **kwargs):
        names.append(path.rsplit("/", 1)[-1])
        return real(path, **kwargs)

    monkeypatch.setattr(weights_module, "safe_open", safe_open)
    return names


def _load(model_dir) -> Weights:
    return Weights(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                   parallel=ParallelContext())


def test_the_index_names_the_files_and_a_consolidated_copy_is_not_opened(tmp_path, opened):
    _write(tmp_path, {"model-00001-of-00002.safetensors": ["a.weight"],
                      "model-00002-of-00002.safetensors": ["b.weight", "c.weight"],
                      "consolidated.safetensors": ["a.weight", "b.weight", "c.weight"]},
           index=True)
    loaded = _load(tmp_path)
    assert opened == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, tensor in TENSORS.items():
        assert torch.equal(loaded.get(name), tensor)


def test_without_an_index_model_safetensors_alone(tmp_path, opened):
    _write(tmp_path, {"model.safetensors": list(TENSORS),
                      "consolidated.safetensors": list(TENSORS)}, index=False)
    _load(tmp_path)
    assert opened == ["model.safetensors"]


def test_with_neither_every_safetensors_file(tmp_path, opened):
    _write(tmp_path, {"part-b.safetensors": ["b.weight", "c.weight"],
                      "part-a.safetensors": ["a.weight"]}, index=False)
    assert _load(tmp_path).has("c.weight")
    assert opened == ["part-a.safetensors", "part-b.safetensors"]


def test_a_file_the_index_names_that_is_missing_is_named(tmp_path):
    _write(tmp_path, {"model-00001-of-00002.safetensors": ["a.weight"],
                      "model-00002-of-00002.safetensors": ["b.weight"]}, index=True)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lacks model-00002-of-00002\.safetensors, named by "
                                              r"model\.safetensors\.index\.json"):
        _load(tmp_path)


@pytest.mark.parametrize("index, error", [
    ({"weight_map": {"a.weight": "../elsewhere.safetensors"}}, "not a file beside it"),
    ({"weight_map": {}}, "maps no tensor"),
    ({"weights": {}}, "not a safetensors index"),
    ([], "not a safetensors index"),
])
def test_an_index_that_is_not_one_is_refused(tmp_path, index, error):
    save_file(TENSORS, tmp_path / "model.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=error):
        checkpoint_files(tmp_path)


def test_a_directory_without_weights_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        checkpoint_files(tmp_path)
