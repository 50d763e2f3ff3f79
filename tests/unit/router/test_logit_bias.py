"""OpenAI's and SGLang's logit_bias: checked, then carried to the shard as {token id: bias}."""
import pytest

from tests.unit.router.test_api_errors import HealthyFake, _client
from tests.unit.router.test_hostile_input import _sent_sampling

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", CHAT, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "logit_bias"),
])
async def test_openai_logit_bias_reaches_the_shard(tiny_llama, path, body, field):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        sent = await _sent_sampling(client, fake, path, {**body, field: {"5": -100, "17": 2.5}})
        assert sent.logit_bias == {5: -100.0, 17: 2.5}
        assert (await _sent_sampling(client, fake, path, body)).logit_bias == {}
        sent = await _sent_sampling(client, fake, "/generate", {
            "text": "hi", "sampling_params": {"max_new_tokens": 2, "logit_bias": {"3": 1}}})
        assert sent.logit_bias == {3: 1.0}
    finally:
        await client.close()


@pytest.mark.parametrize("bias,expected", [
    ("5", "must be an object mapping token ids"),
    ({"abc": 1}, "keys must be token ids"),
    ({"-1": 1}, "keys must be token ids"),
    ({"4294967296": 1}, "keys must be token ids"),
    ({"\u0665": 1}, "keys must be token ids"),  # an Arabic-Indic 5
    ({"\uff15": 1}, "keys must be token ids"),  # a full-width 5
    ({"05": 1}, "keys must be token ids"),
    ({"1": 101}, "must be a number >= -100 and <= 100"),
    ({"1": "5"}, "must be a number >= -100 and <= 100"),
    ({"1": True}, "must be a number >= -100 and <= 100"),
])
async def test_a_malformed_logit_bias_is_422(tiny_llama, bias, expected):
    client = await _client(tiny_llama, HealthyFake())
    try:
        reply = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": bias})
        error = await reply.json()
        assert reply.status == 422 and expected in error["error"], error
        reply = await client.post("/generate", json={"text": "hi", "sampling_params": {
            "logit_bias": bias}})
        error = await reply.json()
        assert reply.status == 400 and expected in error["error"]["message"], error  # SGLang's
    finally:
        await client.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})])
async def test_tgis_list_form_biases_the_token_at_each_index(tiny_llama, path, body):
    """TGI's document types logit_bias as a list of floats: the i-th biases token id i."""
    fake = HealthyFake()
    client = await _client(tiny_llama, fake, vocab_size=320)
    try:
        sent = await _sent_sampling(client, fake, path, {**body, "logit_bias": [0, -100, 0.0, 2.5]})
        assert sent.logit_bias == {1: -100.0, 3: 2.5}  # a 0 is no bias, and not sent
        for bias, words in (([0.0] * 321, "at most the model's vocabulary size of 320. Given: 321"),
                            ([0, 101], "`logit_bias[1]` must be a number >= -100 and <= 100"),
                            ([0, "1"], "`logit_bias[1]` must be a number")):
            reply = await client.post(path, json={**body, "logit_bias": bias})
            assert reply.status == 422 and words in (await reply.json())["error"]
        # SGLang's logit_bias is a map only, as SGLang reads it
        reply = await client.post("/generate", json={"text": "hi", "sampling_params": {
            "logit_bias": [0, 1]}})
        assert reply.status in (400, 422) and "must be an object mapping token ids" in \
            (await reply.json())["error"]["message"]
    finally:
        await client.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", lambda bias: {**CHAT, "logit_bias": bias}),
    ("/v1/completions", lambda bias: {"prompt": "hi", "max_tokens": 2, "logit_bias": bias}),
    ("/generate", lambda bias: {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                                  "logit_bias": bias}})])
async def test_an_id_past_the_models_vocabulary_is_422(tiny_llama, path, body):
    client = await _client(tiny_llama, HealthyFake(), vocab_size=320)  # as the shards say
    try:
        reply = await client.post(path, json=body({"7": 1, "320": -5}))
        text = await reply.text()
        # SGLang answers its validation errors with a 400
        assert reply.status == (400 if path == "/generate" else 422), text
        assert "below the model's vocabulary size of 320" in text, text
        reply = await client.post(path, json=body({"7": 1, "319": -5}))
        assert reply.status == 200, await reply.text()
    finally:
        await client.close()


async def test_tgis_routes_send_tgis_frequency_penalty_and_openais_send_openais(tiny_llama):
    """TGI's GenerateParameters' frequency_penalty is TGI's (per share of the sequence); on the
    /v1 routes and SGLang's it is OpenAI's (per occurrence in the output)."""
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        for path, body, tgis in (
                ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                              "frequency_penalty": 0.5}}, True),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                     "frequency_penalty": 0.5}, False),
                ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0.5}, False),
                ("/generate", {"text": "hi", "sampling_params": {
                    "max_new_tokens": 2, "frequency_penalty": 0.5}}, False)):
            sent = await _sent_sampling(client, fake, path, body)
            assert (sent.frequency_penalty, sent.frequency_by_share) == (0.5, tgis), path
    finally:
        await client.close()


async def test_openai_routes_take_vllms_repetition_penalty(tiny_llama):
    fake = HealthyFake()
    client = await _client(tiny_llama, fake)
    try:
        sent = await _sent_sampling(client, fake, "/v1/completions",
                                    {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.3})
        assert abs(sent.repetition_penalty - 1.3) < 1e-6
        for bad in (0, -1, "x"):
            reply = await client.post("/v1/chat/completions", json={**CHAT,
                                                                    "repetition_penalty": bad})
            assert reply.status == 422
    finally:
        await client.close()
