"""Local pulls only under the directories the operator allows: the path check (symlinks, '..',
prefixes), the launcher's pull refusing before it looks, and the roots the launcher derives."""
import os
import shutil

import pytest

from launcher.config import parse_args
from launcher.local_roots import pull_roots
from launcher.model_cache import ModelResolutionError, cache_root
from launcher.pull import pull
from router.lifecycle.local_paths import REFUSAL, LocalRoots


def _progress(stage, done, total):
    pass


def test_a_path_is_allowed_once_resolved_and_only_part_by_part(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "model").mkdir(parents=True)
    (tmp_path / "allowed-evil").mkdir()
    (allowed / "out").symlink_to(tmp_path / "allowed-evil")
    (tmp_path / "in").symlink_to(allowed / "model")
    roots = LocalRoots.of([allowed])
    for path in (allowed, allowed / "model", allowed / "model" / "missing", tmp_path / "in",
                 tmp_path / "allowed-evil" / ".." / "allowed" / "model"):
        assert roots.allows(path), path
    for path in (tmp_path / "allowed-evil", str(allowed) + "-evil", allowed / "out",
                 allowed / "out" / "x", allowed / ".." / "allowed-evil", allowed / "model" / ".."
                 / "..", tmp_path, "/", "/etc/passwd", "~root", "~no-such-user-here/x"):
        assert not roots.allows(path), path
    assert not LocalRoots().allows(allowed)  # none by default


def test_a_root_that_is_a_file_allows_that_file_alone(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    roots = LocalRoots.of([gguf])
    assert roots.allows(gguf) and not roots.allows(tmp_path / "other.gguf")
    assert not roots.allows(tmp_path)


def test_a_refused_path_reads_the_same_whatever_lies_there(tiny_llama, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "outside"
    shutil.copytree(tiny_llama, outside / "model")
    unreadable = outside / "locked"
    unreadable.mkdir()
    unreadable.chmod(0)
    (allowed / "link").symlink_to(outside / "model")
    roots = LocalRoots.of([allowed])
    messages = set()
    try:
        for source in (outside / "model", outside / "missing", unreadable / "model",
                       allowed / "link", allowed / ".." / "outside" / "model",
                       str(outside / "model") + "/", outside / "m.gguf"):
            with pytest.raises(ModelResolutionError) as err:
                pull(str(source), tmp_path / "registry" / "m", _progress, allowed=roots)
            messages.add(str(err.value))
    finally:
        unreadable.chmod(0o755)
    assert messages == {REFUSAL}
    assert not (tmp_path / "registry").exists()  # refused before any staging directory
    # inside, the same model is pulled; a missing one there may say so
    shutil.copytree(tiny_llama, allowed / "model")
    assert pull(str(allowed / "model"), tmp_path / "registry" / "m", _progress,
                allowed=roots).format == "safetensors"
    with pytest.raises(ModelResolutionError, match="neither a model directory"):
        pull(str(allowed / "missing"), tmp_path / "registry" / "n", _progress, allowed=roots)


def test_a_file_of_an_allowed_directory_that_links_out_is_refused(tiny_llama, tmp_path):
    allowed = tmp_path / "allowed"
    shutil.copytree(tiny_llama, allowed / "model")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (allowed / "model" / "extra.json").symlink_to(secret)
    with pytest.raises(ModelResolutionError, match="extra.json in .* lead outside"):
        pull(str(allowed / "model"), tmp_path / "registry" / "m", _progress,
             allowed=LocalRoots.of([allowed]))


def test_a_bare_name_is_a_directory_only_inside_the_allowed_ones(tiny_llama, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama, tmp_path / "org" / "model")
    downloads = []
    monkeypatch.setattr("launcher.pull._download",
                        lambda source, *_: downloads.append(source) or "")
    with pytest.raises(ModelResolutionError):  # tried as a Hub id: nothing was downloaded
        pull("org/model", tmp_path / "registry" / "a", _progress, allowed=LocalRoots())
    assert downloads == ["org/model"]
    pulled = pull("org/model", tmp_path / "registry" / "b", _progress,
                  allowed=LocalRoots.of([tmp_path]))
    assert pulled.format == "safetensors" and downloads == ["org/model"]


def test_the_launcher_allows_its_cache_registry_model_and_the_named_directories(
        tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("ALLOWED_LOCAL_MODEL_PATH", str(tmp_path / "env"))
    from_env = pull_roots(parse_args(["--model-id", "org/hub-model"])).roots
    assert from_env == LocalRoots.of([tmp_path / "env", cache_root(),
                                      cache_root() / "registry"]).roots
    monkeypatch.delenv("ALLOWED_LOCAL_MODEL_PATH")
    config = parse_args(["--model-id", str(tiny_llama), "--model-registry-dir",
                         str(tmp_path / "reg"), "--allowed-local-model-path", f"{tmp_path}/a,,",
                         "--allowed-local-model-path", f"{tmp_path}/b, {tmp_path}/c"])
    roots = pull_roots(config)
    assert roots.roots == LocalRoots.of([tmp_path / "a", tmp_path / "b", tmp_path / "c",
                                         cache_root(), tmp_path / "reg", tiny_llama]).roots
    assert LocalRoots.of(roots.as_flag().split(",")) == roots
    assert not pull_roots(parse_args([])).allows(os.path.expanduser("~"))
