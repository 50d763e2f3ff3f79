"""Ollama's API end to end with the `ollama` Python client: generation (streamed and not), the
model routes, a pull followed as Ollama's progress lines, keep_alive starting and stopping a
model, and embeddings from all-MiniLM-L6-v2 pulled by its short name."""
import json
import math
import shutil

import ollama
import pytest
import requests

from tests.e2e.server import launch
from tests.embedding_models import TEXTS
from tests.tiny_models import build_tiny_model
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

OPTIONS = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny Llama with room for a prompt that lists tools."""
    return build_tiny_model(tmp_path_factory.mktemp("llama"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    copy = shutil.copytree(tiny_llama, allowed / "tiny-copy")
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("ollama-api"),
                      extra=["--allowed-local-model-path", str(allowed),
                             "--ollama-autostart", "2"])
    launched.copy = copy
    yield launched
    assert launched.stop() == 0, launched.log()[-5000:]


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def test_generate_streamed_and_whole_and_its_context(client, tiny_llama):
    model = str(tiny_llama)
    whole = client.generate(model=model, prompt="Hello there", options=OPTIONS, stream=False)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    assert whole.created_at.endswith("Z") and whole.context[-6:] and len(whole.context) > 6
    chunks = list(client.generate(model=model, prompt="Hello there", options=OPTIONS,
                                  stream=True))
    assert [c.done for c in chunks][-1] and not any(c.done for c in chunks[:-1])
    assert "".join(c.response for c in chunks) == whole.response  # temperature 0: greedy
    assert chunks[-1].context == whole.context
    following = client.generate(model=model, prompt="And then", context=whole.context,
                                options=OPTIONS, stream=False)
    assert following.context[:len(whole.context)] == whole.context
    raw = client.generate(model=model, prompt="user: hi", raw=True, stream=False,
                          options={**OPTIONS, "stop": ["\n"], "seed": 3, "top_k": 5})
    assert "\n" not in raw.response


def test_chat_streamed_formats_and_tools(client, tiny_llama, server):
    model = str(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat(model=model, messages=messages, options=OPTIONS)
    assert whole.message.role == "assistant" and whole.done and whole.eval_count == 6
    streamed = list(client.chat(model=model, messages=messages, options=OPTIONS, stream=True))
    assert "".join(c.message.content for c in streamed) == whole.message.content
    assert streamed[-1].done and streamed[-1].done_reason == "length"
    as_json = client.chat(model=model, messages=messages, format="json",
                          options={"temperature": 0, "num_predict": 40})
    if as_json.done_reason == "stop":  # a grammar's object closed within the budget
        assert isinstance(json.loads(as_json.message.content), dict)
    else:
        assert as_json.message.content.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = client.chat(model=model, messages=messages, format=schema,
                         options={"temperature": 0, "num_predict": 40})
    assert shaped.message.content.lstrip().startswith('{"n"')
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}}}}
    greedy = {"temperature": 0, "num_predict": 60, "repeat_penalty": 1.0}
    called = client.chat(model=model, messages=messages, tools=[tool], options=greedy)
    assert called.prompt_eval_count > whole.prompt_eval_count  # the tools are in the prompt
    # the same plan as OpenAI's route under tool_choice auto: the same greedy answer (this
    # random model answers in words, through the no_tool pseudo-call; the calls' shape is
    # tests/unit/router/test_ollama_mappings.py's)
    openai = requests.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "tools": [tool], "temperature": 0,
        "max_tokens": 60}).json()["choices"][0]["message"]
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in openai.get("tool_calls") or []]
    assert [(c.function.name, c.function.arguments)
            for c in called.message.tool_calls or []] == expected
    assert called.message.content == (openai["content"] or "")
    streamed = list(client.chat(model=model, messages=messages, tools=[tool], options=greedy,
                                stream=True))
    assert [(c.function.name, c.function.arguments) for chunk in streamed
            for c in chunk.message.tool_calls or []] == expected


def test_refusals_are_ollama_errors(client, tiny_llama, server):
    model = str(tiny_llama)
    cases = [
        lambda: client.generate(model=model, prompt="x", options={"mirostat": 2}),
        lambda: client.generate(model=model, prompt="x", options={"num_gpu": 1}),
        lambda: client.generate(model=model, prompt="x", template="{{ .Prompt }}"),
        lambda: client.chat(model=model, messages=[{"role": "user", "content": "x",
                                                     "images": ["aGVsbG8="]}]),
        lambda: client.embed(model=model, input="x"),
        lambda: client.embeddings(model=model, prompt="x"),
        lambda: client.copy(model, "other"),  # served from a path: nothing to copy
        lambda: client.generate(model=model, prompt="x", keep_alive="5 minutes"),
        # served from a path, without a registry id: it cannot be stopped
        lambda: client.generate(model=model, prompt="x", keep_alive=0),
    ]
    for case in cases:
        with pytest.raises(ollama.ResponseError) as raised:
            case()
        assert raised.value.status_code == 400, raised.value.error
        assert raised.value.error
    answer = requests.post(f"{server.url}/api/chat", json={"model": model}, timeout=10)
    assert answer.status_code == 200 and answer.json()["done_reason"] == "load"
    missing = requests.post(f"{server.url}/api/show", json={"model": "nope"}, timeout=10)
    assert missing.status_code == 404 and missing.json() == {"error": "model 'nope' not found"}
    with pytest.raises(ollama.ResponseError) as raised:
        client.copy("nope", "other")
    assert raised.value.status_code == 404


def test_model_routes_pull_autostart_keep_alive_and_delete(client, server, tiny_llama):
    # the client has no call for /api/version
    assert requests.get(f"{server.url}/api/version", timeout=10).json()["version"]
    listed = {m.model for m in client.list().models}
    assert str(tiny_llama) in listed
    shown = client.show(str(tiny_llama))
    assert "completion" in shown.capabilities and shown.template and shown.details.family
    running = client.ps().models
    assert [m.model for m in running] == [str(tiny_llama)]
    progress = list(client.pull(str(server.copy), stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert any(p.total and p.completed for p in progress)
    name = "tiny-copy"
    assert name in {m.model for m in client.list().models}
    assert client.pull(str(server.copy)).status == "success"  # already here
    # a stopped model a request names starts (--ollama-autostart 2), with its load time
    answer = client.generate(model=f"{name}:latest", prompt="Hi", options=OPTIONS)
    assert answer.load_duration > 0 and answer.eval_count == 6
    (started,) = [m for m in client.ps().models if m.model == name]
    assert started.expires_at is not None  # Ollama's 5 minutes for a model it started
    # a copy made while its source runs: stopped, its own id, the source's files
    assert client.copy(f"{name}:latest", "tiny-copied").status == "success"
    with pytest.raises(ollama.ResponseError) as raised:
        client.copy(name, "tiny-copied")  # the destination exists
    assert raised.value.status_code == 409
    client.chat(model=name, messages=[{"role": "user", "content": "Hi"}], options=OPTIONS,
                keep_alive=0)
    wait_until(lambda: name not in {m.model for m in client.ps().models},
               "keep_alive 0 stopping the model", timeout=60)
    client.delete(name)
    assert name not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as raised:
        client.delete(name)
    assert raised.value.status_code == 404
    # the copy keeps its files when its source goes, and serves the same text
    copied = client.generate(model="tiny-copied", prompt="Hi", options=OPTIONS, keep_alive=0)
    assert copied.response == answer.response
    wait_until(lambda: "tiny-copied" not in {m.model for m in client.ps().models},
               "keep_alive 0 stopping the copy", timeout=60)
    client.delete("tiny-copied")


def test_bad_bodies_are_4xx_in_ollamas_shape(server, tiny_llama):
    model = str(tiny_llama)
    bad = [("/api/generate", b"{"), ("/api/generate", b"[]"),
           ("/api/generate", {"model": model, "prompt": 5}),
           ("/api/generate", {"model": model, "prompt": "x", "context": [-1]}),
           ("/api/generate", {"model": model, "prompt": "x", "stream": "yes"}),
           ("/api/generate", {"model": model, "prompt": "x", "format": 3}),
           ("/api/generate", {"model": model, "prompt": "x", "format": {"type": "nope"}}),
           ("/api/generate", {"model": model, "prompt": "x", "images": "abc"}),
           ("/api/generate", {"model": model, "prompt": "x", "suffix": "y"}),
           ("/api/generate", {"model": model, "prompt": "x", "unknown": 1}),
           ("/api/generate", {"model": 7, "prompt": "x"}),
           ("/api/chat", {"model": model, "messages": "hi"}),
           ("/api/chat", {"model": model, "messages": [{"role": "robot", "content": "x"}]}),
           ("/api/chat", {"model": model, "messages": [{"role": "user", "content": 1}]}),
           ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}]}),
           ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}],
                          "think": True}),
           ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}],
                          "options": {"top_p": 0}}),
           ("/api/show", {}), ("/api/show", {"model": 3}), ("/api/pull", {"model": ""}),
           ("/api/pull", {"model": "x", "stream": 1}), ("/api/copy", {"source": model}),
           ("/api/embed", {"model": "nope"}),
           ("/api/embed", {"model": model, "input": "x", "options": {"num_ctx": 8}}),
           ("/api/embeddings", {"model": model, "prompt": 5})]
    for path, body in bad:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        answer = requests.post(f"{server.url}{path}", timeout=30, **kwargs)
        assert 400 <= answer.status_code < 500, (path, body, answer.text)
        assert set(answer.json()) == {"error"} and answer.json()["error"], (path, body)
    deleted = requests.delete(f"{server.url}/api/delete", json={"model": model}, timeout=30)
    assert deleted.status_code == 400 and "served from a path" in deleted.json()["error"]


def test_embed_and_embeddings_from_all_minilm_pulled_by_short_name(client, server, minilm_dir):
    """all-MiniLM-L6-v2 pulled by its short name (from the cache minilm_dir filled), started by
    the first /api/embed that names it, and stopped by keep_alive 0."""
    from sentence_transformers import SentenceTransformer

    name = "all-minilm-l6-v2"
    assert client.pull(name).status == "success"
    texts = TEXTS[:4]
    embedded = client.embed(model=name, input=texts)
    assert embedded.load_duration > 0 and embedded.prompt_eval_count > len(texts)
    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts)
    for ours, theirs in zip(embedded.embeddings, reference):
        assert len(ours) == 384 and abs(math.sqrt(sum(v * v for v in ours)) - 1) < 1e-4
        # bf16 on the CPU (the server's default); float32 parity is tests/parity's
        assert sum(a * float(b) for a, b in zip(ours, theirs)) > 0.99
    legacy = client.embeddings(model=name, prompt=texts[0]).embedding
    norm = math.sqrt(sum(v * v for v in legacy))
    assert all(abs(v / norm - w) < 1e-4 for v, w in zip(legacy, embedded.embeddings[0]))
    shown = client.show(name)
    assert "embedding" in shown.capabilities and "completion" not in shown.capabilities
    for refused in (lambda: client.embed(model=name, input="word " * 300, truncate=False),
                    lambda: client.generate(model=name, prompt="Hi", options=OPTIONS)):
        with pytest.raises(ollama.ResponseError) as raised:
            refused()
        assert raised.value.status_code == 400, raised.value.error
    assert len(client.embed(model=name, input="word " * 300, keep_alive=0).embeddings[0]) == 384
    wait_until(lambda: name not in {m.model for m in client.ps().models},
               "keep_alive 0 stopping the model", timeout=60)
