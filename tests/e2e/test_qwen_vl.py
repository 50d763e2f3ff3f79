"""Qwen2.5-VL through the real launcher, router and shards, with a tiny random checkpoint.

An image's tokens depend on its size (dynamic resolution): the chat template's
<|vision_start|><|image_pad|><|vision_end|> holds one <|image_pad|> per token, the prompt limit
counts them, and the greedy answer to an OpenAI chat with an image is transformers' own.
"""
from __future__ import annotations

import io

import pytest
import requests
from PIL import Image

from tests.e2e.server import launch
from tests.image_files import data_url, truncated_png
from tests.parity.test_gemma3_vision_parity import image_bytes
from tests.tiny_models import QWEN_VL_PIXELS, build_tiny_qwen2_5_vl

pytestmark = pytest.mark.e2e

# 40x24 pixels: 5x3 tokens of 8x8 pixels; 16x64: 2x8; 1000x4: refused (past 200:1)
WIDE, TALL = image_bytes(40, 24, "PNG", 1), image_bytes(16, 64, "JPEG", 2)
PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    launched = launch(["--model-id", str(model_dir)], tmp_path_factory.mktemp("qwen-vl"),
                      extra=["--dtype", "float32", "--block-size", "4", "--max-input-tokens",
                             "60", "--max-total-tokens", "80", "--max-images-per-request", "3"])
    yield launched
    assert launched.stop() == 0


def _chat(*images: bytes, text="What is it?", **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 6, "temperature": 0, **fields}


def _post(server, path, body):
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def test_each_images_tokens_follow_its_size(server):
    """Two images of other shapes: 15 and 16 tokens, each between its start and end tokens;
    usage counts them, and TGI's markdown image is the same tokens. /info and /v1/models say
    the model takes images."""
    assert requests.get(f"{server.url}/info", timeout=10).json()["takes_images"] is True
    (model,) = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert model["metadata"]["takes_images"] is True
    markdown = _post(server, "/tokenize", {"inputs": f"![]({data_url(TALL)}) Hi"}).json()
    assert [t["text"] for t in markdown].count(PAD) == 16
    tokens = _post(server, "/chat_tokenize", _chat(WIDE, TALL)).json()
    text = tokens["templated_text"]
    spans = [part.split("<|vision_end|>")[0] for part in text.split("<|vision_start|>")[1:]]
    assert spans == [PAD * 15, PAD * 16]
    reply = _post(server, "/v1/chat/completions", _chat(WIDE, TALL))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(tokens["tokenize_response"])


def test_an_images_tokens_count_against_the_prompt_limit(server):
    """48 tokens of a large image and 15 of a small one pass the 80 tokens a request may hold:
    a 422 that says so; the same text with the small image alone is served."""
    big = image_bytes(400, 300, "PNG", 3)
    reply = _post(server, "/v1/chat/completions", _chat(big, WIDE))
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert "must be <= 80. Given: " in error, error
    assert int(error.split("Given: ")[1].split()[0]) >= 48 + 15  # both images' tokens
    assert _post(server, "/v1/chat/completions", _chat(WIDE)).status_code == 200


@pytest.mark.parametrize("data, words", [
    (b"no picture here", "is not an image"),
    (truncated_png(), "truncated or corrupt"),
    (image_bytes(1000, 4, "PNG", 4), "more elongated than 200:1"),
], ids=["not-an-image", "truncated", "elongated"])
def test_bad_images_are_422s_and_the_server_keeps_serving(server, data, words):
    reply = _post(server, "/v1/chat/completions", _chat(data))
    assert reply.status_code == 422, reply.text
    assert words in str(reply.json()["error"])
    too_many = _post(server, "/v1/chat/completions", _chat(*[TALL] * 4))
    assert too_many.status_code == 422 and "--max-images-per-request" in too_many.json()["error"]
    assert _post(server, "/v1/chat/completions", _chat(TALL)).status_code == 200


def test_the_greedy_answer_to_a_chat_with_an_image_is_transformers(server, model_dir):
    """OpenAI chat with an image_url data URL: transformers' greedy tokens for the same prompt."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    body = _chat(WIDE, text="Describe it:", logprobs=True)
    ids = [t["id"] for t in _post(server, "/chat_tokenize", body).json()["tokenize_response"]]
    reply = _post(server, "/v1/chat/completions", body).json()
    ours = [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pixels = Qwen2VLImageProcessorPil(**QWEN_VL_PIXELS)(Image.open(io.BytesIO(WIDE)),
                                                         return_tensors="pt")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"],
                             mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                             attention_mask=torch.ones_like(input_ids), max_new_tokens=6,
                             do_sample=False, pad_token_id=2)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"))
    expected = [tokenizer.decode([t]) for t in out[0, len(ids):].tolist()]
    assert ours == expected


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(server):
    """SGLang's image_data: the same image again is served from the cache, with the answer it
    had uncached (the text after the image keeps its positions); another one of the same size
    (the same tokens) is not."""
    other = image_bytes(40, 24, "PNG", 7)

    def cached(image: bytes) -> tuple[int, int, str]:
        reply = _post(server, "/generate", {
            "text": "<|vision_start|><|image_pad|><|vision_end|> Describe the picture, please.",
            "image_data": data_url(image),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        return meta["cached_tokens"], meta["prompt_tokens"], reply.json()["text"]

    _, _, first = cached(WIDE)
    again, prompt_tokens, text = cached(WIDE)
    assert text == first
    different, _, _ = cached(other)
    assert again >= prompt_tokens - 4, "the same image: all but the last block from the cache"
    assert different < 4, "another image: nothing from its first image token on"
