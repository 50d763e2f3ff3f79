"""The Jan/Cortex model routes end to end: pull (a directory, the default model's GGUF), start, stop,
patch and delete, several models served at once, ids that cannot escape, a registry that survives a
restart."""
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import requests
from tokenizers import Tokenizer

from benchmarks.shard_recovery import shard_pids
from tests.e2e.fake_hub_server import FakeHubServer
from tests.e2e.server import launch
from tests.unit.launcher.tiny_gguf import write_tiny_gguf
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

HUB_REPO = "bartowski/Tiny-GGUF"
# an adapter repository whose weights file (sparse) is larger than any adapter SmolLM2 takes
HUGE_ADAPTER = "attacker/huge-adapter"
SPEC_STATES = ["not_downloaded", "downloading", "downloaded", "starting", "running", "stopping",
               "stopped"]
_NUMBER = {"type": ["integer", "number"]}
# Jan's schemas (../shared/spec/jan-models-api.yaml) as JSON Schema, with three deliberate
# differences: `state` takes the union of the spec's two enums (the Model object's and
# GetModelResponse's), settings and parameters hold numbers and booleans as GetModelResponse's
# model_parameters and Jan's model.json do (the Model object types them as strings, and both are
# accepted on the way in), settings also takes this server's num_shard, dtype and
# max_batch_total_tokens and the document's engine parameter cpu_threads, and parameters take
# Cortex's stop and penalties (its model.yml's fields).
MODEL_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "type", "version", "name", "description",
                 "state", "format", "source_url", "settings", "parameters", "metadata", "assets"],
    "properties": {
        "id": {"type": "string", "minLength": 1}, "object": {"const": "model"},
        "created": {"type": "integer", "minimum": 1}, "owned_by": {"type": "string"},
        "type": {"const": "model"}, "version": {"type": "string"}, "name": {"type": "string"},
        "description": {"type": "string"}, "state": {"enum": SPEC_STATES},
        "format": {"type": "string"}, "source_url": {"type": "string", "format": "uri"},
        "settings": {"type": "object", "additionalProperties": False, "properties": {
            "ctx_len": {"type": "integer"}, "ngl": {"type": "integer"},
            "embedding": {"type": "boolean"}, "n_parallel": {"type": "integer"},
            "cpu_threads": {"type": "integer", "minimum": 1},
            "num_shard": {"type": "integer"}, "dtype": {"type": "string"},
            "max_batch_total_tokens": {"type": "integer"}}},
        "parameters": {"type": "object", "additionalProperties": False, "properties": {
            "temperature": _NUMBER, "token_limit": {"type": "integer"},
            "top_k": {"type": "integer"}, "top_p": _NUMBER, "stream": {"type": "boolean"},
            "stop": {"type": "array", "items": {"type": "string"}},
            "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER}},
        "metadata": {"type": "object", "required": ["engine", "quantization", "size"],
                     "properties": {
                         "engine": {"enum": ["nitro", "openai", "hf_inference"]},
                         "quantization": {"type": "string"}, "size": {"type": "string"}}},
        "assets": {"type": "array", "items": {"type": "string"}},
        "embedding": {"type": "boolean"},  # not Jan's: whether it serves /v1/embeddings
    },
}
GET_SCHEMA = {"allOf": [MODEL_SCHEMA, {
    "required": ["engine_parameters", "model_parameters"],
    "properties": {
        "engine_parameters": {"type": "object", "properties": {
            "pre_prompt": {"type": "string"}, "system_prompt": {"type": "string"},
            "user_prompt": {"type": "string"}, "ai_prompt": {"type": "string"},
            "ngl": {"type": "integer", "minimum": 0}, "ctx_len": {"type": "integer"},
            "n_parallel": {"type": "integer", "minimum": 1}, "cont_batching": {"type": "boolean"},
            "cpu_threads": {"type": "integer", "minimum": 1}, "embedding": {"type": "boolean"}}},
        "model_parameters": {"type": "object", "properties": {
            "ctx_len": {"type": "integer", "minimum": 0}, "ngl": {"type": "integer"},
            "embedding": {"type": "boolean"}, "n_parallel": {"type": "integer", "minimum": 1},
            "temperature": {**_NUMBER, "minimum": 0, "maximum": 2},
            "token_limit": {"type": "integer", "minimum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "top_p": {**_NUMBER, "minimum": 0, "maximum": 1}}},
    }}]}
LIST_SCHEMA = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": MODEL_SCHEMA}}}
STATE_SCHEMA = {"type": "object", "required": ["id", "object", "state"],
                "additionalProperties": False, "properties": {
                    "id": {"type": "string"}, "object": {"const": "model"},
                    "state": {"enum": SPEC_STATES}}}
DELETE_SCHEMA = {"type": "object", "required": ["id", "object", "deleted"],
                 "additionalProperties": False, "properties": {
                     "id": {"type": "string"}, "object": {"const": "model"},
                     "deleted": {"type": "boolean"}}}


def _valid(body: dict, schema: dict) -> dict:
    jsonschema.validate(body, schema, format_checker=jsonschema.FormatChecker())
    return body


def _wait_state(url: str, model_id: str, wanted: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = requests.get(f"{url}/v1/models/{model_id}", timeout=10).json()
        if got["state"] == wanted:
            return got
        if got["state"] == "not_downloaded" and got["metadata"].get("error"):  # a failed pull
            break
        time.sleep(0.1)
    raise AssertionError(f"{model_id} never reached {wanted}: {got}")


def _shard_environ(model_dir: str) -> dict[str, str]:
    """The environment of the shard process serving `model_dir`."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"--model-path" in argv and argv[argv.index(b"--model-path") + 1] == \
                    model_dir.encode():
                entries = (proc / "environ").read_bytes().split(b"\0")
                return dict(e.decode().split("=", 1) for e in entries if b"=" in e)
        except (OSError, IndexError):
            continue
    raise AssertionError(f"no shard serves {model_dir}")


def _generate(url: str, model: str | None, inputs: str, tokens: int = 12) -> requests.Response:
    headers = {"X-Model-Id": model} if model else {}
    return requests.post(f"{url}/generate", headers=headers, timeout=120, json={
        "inputs": inputs, "parameters": {"max_new_tokens": tokens}})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub on loopback (HF_ENDPOINT) with a GGUF repository of two quantizations."""
    root = tmp_path_factory.mktemp("hub")
    (root / HUB_REPO).mkdir(parents=True)
    for seed, quant in enumerate(("Q4_K_M", "Q8_0")):  # two files, two contents
        write_tiny_gguf(root / HUB_REPO / f"Tiny-{quant}.gguf", seed=seed)
    (root / HUGE_ADAPTER).mkdir(parents=True)
    (root / HUGE_ADAPTER / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    with open(root / HUGE_ADAPTER / "adapter_model.safetensors", "wb") as weights:
        weights.truncate(400 << 20)  # rank 64 on every SmolLM2 layer, in float64: about 160 MB
    served = FakeHubServer(root)
    yield served
    served.close()


@pytest.fixture(scope="module")
def server(real_model_dir, tiny_llama, tmp_path_factory, hub):
    registry = tmp_path_factory.mktemp("registry")
    allowed = tmp_path_factory.mktemp("allowed")
    endpoint = os.environ.get("HF_ENDPOINT")
    os.environ["HF_ENDPOINT"] = hub.url  # the launcher's pulls reach the Hub there
    try:
        launched = launch(["--model-id", str(real_model_dir)], tmp_path_factory.mktemp("launch"),
                          extra=["--max-batch-total-tokens", "4096", "--model-registry-dir",
                                 str(registry), "--allowed-local-model-path", str(allowed),
                                 "--allowed-local-model-path", str(tiny_llama),
                                 "--huggingface-hub-cache",
                                 str(tmp_path_factory.mktemp("hub-cache"))])
    finally:
        if endpoint is None:
            os.environ.pop("HF_ENDPOINT")
        else:
            os.environ["HF_ENDPOINT"] = endpoint
    launched.registry = registry
    launched.allowed = allowed
    yield launched
    assert launched.stop() == 0, launched.log()[-5000:]
    assert launched.processes_left() == []


def test_the_default_model_is_listed_running(server):
    listing = _valid(requests.get(f"{server.url}/v1/models", timeout=10).json(), LIST_SCHEMA)
    (default,) = listing["data"]
    _valid(requests.get(f"{server.url}/v1/models/{default['id']}", timeout=10).json(), GET_SCHEMA)
    assert default["state"] == "running"
    assert default["id"] == requests.get(f"{server.url}/info", timeout=10).json()["model_id"]


def test_pull_the_gguf_with_progress_start_it_beside_the_default_and_stop_it(server):
    from launcher.known_models import DEFAULT_MODEL
    from launcher.model_cache import cache_root
    from launcher.prepare import fetch_gguf

    gguf = fetch_gguf(DEFAULT_MODEL, cache_root())
    reply = requests.post(f"{server.url}/v1/models/pull", timeout=10,
                          json={"model": str(gguf), "id": "smollm2-q4"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["id"] == "smollm2-q4" and reply.json()["state"] == "downloading"
    mid_way, refused = None, None
    while True:
        got = requests.get(f"{server.url}/v1/models/smollm2-q4", timeout=10).json()
        progress = got["metadata"].get("progress", {})
        if got["state"] == "downloading" and 0 < progress.get("bytes_done", 0) \
                < progress.get("bytes_total", 0):
            mid_way = progress
            if refused is None:  # a model that is downloading cannot start
                refused = requests.put(f"{server.url}/v1/models/smollm2-q4/start", timeout=10)
        if got["state"] != "downloading":
            break
        time.sleep(0.05)
    assert got["state"] == "downloaded", got
    assert mid_way is not None, "no progress seen while converting"
    assert refused.status_code == 409 and refused.json()["state"] == "downloading"
    _valid(got, GET_SCHEMA)
    assert got["format"] == "gguf" and got["metadata"]["quantization"] == "Q4_1"
    assert got["source_url"].startswith("file://")

    patched = requests.patch(f"{server.url}/v1/models/smollm2-q4", timeout=10, json={
        "settings": {"max_batch_total_tokens": "2048", "ctx_len": 1024, "n_parallel": 4}})
    assert patched.status_code == 200, patched.text
    _valid(patched.json(), GET_SCHEMA)
    assert patched.json()["settings"]["max_batch_total_tokens"] == 2048  # Jan's strings read
    started = requests.put(f"{server.url}/v1/models/smollm2-q4/start", timeout=600)
    assert _valid(started.json(), STATE_SCHEMA) == {"id": "smollm2-q4", "object": "model", "state": "running"}
    info = requests.get(f"{server.url}/info", headers={"X-Model-Id": "smollm2-q4"},
                        timeout=10).json()
    assert info["model_id"] == "smollm2-q4"
    assert info["max_total_tokens"] == 1024 and info["max_batch_size"] == 4

    # the same weights, converted twice: the same greedy text from both models at once
    prompt = "The capital of France is"
    pulled = _generate(server.url, "smollm2-q4", prompt)
    default = _generate(server.url, None, prompt)
    assert pulled.status_code == default.status_code == 200
    assert pulled.json()["generated_text"] == default.json()["generated_text"]

    stopped = requests.put(f"{server.url}/v1/models/smollm2-q4/stop", timeout=120)
    assert _valid(stopped.json(), STATE_SCHEMA)["state"] == "stopped"
    assert _generate(server.url, "smollm2-q4", prompt).status_code == 409
    deleted = requests.delete(f"{server.url}/v1/models/smollm2-q4", timeout=30)
    assert _valid(deleted.json(), DELETE_SCHEMA) == {"id": "smollm2-q4", "object": "model", "deleted": True}
    assert not (server.registry / "models" / "smollm2-q4").exists()
    assert requests.get(f"{server.url}/v1/models/smollm2-q4", timeout=10).status_code == 404


def _without_chat_template(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_tiny_model_lifecycle_beside_the_default(server, tiny_llama):
    url = server.url
    plain = _without_chat_template(tiny_llama, server.allowed / "plain")
    pulled = requests.post(f"{url}/v1/models/pull", timeout=10,
                           json={"model": str(plain), "id": "tests/tiny"})
    assert pulled.status_code == 200, pulled.text
    got = _wait_state(url, "tests/tiny", "downloaded")
    _valid(got, GET_SCHEMA)
    assert got["metadata"]["size_bytes"] > 0
    assert requests.get(f"{url}/v1/models/tests%2Ftiny", timeout=10).json()["id"] == "tests/tiny"
    again = requests.post(f"{url}/v1/models/pull", timeout=10,
                          json={"model": str(tiny_llama), "id": "tests/tiny"})
    assert again.status_code == 409 and again.json()["state"] == "downloaded"

    # settings and parameters are checked; nothing unknown is stored
    for bad in ({"settings": {"embedding": "yes"}}, {"settings": {"cpu_threads": 0}},
                {"parameters": {"temperature": 3}}, {"colour": "blue"},
                {"engine": "onnxruntime"}, {"model": "another"}, {"prompt_template": "no slot"}):
        reply = requests.patch(f"{url}/v1/models/tests/tiny", json=bad, timeout=10)
        assert reply.status_code == 422, (bad, reply.text)
    reply = requests.patch(f"{url}/v1/models/tests/tiny", timeout=10, json={
        "settings": {"max_batch_total_tokens": 1024, "ngl": 0, "embedding": True},
        "parameters": {"temperature": 0}})
    assert reply.status_code == 200, reply.text
    # Cortex's model.yml fields, flat, as Cortex writes them
    reply = requests.patch(f"{url}/v1/models/tests/tiny", timeout=10, json={
        "model": "tests/tiny", "version": 1, "engine": "llama-cpp", "ctx_len": 96,
        "cpu_threads": 1, "max_tokens": 5, "frequency_penalty": 0, "presence_penalty": 0,
        "prompt_template": "S: {system_message}U: {prompt}\nA: "})
    assert reply.status_code == 200, reply.text
    patched = _valid(reply.json(), GET_SCHEMA)
    assert patched["settings"]["ctx_len"] == 96 and patched["parameters"]["token_limit"] == 5
    assert patched["engine_parameters"]["cpu_threads"] == 1

    # Cortex's body starts it; a second start is idempotent
    started = requests.post(f"{url}/v1/models/start", json={"model": "tests/tiny"}, timeout=300)
    assert _valid(started.json(), STATE_SCHEMA)["state"] == "running", started.text
    assert requests.put(f"{url}/v1/models/tests%2Ftiny/start", timeout=30).json()["state"] == \
        "running"
    assert requests.get(f"{url}/info", headers={"X-Model-Id": "tests/tiny"},
                        timeout=10).json()["max_total_tokens"] == 96
    _valid(requests.get(f"{url}/v1/models", timeout=10).json(), LIST_SCHEMA)
    running = _valid(requests.get(f"{url}/v1/models/tests/tiny", timeout=10).json(), GET_SCHEMA)
    assert running["model_parameters"]["ctx_len"] == 96
    # cpu_threads: torch's threads in the model's shard
    assert _shard_environ(running["assets"][0]).get("OMP_NUM_THREADS") == "1"
    # Jan's `embedding: true`: this generating model serves embeddings too (the default, which
    # was not asked to, refuses them in OpenAI's shape)
    assert running["embedding"] and running["engine_parameters"]["embedding"]
    embedded = requests.post(f"{url}/v1/embeddings", timeout=60,
                             json={"model": "tests/tiny", "input": ["hello", "there"]})
    assert embedded.status_code == 200, embedded.text
    assert [len(d["embedding"]) for d in embedded.json()["data"]] == [64, 64]
    refused = requests.post(f"{url}/v1/embeddings", timeout=10, json={"input": "hello"})
    assert refused.status_code == 400 and "does not serve embeddings" in refused.text

    # parameters are the model's request defaults: greedy, at most 5 tokens
    ask = {"model": "tests/tiny", "messages": [{"role": "user", "content": "hello there"}]}
    first = requests.post(f"{url}/v1/chat/completions", json=ask, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "tests/tiny"
    assert first.json()["usage"]["completion_tokens"] <= 5
    second = requests.post(f"{url}/v1/chat/completions", json=ask, timeout=60).json()
    assert second["choices"][0]["message"] == first.json()["choices"][0]["message"]
    # this copy has no chat template: Jan's prompt pieces build its prompt
    tokenizer = Tokenizer.from_file(str(plain / "tokenizer.json"))
    expected = tokenizer.encode("U: hello there\nA: ", add_special_tokens=False).ids
    assert first.json()["usage"]["prompt_tokens"] == len(expected)

    # every API routes by name; a name nobody knows is a 404 now that two models exist
    unknown = requests.post(f"{url}/v1/chat/completions", timeout=10,
                            json={**ask, "model": "no-such-model"})
    assert unknown.status_code == 404, unknown.text
    sglang = requests.post(f"{url}/generate", headers={"X-Model-Id": "tests/tiny"}, timeout=60,
                           json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert sglang.status_code == 200, sglang.text
    one = requests.post(f"{url}/api/generate-one", headers={"X-Model-Id": "tests/tiny"},
                        timeout=60, json={"request_id": "a", "prompt": "hi",
                                          "stream_response": False,
                                          "generation_config": {"max_new_tokens": 3}})
    assert one.status_code == 200, one.text

    deleting = requests.delete(f"{url}/v1/models/tests/tiny", timeout=10)
    assert deleting.status_code == 409 and deleting.json()["state"] == "running"

    # a stream on the default model runs through the stop of the other
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 60,
                                                          "ignore_eos_token": True}}
    events, done = [], threading.Event()

    def stream():
        with requests.post(f"{url}/generate_stream", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
        done.set()

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: events, "the stream on the default model to begin", timeout=120)
    stopped = requests.put(f"{url}/v1/models/tests/tiny/stop", timeout=120)
    assert stopped.json()["state"] == "stopped"
    assert requests.post(f"{url}/v1/models/stop", json={"model": "tests/tiny"},
                         timeout=30).json()["state"] == "stopped"  # idempotent
    reader.join(300)
    assert done.is_set() and len(events) == 60 and events[-1]["generated_text"] is not None

    refused = requests.post(f"{url}/v1/chat/completions", json=ask, timeout=10)
    assert refused.status_code == 409, refused.text
    deleted = requests.delete(f"{url}/v1/models/tests%2Ftiny", timeout=30).json()
    assert deleted["deleted"] is True
    assert not any(p.name.startswith("tests") for p in (server.registry / "models").iterdir())


def test_ids_cannot_escape_the_models_directory(server, tmp_path):
    url = server.url
    for path in ("..%2F..%2Fetc", "%2E%2E", "a/../../b", "a%2F..%2F..", "%2Fetc%2Fpasswd",
                 "a%252Fb"):
        reply = requests.get(f"{url}/v1/models/{path}", timeout=10)
        assert reply.status_code in (400, 404), (path, reply.status_code)
        if "%2F" in path or "%25" in path:  # these reach the id check, which refuses them
            assert reply.status_code == 400, (path, reply.text)
        reply = requests.put(f"{url}/v1/models/{path}/start", timeout=10)
        assert reply.status_code in (400, 404), (path, reply.status_code)
    for model_id in ("../escape", "/abs", "a/b/c", "..", ".hidden", "a%2Fb", ""):
        reply = requests.post(f"{url}/v1/models/pull", timeout=10,
                              json={"model": str(tmp_path), "id": model_id})
        assert reply.status_code in (400, 422), (model_id, reply.text)
    assert not (tmp_path.parent / "escape").exists()
    assert not (server.registry / "escape").exists()
    missing = requests.post(f"{url}/v1/models/pull", timeout=10,
                            json={"model": str(server.allowed / "nothing-here")})
    assert missing.status_code == 200  # the pull fails on its own time, as a download would
    failed = _wait_state(url, "nothing-here", "not_downloaded")
    assert "neither a model directory" in failed["metadata"]["error"]
    assert requests.put(f"{url}/v1/models/nothing-here/start", timeout=10).status_code == 409
    assert requests.delete(f"{url}/v1/models/nothing-here", timeout=10).status_code == 200


def test_hub_urls_and_cortex_quant_names_pull_the_right_gguf(server, hub):
    """Jan's and Cortex's names of a Hub GGUF: the file they pick is fetched from the (loopback)
    Hub and converted; the model's source_url is the Hub's."""
    url = server.url
    names = {f"{HUB_REPO}:q8_0": (f"{HUB_REPO}-q8_0", "Tiny-Q8_0.gguf"),
             f"https://huggingface.co/{HUB_REPO}/resolve/main/Tiny-Q4_K_M.gguf?download=true":
             ("Tiny-Q4_K_M", "Tiny-Q4_K_M.gguf")}
    for source, (model_id, _) in names.items():
        reply = requests.post(f"{url}/v1/models/pull", json={"model": source}, timeout=10)
        assert reply.status_code == 200 and reply.json()["id"] == model_id, reply.text
    for source, (model_id, file_name) in names.items():
        pulled = _valid(_wait_state(url, model_id, "downloaded"), GET_SCHEMA)
        assert pulled["format"] == "gguf"
        assert pulled["source_url"].startswith(f"https://huggingface.co/{HUB_REPO}")
        assert f"GET /{HUB_REPO}/resolve/main/{file_name}" in hub.requests
    assert not any("Q4_K_M" in r for r in hub.requests if "Q8_0" in r)
    missing = requests.post(f"{url}/v1/models/pull", json={"model": f"{HUB_REPO}:Q2_K"},
                            timeout=10)
    assert missing.status_code == 200
    failed = _wait_state(url, f"{HUB_REPO}-Q2_K", "not_downloaded")
    assert "no GGUF file of quantization Q2_K" in failed["metadata"]["error"]
    bogus = requests.post(f"{url}/v1/models/pull", json={"model": "https://example.com/x.gguf"},
                          timeout=10)
    assert bogus.status_code == 422 and "not a Hugging Face Hub URL" in bogus.text
    for model_id in (*(m for m, _ in names.values()), f"{HUB_REPO}-Q2_K"):
        assert requests.delete(f"{url}/v1/models/{model_id}", timeout=30).status_code == 200


def test_a_hub_adapter_larger_than_the_model_takes_is_refused_before_its_download(server, hub):
    """The launcher reads the Hub's listing first: a repository with a huge weights file costs one
    listing, not the disk, and the model serves meanwhile."""
    reply = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=30, json={
        "lora_name": "huge", "lora_path": HUGE_ADAPTER})
    assert reply.status_code == 400, reply.text
    assert f"its files hold {(400 << 20) + 77} bytes, more than any LoRA adapter" in reply.text
    assert not any(r.startswith(f"GET /{HUGE_ADAPTER}/resolve") for r in hub.requests)
    assert any(r.startswith(f"GET /api/models/{HUGE_ADAPTER}/tree/main") for r in hub.requests)
    assert _generate(server.url, None, "Hello").status_code == 200


def test_local_pulls_only_under_the_allowed_directories_and_failures_forgotten(
        server, tiny_llama, tmp_path):
    from router.lifecycle.registry import MAX_FAILED_PULLS

    url, allowed = server.url, server.allowed
    shutil.copytree(tiny_llama, tmp_path / "model")  # outside the allowed directories
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    evil = Path(f"{allowed}-evil")  # a prefix of the allowed directory's name is not under it
    shutil.copytree(tiny_llama, evil / "model")
    (allowed / "link").symlink_to(tmp_path / "model")
    story = []  # the default model serves throughout
    reader = threading.Thread(target=lambda: story.append(
        _generate(url, None, "Once upon a time", tokens=40)))
    reader.start()
    answers = set()
    for source in (tmp_path / "model", tmp_path / "missing", locked / "model", evil / "model",
                   allowed / "link", f"{allowed}/../{evil.name}/model", "/etc", "~/x.gguf"):
        reply = requests.post(f"{url}/v1/models/pull", json={"model": str(source), "id": "x"},
                              timeout=10)
        answers.add((reply.status_code, reply.text))
    ((status, body),) = answers  # one answer, whatever lies there
    assert status == 403 and "--allowed-local-model-path" in body, body
    assert requests.get(f"{url}/v1/models/x", timeout=10).status_code == 404

    # pulls that fail inside it: only the newest failures are kept
    ids = [f"gone-{n}" for n in range(MAX_FAILED_PULLS + 4)]
    for model_id in ids:
        body = {"model": str(allowed / model_id), "id": model_id}
        wait_until(lambda: requests.post(f"{url}/v1/models/pull", json=body,
                                         timeout=10).status_code != 429, "a free pull slot")
    wait_until(lambda: all(m["state"] != "downloading" for m in requests.get(
        f"{url}/v1/models", timeout=10).json()["data"]), "the pulls to fail")
    saved = json.loads((server.registry / "models.json").read_text())["models"]
    failed = [m["id"] for m in saved if m["state"] == "not_downloaded"]
    assert len(failed) == MAX_FAILED_PULLS and ids[-1] in failed and ids[0] not in failed
    reader.join(120)
    assert story and story[0].status_code == 200, story
    for model_id in failed:
        requests.delete(f"{url}/v1/models/{model_id}", timeout=10)


def test_the_registry_survives_a_restart(tiny_llama, tmp_path):
    registry = tmp_path / "registry"
    extra = ["--max-batch-total-tokens", "2048", "--block-size", "4", "--model-registry-dir",
             str(registry)]

    def start(*more):
        return launch(["--model-id", str(tiny_llama)], tmp_path / f"launch{len(os.listdir(tmp_path))}",
                      extra=[*extra, *more])

    first = start()
    try:
        requests.post(f"{first.url}/v1/models/pull", json={"model": str(tiny_llama), "id": "kept"},
                      timeout=10)
        _wait_state(first.url, "kept", "downloaded")
        requests.patch(f"{first.url}/v1/models/kept", json={"settings": {
            "max_batch_total_tokens": 1024}, "parameters": {"token_limit": 3}}, timeout=10)
        assert requests.put(f"{first.url}/v1/models/kept/start", timeout=300).json()["state"] \
            == "running"
    finally:
        assert first.stop() == 0

    second = start()  # running models come back stopped
    try:
        kept = requests.get(f"{second.url}/v1/models/kept", timeout=10).json()
        assert kept["state"] == "stopped" and kept["parameters"] == {"token_limit": 3}
        assert requests.put(f"{second.url}/v1/models/kept/start", timeout=300).json()["state"] \
            == "running"
    finally:
        assert second.stop() == 0

    third = start("--autostart", "--max-shard-restarts", "0")  # or start again
    try:
        _wait_state(third.url, "kept", "running", timeout=300)
        reply = requests.post(f"{third.url}/v1/completions", timeout=60,
                              json={"model": "kept", "prompt": "hello"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
        metrics = requests.get(f"{third.url}/metrics", timeout=10).text
        assert 'tgi_request_success{model="kept"} 1' in metrics

        # its shards die past the restart budget: the launcher gives the group up, the router
        # stops that model with the reason, and the default model is not disturbed
        (pid,) = shard_pids(f"{third.uds_path}-g1").values()
        os.kill(pid, signal.SIGKILL)
        stopped = _wait_state(third.url, "kept", "stopped", timeout=60)
        assert "--max-shard-restarts" in stopped["metadata"]["error"]
        assert requests.get(f"{third.url}/health", timeout=10).status_code == 200
        assert _generate(third.url, None, "hello", tokens=3).status_code == 200
        assert requests.put(f"{third.url}/v1/models/kept/start", timeout=300).json()["state"] \
            == "running"  # and it can start again
    finally:
        assert third.stop() == 0
        assert third.processes_left() == []
