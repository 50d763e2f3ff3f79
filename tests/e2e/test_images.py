"""Images through the real launcher, router and shards, with a tiny random Gemma 3 VLM.

What the router does with images, over real HTTP: where they come from (a local image server for
fetched URLs), the 4xx of bad ones while the server keeps serving, their tokens (/chat_tokenize,
usage), SGLang's cached_tokens keyed on image content, and /info and /v1/models saying the model
takes images. The last test (marked) checks the image reaches the model: it needs the shard side.
"""
from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from PIL import Image

from tests.e2e.server import launch
from tests.image_files import bomb_png, data_url, image_bytes, truncated_png
from tests.tiny_models import build_tiny_gemma3_vlm

pytestmark = pytest.mark.e2e

CAT, DOG = image_bytes(20, 12, color=(250, 10, 10)), image_bytes(12, 20, color=(10, 10, 250))
SOFT_TOKEN = "<image_soft_token>"


class _Images(BaseHTTPRequestHandler):
    """/cat.png, a slow one, an HTML page, a redirect loop."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(3)
        body, kind = (b"<html></html>", "text/html") if self.path == "/page" else (CAT,
                                                                                  "image/png")
        try:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router gave up first (the slow one)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"), with_weights=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The directory --allowed-local-media-path names, with cat.png."""
    directory = tmp_path_factory.mktemp("media")
    (directory / "cat.png").write_bytes(CAT)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, media, tmp_path_factory):
    launched = launch(["--model-id", str(model_dir)], tmp_path_factory.mktemp("images"),
                      extra=["--dtype", "float32", "--block-size", "4", "--max-input-tokens",
                             "400", "--max-total-tokens", "512", "--max-images-per-request", "2",
                             "--image-fetch-timeout", "1", "--allowed-local-media-path",
                             str(media), "--allowed-media-domains", "127.0.0.1"])
    yield launched
    assert launched.stop() == 0


def _chat(*urls, text="What is it?", **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 3, "temperature": 0, **fields}


def _post(server, path, body):
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def test_the_model_says_it_takes_images(server):
    assert requests.get(f"{server.url}/info", timeout=10).json()["takes_images"] is True
    (model,) = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert model["metadata"]["takes_images"] is True


def test_images_from_each_source_become_their_tokens(server, images_url, media):
    local = str(media / "cat.png")
    for url in (data_url(CAT), f"{images_url}/cat.png", local, f"file://{local}"):
        tokens = _post(server, "/chat_tokenize", _chat(url)).json()
        text = tokens["templated_text"]
        assert text.count(SOFT_TOKEN) == 4 and "\n\n<start_of_image>" in text, url
        reply = _post(server, "/v1/chat/completions", _chat(url))
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(tokens["tokenize_response"])
    tgi = _post(server, "/generate", {"inputs": f"![]({images_url}/cat.png) Hi",
                                      "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 200, tgi.text


@pytest.mark.parametrize("url, words", [
    (data_url(b"no picture here"), "is not an image"),
    (data_url(truncated_png()), "truncated or corrupt"),
    ("data:image/png;base64,", "is empty (0 bytes)"),
    (data_url(bomb_png()), "decompression bomb"),
    ("/slow.png", "did not answer within 1 s"),
    ("/page", "content type 'text/html', not an image"),
    ("/loop", "redirects more than 5 times"),
    ("http://127.0.0.1:9/a.png", "could not be fetched"),
    ("http://169.254.169.254/latest/meta-data", "not one this server fetches images from"),
    ("/etc/hostname", "not under --allowed-local-media-path"),
])
def test_bad_images_are_422s_naming_the_problem(server, images_url, url, words):
    if url.startswith("/") and not url.startswith("/etc"):
        url = images_url + url
    reply = _post(server, "/v1/chat/completions", _chat(url))
    assert reply.status_code == 422, reply.text
    assert words in reply.json()["error"] and "messages[0].content[0].image_url" in \
        reply.json()["error"]
    too_many = _post(server, "/v1/chat/completions", _chat(*[data_url(CAT)] * 3))
    assert too_many.status_code == 422 and "--max-images-per-request" in too_many.json()["error"]
    assert _post(server, "/v1/chat/completions", _chat(data_url(CAT))).status_code == 200


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(server):
    def cached(image: bytes) -> tuple[int, int]:
        reply = _post(server, "/generate", {
            "text": "<start_of_image> Describe the picture in a few words, please.",
            "image_data": data_url(image), "sampling_params": {"max_new_tokens": 1}})
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        return meta["cached_tokens"], meta["prompt_tokens"]

    cached(CAT)
    again, prompt_tokens = cached(CAT)
    other, _ = cached(DOG)
    assert again >= prompt_tokens - 4, "the same image: all but the last block from the cache"
    assert other < 8, "another image: nothing from its first image token on"


@pytest.fixture
async def browser():
    from tests.e2e.browser import Browser, find_chromium

    if find_chromium() is None:
        pytest.skip("no chromium on PATH (tests/e2e/test_playground_browser.py installs one)")
    started = await Browser.start(find_chromium())
    yield started
    await started.close()


async def test_the_page_attaches_an_image_to_a_message(server, browser):
    await browser.open(f"{server.url}/")
    await browser.wait_for("!document.getElementById('image').disabled")  # it takes images
    await browser.evaluate(f"""(() => {{
        window.sent = [];
        const fetched = window.fetch;
        window.fetch = (path, options) => {{ window.sent.push(options?.body); return fetched(path, options); }};
        const bytes = Uint8Array.from(atob("{base64.b64encode(CAT).decode()}"), c => c.charCodeAt(0));
        const files = new DataTransfer();
        files.items.add(new File([bytes], "cat.png", {{type: "image/png"}}));
        document.getElementById("image").files = files.files;
        document.getElementById("max-tokens").value = "3";
        document.getElementById("prompt").value = "What is it?";
        document.getElementById("send").click();
    }})()""")
    answers = "[...document.querySelectorAll('.message.assistant .content')].map(e => e.textContent)"
    await browser.wait_for(f"!document.getElementById('send').disabled && {answers}.length === 1"
                           f" && {answers}[0].length > 0")
    body = json.loads(await browser.evaluate("window.sent.at(-1)"))
    image, text = body["messages"][-1]["content"]
    assert image == {"type": "image_url", "image_url": {"url": data_url(CAT)}}
    assert text == {"type": "text", "text": "What is it?"}
    assert await browser.evaluate("document.querySelector('.message.user img.attached').src") \
        == data_url(CAT)
    assert await browser.evaluate("document.getElementById('error').hidden")
    assert await browser.evaluate("document.getElementById('image').value") == ""


def test_the_greedy_answer_with_an_image_is_transformers(server, model_dir):
    """The server's greedy tokens for a prompt with an image are transformers' own."""
    import torch
    import transformers

    inputs = f"![]({data_url(CAT)}) Describe it:"
    ids = [t["id"] for t in _post(server, "/tokenize", {"inputs": inputs}).json()]
    reply = _post(server, "/generate", {"inputs": inputs, "parameters": {
        "max_new_tokens": 6, "details": True, "decoder_input_details": True}}).json()
    ours = [t["id"] for t in reply["details"]["tokens"]]
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    pixels = processor(images=[Image.open(io.BytesIO(CAT))], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, pixel_values=pixels,
                             token_type_ids=(input_ids == model.config.image_token_index).long(),
                             attention_mask=torch.ones_like(input_ids), max_new_tokens=6,
                             do_sample=False)
    assert ours == out[0, len(ids):].tolist()


def test_ollamas_images_are_the_same_prompt_as_openais(server):
    """Ollama's base64 `images` (the ollama client's) reach the template as OpenAI's parts do."""
    import ollama

    client = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": 3, "repeat_penalty": 1.0}
    chat = client.chat(model="gemma", options=options, messages=[
        {"role": "user", "content": "What is it?", "images": [CAT]}])
    openai = _post(server, "/v1/chat/completions", _chat(data_url(CAT))).json()
    assert chat.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert chat.message.content == openai["choices"][0]["message"]["content"]
    generated = client.generate(model="gemma", prompt="What is it?", images=[CAT, DOG],
                                options=options)
    assert generated.prompt_eval_count > chat.prompt_eval_count
    with pytest.raises(ollama.ResponseError) as raised:
        client.generate(model="gemma", prompt="What is it?", images=[b"no picture here"])
    assert raised.value.status_code == 400 and "is not an image" in raised.value.error
