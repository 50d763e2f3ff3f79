"""The model registry: ids that cannot escape, the state machine, persistence; settings checks."""
import json
import shutil

import pytest

from router.errors import InvalidModelIdError, ModelNotFoundError, ModelStateError, ValidationError
from router.lifecycle.registry import (DOWNLOADING, RUNNING, STARTING, STOPPED, ModelRecord,
                                       ModelRegistry, check_model_id, directory_for,
                                       parameter_count)
from router.lifecycle.settings import PARAMETERS, SETTINGS, ChatPrompt, checked


@pytest.mark.parametrize("model_id", ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "a.b_c-d",
                                      "_x", "Q4/v1.5"])
def test_ids_a_person_would_use_are_valid(model_id):
    assert check_model_id(model_id) == model_id


@pytest.mark.parametrize("model_id", ["", "..", ".", "../x", "a/..", "a/../b", "/etc", "a/b/c",
                                      ".hidden", "-flag", "a%2Fb", "a\\b", "a b", "a/", "/",
                                      "x" * 129, "a\x00b", None, 7, ["a"]])
def test_ids_that_could_escape_or_confuse_are_refused(model_id):
    with pytest.raises(InvalidModelIdError):
        check_model_id(model_id)


def test_a_directory_is_one_level_under_the_models_directory(tmp_path):
    assert directory_for(tmp_path, "owner/name") == tmp_path / "owner%2Fname"
    assert directory_for(tmp_path, "name").parent == tmp_path
    with pytest.raises(InvalidModelIdError):
        directory_for(tmp_path, "../name")


def test_moves_the_table_does_not_allow_are_conflicts_naming_the_state(tmp_path):
    registry = ModelRegistry(tmp_path)
    record = registry.add(ModelRecord("m", DOWNLOADING))
    with pytest.raises(ModelStateError) as err:
        registry.move(record, STARTING, allowed_from=(STOPPED,), action="start")
    assert err.value.state == DOWNLOADING and err.value.status == 409
    assert "downloading" in str(err.value)
    with pytest.raises(ModelNotFoundError):
        registry.get("other")


def test_the_registry_survives_a_restart_with_interrupted_states_settled(tmp_path):
    registry = ModelRegistry(tmp_path)
    registry.add(ModelRecord("running", RUNNING, settings={"ctx_len": 512},
                             parameters={"temperature": 0.5}))
    registry.add(ModelRecord("pulling", DOWNLOADING))
    registry.add(ModelRecord("idle", STOPPED))
    registry.close()
    again = ModelRegistry(tmp_path)
    assert again.get("running").state == STOPPED and again.get("running").was_running
    assert again.get("running").settings == {"ctx_len": 512}
    assert again.get("pulling").state == "not_downloaded"
    assert "interrupted" in again.get("pulling").error
    assert again.get("idle").state == STOPPED and not again.get("idle").was_running


def _read(directory) -> ModelRegistry:
    registry = ModelRegistry(directory)
    registry.close()
    return registry


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"models": 3}'])
def test_an_unreadable_registry_file_is_kept_aside_and_the_server_starts(tmp_path, text):
    (tmp_path / "models.json").write_text(text)
    assert _read(tmp_path).records == {}
    (kept,) = tmp_path.glob("models.json.unreadable-*")
    assert kept.read_text() == text


def test_malformed_entries_are_skipped(tmp_path):
    (tmp_path / "models.json").write_text(json.dumps({"models": [
        {"id": "../escape", "state": "stopped"}, {"id": "ok", "state": "stopped"}, {"no": 1},
        "text", {"id": "s", "state": "stopped", "settings": "big"},
        {"id": "t", "state": "asleep"}, {"id": "u", "state": "stopped", "created": "today"},
        {"id": "v", "state": "stopped", "settings": {"ctx_len": -1}},
        {"id": "w", "state": "stopped", "owned": 1}]}))
    assert list(_read(tmp_path).records) == ["ok"]


def test_one_server_per_registry(tmp_path):
    first = ModelRegistry(tmp_path)
    first.add(ModelRecord("kept", STOPPED))
    second = ModelRegistry(tmp_path)
    assert second.unavailable and "another server" in second.unavailable
    assert second.records == {} and second.models_dir is None
    second.add(ModelRecord("ignored", STOPPED))  # kept in memory, never written
    first.close()
    assert list(_read(tmp_path).records) == ["kept"]


def test_a_pull_cut_short_leaves_no_staging_directory(tmp_path):
    staging = tmp_path / "models" / ".m-abc123"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"x")
    (tmp_path / "models" / "kept").mkdir()
    _read(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["kept"]


def test_parameter_count_reads_the_safetensors_headers(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                                 + bytes(68))
    assert parameter_count(tmp_path) == 17
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 4)
    assert parameter_count(tmp_path) == 0


def test_settings_accept_jan_strings_and_numbers_and_refuse_the_rest():
    assert checked("settings", {"ctx_len": "2048", "n_parallel": 4, "ngl": "0"}, SETTINGS) == \
        {"ctx_len": 2048, "n_parallel": 4, "ngl": 0}
    assert checked("parameters", {"temperature": "0.7", "stream": "true", "top_k": 40},
                   PARAMETERS) == {"temperature": 0.7, "stream": True, "top_k": 40}
    for group, bad, table in (("settings", {"embedding": "yes"}, SETTINGS),
                              ("settings", {"cpu_threads": 0}, SETTINGS),
                              ("parameters", {"stop": ["a"] * 5}, PARAMETERS),
                              ("parameters", {"presence_penalty": 3}, PARAMETERS),
                              ("settings", {"ctx_len": "lots"}, SETTINGS),
                              ("settings", {"ctx_len": "--5"}, SETTINGS),
                              ("settings", {"ctx_len": "\u00b2"}, SETTINGS),
                              ("settings", {"ctx_len": 2**40}, SETTINGS),
                              ("parameters", {"temperature": "nan"}, PARAMETERS),
                              ("settings", {"n_parallel": 0}, SETTINGS),
                              ("settings", {"dtype": "int4"}, SETTINGS),
                              ("parameters", {"top_p": 1.5}, PARAMETERS),
                              ("parameters", {"stream": "maybe"}, PARAMETERS),
                              ("parameters", [], PARAMETERS)):
        with pytest.raises(ValidationError):
            checked(group, bad, table)
    assert checked("settings", {"embedding": False}, SETTINGS) == {"embedding": False}
    # Jan's `embedding: true` serves embeddings of the model (router/lifecycle/settings.py)
    assert checked("settings", {"embedding": "true"}, SETTINGS) == {"embedding": True}


def test_jan_prompt_pieces_build_a_chat_prompt():
    prompt = ChatPrompt.of({"pre_prompt": "Be brief.\n", "user_prompt": "U: ", "ai_prompt": "A: "})
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert prompt.render(messages) == "Be brief.\nSYSTEM: sys\nU: hi\nA: hello\nU: bye\nA: "


async def test_a_copy_links_the_sources_files_and_outlives_it(tmp_path):
    from router.lifecycle.copies import copy_model
    registry = ModelRegistry(tmp_path)
    source = directory_for(registry.models_dir, "src")
    source.mkdir(parents=True)
    (source / "model.safetensors").write_bytes(b"weights")
    registry.add(ModelRecord("src", RUNNING, model_dir=str(source), owned=True,
                             parameters={"temperature": 0.5}))
    copied = await copy_model(registry, "src", "dst")
    assert copied.state == "downloaded" and copied.parameters == {"temperature": 0.5}
    linked = directory_for(registry.models_dir, "dst") / "model.safetensors"
    assert copied.model_dir == str(linked.parent) and linked.read_bytes() == b"weights"
    assert linked.stat().st_ino == (source / "model.safetensors").stat().st_ino
    with pytest.raises(ModelStateError) as err:
        await copy_model(registry, "src", "dst")
    assert err.value.status == 409
    registry.add(ModelRecord("pulling", DOWNLOADING))
    with pytest.raises(ModelStateError):
        await copy_model(registry, "pulling", "other")
    shutil.rmtree(source)  # as deleting the source does
    assert linked.read_bytes() == b"weights"
    registry.close()
    assert _read(tmp_path).get("dst").state == "downloaded"


async def test_a_copy_cut_short_leaves_nothing_that_could_delete_the_source(tmp_path, monkeypatch):
    import asyncio

    from router.lifecycle import copies
    registry = ModelRegistry(tmp_path)
    source = directory_for(registry.models_dir, "src")
    source.mkdir(parents=True)
    registry.add(ModelRecord("src", STOPPED, model_dir=str(source), owned=True))
    seen = []

    def cut(src, target):  # a client gone mid-copy, as seen from the linking thread
        seen.append(registry.get("dst"))
        raise asyncio.CancelledError

    monkeypatch.setattr(copies, "_linked_tree", cut)
    with pytest.raises(asyncio.CancelledError):
        await copies.copy_model(registry, "src", "dst")
    # while it linked, the record owned no files (a crash then left nothing to delete them)
    assert seen[0].owned is False and seen[0].model_dir is None
    assert "dst" not in registry.records and source.is_dir()
    monkeypatch.undo()
    shutil.rmtree(source)
    with pytest.raises(ModelStateError, match="could not be copied"):  # its files are gone
        await copies.copy_model(registry, "src", "dst")
    assert "dst" not in registry.records
