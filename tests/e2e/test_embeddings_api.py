"""Embeddings end to end on a tiny Qwen3-Embedding-style model that also generates: OpenAI's
/v1/embeddings through its SDK (every input form, base64, dimensions, usage), SGLang's inputs,
TEI's /embed and its gRPC twin, generation beside embeddings, every answer against the OpenAPI
document, and embeddings asked while the shard restarts."""
import base64
import math
import os
import signal
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import requests

from proto import api_pb2, api_pb2_grpc
from tests.e2e.server import free_port, launch
from tests.embedding_models import TEXTS, build_tiny_bert, build_tiny_qwen3_embedding
from tests.openapi_schemas import answer_problems

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_embedding(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    grpc_port = free_port()
    launched = launch(["--model-id", str(model_dir), "--dtype", "float32"],
                      tmp_path_factory.mktemp("embeddings-api"),
                      extra=["--grpc-port", str(grpc_port)])
    launched.grpc_target = f"127.0.0.1:{grpc_port}"
    yield launched
    assert launched.stop() == 0, launched.log()[-5000:]


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def _norm(vector) -> float:
    return math.sqrt(sum(v * v for v in vector))


def _close(a, b, tolerance=1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tolerance for x, y in zip(a, b))


def test_every_openai_input_form_gives_the_same_normalized_vectors(sdk, model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tokenizer.encode(text).ids for text in TEXTS[:3]]
    texts = sdk.embeddings.create(model="any", input=TEXTS[:3])
    assert [d.index for d in texts.data] == [0, 1, 2] and texts.object == "list"
    assert texts.usage.prompt_tokens == texts.usage.total_tokens == sum(map(len, ids))
    vectors = [d.embedding for d in texts.data]
    assert all(len(v) == 64 and abs(_norm(v) - 1) < 1e-5 for v in vectors)  # 2_Normalize
    assert not _close(vectors[0], vectors[1])
    by_ids = sdk.embeddings.create(model="any", input=ids)
    one = sdk.embeddings.create(model="any", input=TEXTS[1])
    one_ids = sdk.embeddings.create(model="any", input=ids[2])
    assert all(_close(a.embedding, b) for a, b in zip(by_ids.data, vectors))
    assert _close(one.data[0].embedding, vectors[1]) and _close(one_ids.data[0].embedding,
                                                                  vectors[2])
    # the SDK asks for base64 by default and decodes it; decoded by hand, the same float32s
    raw = requests.post(f"{sdk.base_url}embeddings", timeout=30, json={
        "input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack("<64f", base64.b64decode(raw))
    assert _close(decoded, vectors[0])


def test_dimensions_and_refusals_in_openai_shape(sdk):
    whole = sdk.embeddings.create(model="any", input="hello", dimensions=64)
    assert len(whole.data[0].embedding) == 64
    for ask in (dict(input=""), dict(input=[[1, 99999]]), dict(input="x " * 300)):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            sdk.embeddings.create(**{"model": "any", "input": "hello", **ask})
        assert caught.value.param == "input", ask
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        sdk.embeddings.create(model="any", input="hello", dimensions=16)


def test_vllm_truncation_and_sglang_text_objects(server):
    url = f"{server.url}/v1/embeddings"
    long = "the quick brown fox " * 100
    kept = requests.post(url, timeout=30, json={"input": long, "truncate_prompt_tokens": 8})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 8
    sglang = requests.post(url, timeout=30, json={"input": [{"text": TEXTS[0]}]}).json()
    plain = requests.post(url, timeout=30, json={"input": TEXTS[0]}).json()
    assert _close(sglang["data"][0]["embedding"], plain["data"][0]["embedding"])
    image = requests.post(url, timeout=30, json={"input": [{"text": "a", "image": "x.png"}]})
    assert image.status_code == 422 and "images" in image.json()["error"]


def test_tei_embed_normalizes_unless_told_and_truncates_when_asked(server):
    url = f"{server.url}/embed"
    normalized = requests.post(url, timeout=30, json={"inputs": TEXTS[:2]}).json()
    raw = requests.post(url, timeout=30, json={"inputs": TEXTS[:2], "normalize": False}).json()
    assert all(abs(_norm(v) - 1) < 1e-5 for v in normalized)
    assert _close([x / _norm(raw[0]) for x in raw[0]], normalized[0])
    long = "the quick brown fox " * 100
    refused = requests.post(url, timeout=30, json={"inputs": long})
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    assert "256" in refused.json()["error"]  # sentence_bert_config.json's max_seq_length
    cut = requests.post(url, timeout=30, json={"inputs": long, "truncate": True})
    assert cut.status_code == 200 and len(cut.json()[0]) == 64


def test_generation_streams_on_beside_many_embeddings(server):
    """The model generates as well; a stream keeps going while embedding calls interleave."""
    tokens, done = [], threading.Event()

    def stream():
        body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 40,
                                                     "ignore_eos_token": True}}
        with requests.post(f"{server.url}/generate_stream", json=body, stream=True,
                           timeout=120) as reply:
            tokens.extend(line for line in reply.iter_lines() if line.startswith(b"data:"))
        done.set()

    reader = threading.Thread(target=stream)
    reader.start()
    batch = [f"{text} {i}" for i in range(8) for text in TEXTS]
    answers = [requests.post(f"{server.url}/v1/embeddings", timeout=60, json={"input": batch})
               for _ in range(3)]
    reader.join(120)
    assert done.is_set() and len(tokens) == 40
    assert all(a.status_code == 200 and len(a.json()["data"]) == 80 for a in answers)
    # the same inputs, whatever ran beside them (beside a stream, a decoder's input may go in
    # chunks: the same vector, to float32 rounding)
    first, last = (a.json()["data"] for a in (answers[0], answers[2]))
    assert all(_close(a["embedding"], b["embedding"]) for a, b in zip(first, last))
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["embedding"] for m in models] == [True]


def test_answers_are_what_the_openapi_document_says(server):
    doc = requests.get(f"{server.url}/api-doc/openapi.json", timeout=10).json()
    for path, body in (("/v1/embeddings", {"input": ["a", "b"]}),
                       ("/v1/embeddings", {"input": [1, 2], "encoding_format": "base64"}),
                       ("/v1/embeddings", {"input": "a", "dimensions": 8}),
                       ("/embed", {"inputs": "a"}), ("/embed", {"inputs": 5})):
        reply = requests.post(f"{server.url}{path}", json=body, timeout=30)
        assert answer_problems(doc, path, "post", reply) == [], (path, body, reply.text)


def test_grpc_embed_answers_as_embed_does(server):
    """The public gRPC API's Embed: one text, TEI's fields and defaults, /embed's vector and
    refusals (INVALID_ARGUMENT for the input, FAILED_PRECONDITION for what the model lacks)."""
    url = f"{server.url}/embed"
    long = "the quick brown fox " * 100
    asks = [({}, {}), ({"normalize": False}, {"normalize": False}),
            ({"truncate": True, "truncation_direction": api_pb2.TRUNCATION_DIRECTION_LEFT},
             {"truncate": True, "truncation_direction": "Left"})]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = api_pb2_grpc.TextGenerationStub(channel)
        for ask, body in asks:
            text = long if body.get("truncate") else TEXTS[3]
            reply = stub.Embed(api_pb2.EmbedRequest(inputs=text, **ask), timeout=60)
            (http,) = requests.post(url, json={"inputs": text, **body}, timeout=30).json()
            assert _close(reply.embeddings, http), ask
        tokens = requests.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[3]},
                               timeout=30).json()["usage"]["prompt_tokens"]
        metadata = stub.Embed(api_pb2.EmbedRequest(inputs=TEXTS[3]), timeout=60).metadata
        assert (metadata.compute_chars, metadata.compute_tokens) == (len(TEXTS[3]), tokens)
        assert metadata.total_time_ns > 0
        for ask, code in (({"inputs": ""}, grpc.StatusCode.INVALID_ARGUMENT),
                          ({"inputs": long}, grpc.StatusCode.INVALID_ARGUMENT),
                          ({"inputs": "a", "dimensions": 16},
                           grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(api_pb2.EmbedRequest(**ask), timeout=60)
            assert caught.value.code() == code, ask
            http = requests.post(url, json=ask, timeout=30).json()["error"]
            assert caught.value.details() == http, ask


def test_embeddings_sent_right_after_the_shard_is_killed_are_served_by_the_new_one(server):
    """They wait for the restarted shard, as generation requests do, and get the same vectors.

    The server is whole again afterwards: later tests may share it."""
    before = requests.post(f"{server.url}/embed", json={"inputs": TEXTS[:2]}, timeout=30).json()
    (old_pid,) = server.shard_pids().values()
    os.kill(old_pid, signal.SIGKILL)
    with ThreadPoolExecutor(3) as pool:
        tei = pool.submit(requests.post, f"{server.url}/embed", json={"inputs": TEXTS[:2]},
                          timeout=150)
        sdk = pool.submit(requests.post, f"{server.url}/v1/embeddings",
                          json={"input": TEXTS[1]}, timeout=150)
        with pytest.raises(requests.Timeout):  # a client that leaves while it waits
            requests.post(f"{server.url}/embed", json={"inputs": "gone"}, timeout=0.5)
        assert tei.result().status_code == 200, tei.result().text
        assert sdk.result().status_code == 200, sdk.result().text
    assert all(_close(a, b) for a, b in zip(tei.result().json(), before))
    assert _close(sdk.result().json()["data"][0]["embedding"], before[1])
    assert server.shard_pids() and old_pid not in server.shard_pids().values()
    assert "restarting the shard group" in server.log()


def test_an_encoder_served_with_quantize_int8_embeds_as_in_float32(tmp_path):
    """A BERT encoder started with --quantize int8 (fbgemm's int8 matmuls, shard.layers.
    int8_dynamic): /v1/embeddings and TEI's /embed answer the same vectors, within int8's
    rounding of sentence-transformers' float32 ones; /info and the log name the form."""
    from sentence_transformers import SentenceTransformer

    model_dir = build_tiny_bert(tmp_path / "bert")
    launched = launch(["--model-id", str(model_dir), "--quantize", "int8"], tmp_path / "server")
    try:
        openai_answer = requests.post(f"{launched.url}/v1/embeddings", timeout=60,
                                      json={"input": TEXTS[:4]})
        tei_answer = requests.post(f"{launched.url}/embed", timeout=60,
                                   json={"inputs": TEXTS[:4]})
        info = requests.get(f"{launched.url}/info", timeout=10).json()
        log = launched.log()
    finally:
        assert launched.stop() == 0
    assert openai_answer.status_code == 200 and tei_answer.status_code == 200
    assert info["quantization"] == "int8 (--quantize)" and info["model_dtype"] == "float32"
    assert "int8 encoder: fbgemm's int8 matmuls" in log
    assert "int8 weights: 8 of 8 linear layers quantized" in log
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS[:4])
    for ours, by_tei, theirs in zip(openai_answer.json()["data"], tei_answer.json(), reference):
        assert _close(ours["embedding"], by_tei)
        # both normalized; 0.9995 at the least in tests/parity (0.9989 with 7-bit activations)
        assert sum(a * float(b) for a, b in zip(by_tei, theirs)) > 0.997
