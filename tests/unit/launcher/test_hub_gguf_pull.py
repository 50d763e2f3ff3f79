"""A pull of a Hub GGUF named as Jan and Cortex name it: the right file fetched, then converted."""
import json

import pytest

from launcher.model_cache import ModelResolutionError
from launcher.pull import pull
from tests.unit.launcher.fake_hub import FakeHub
from tests.unit.launcher.tiny_gguf import write_tiny_gguf

REPO = "bartowski/Tiny-GGUF"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A GGUF repository of two quantizations (the same tiny weights) and a README."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for quant in ("Q4_K_M", "Q8_0"):
        write_tiny_gguf(repo / f"Tiny-{quant}.gguf")
    (repo / "README.md").write_text("# Tiny")
    return FakeHub(monkeypatch, repo, tmp_path)


def _progress(stage, done, total):
    pass


@pytest.mark.parametrize("source, picked, revision", [
    (f"{REPO}:q8_0", "Tiny-Q8_0.gguf", None),
    (f"https://huggingface.co/{REPO}/resolve/v1/Tiny-Q4_K_M.gguf", "Tiny-Q4_K_M.gguf", "v1"),
    (f"https://huggingface.co/{REPO}/blob/main/Tiny-Q8_0.gguf", "Tiny-Q8_0.gguf", "main"),
])
def test_the_named_gguf_is_fetched_and_converted(hub, tmp_path, source, picked, revision):
    pulled = pull(source, tmp_path / "registry" / "m", _progress, convert_dtype="float32")
    ((repo_id, filename, kwargs),) = hub.called("hf_hub_download")
    assert (repo_id, filename, kwargs["revision"]) == (REPO, picked, revision)
    assert pulled.format == "gguf"
    assert json.loads((tmp_path / "registry" / "m" / "config.json").read_text())


def test_a_quantization_the_repository_lacks_names_those_it_has(hub, tmp_path):
    with pytest.raises(ModelResolutionError, match="no GGUF file of quantization Q2_K.*Tiny-Q8_0"):
        pull(f"{REPO}:Q2_K", tmp_path / "registry" / "m", _progress)
    assert not (tmp_path / "registry" / "m").exists()


def test_a_repository_url_is_the_hub_id(hub, tmp_path, monkeypatch):
    downloads = []
    monkeypatch.setattr("launcher.pull._download", lambda repo_id, staging, progress, revision,
                        hub_cache: downloads.append((repo_id, revision)) or "")
    monkeypatch.setattr("launcher.pull.check_model_dir", lambda path: path)
    pull(f"https://huggingface.co/{REPO}/tree/v2", tmp_path / "registry" / "m", _progress)
    assert downloads == [(REPO, "v2")]
