"""The page at / in headless Chromium, against tgi-launcher on a tiny random Llama with --api-key:
the page asks for the key, lists the model, streams an answer whole and shows its tokens/s, and
its stop button ends a long answer; /docs renders Swagger UI over our OpenAPI document."""
import json
import subprocess
from pathlib import Path

import pytest
import requests

from tests.e2e.browser import Browser, find_chromium
from tests.e2e.server import launch

pytestmark = pytest.mark.e2e
INSTALL_BROWSER = Path(__file__).resolve().parents[2] / "scripts" / "install-browser.sh"

KEY = "playground-key"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    launched = launch(["--model-id", str(tiny_llama)], tmp_path_factory.mktemp("playground"),
                      extra=["--api-key", KEY, "--dtype", "float32"])
    yield launched
    assert launched.stop() == 0, launched.log()


@pytest.fixture(scope="module")
def chromium():
    """Debian's chromium, installed by the test run where it is missing (not by install.sh, which
    also installs a server); a machine where it cannot be skips, saying why."""
    if find_chromium() is None:
        said = subprocess.run(["bash", str(INSTALL_BROWSER)], capture_output=True, text=True,
                              timeout=600)
        if find_chromium() is None:
            pytest.skip(f"no chromium on PATH, and {INSTALL_BROWSER.name} installed none: "
                        f"{said.stderr.strip()[-300:]}")
    return find_chromium()


@pytest.fixture
async def browser(chromium):
    started = await Browser.start(chromium)
    yield started
    await started.close()


def _greedy_answer(server, max_tokens: int) -> str:
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tgi", "max_tokens": max_tokens, "temperature": 0,
                                "messages": [{"role": "user", "content": PROMPT}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


async def _send(browser, text: str, *, max_tokens: int) -> None:
    await browser.evaluate(f"""(() => {{
        document.getElementById("temperature").value = "0";
        document.getElementById("max-tokens").value = "{max_tokens}";
        document.getElementById("prompt").value = {json.dumps(text)};
        document.getElementById("send").click();
    }})()""")


async def _store_key(browser, server) -> None:
    """The key in the origin's storage, as the page leaves it once asked."""
    await browser.open(f"{server.url}/ui/style.css")  # the origin, without running the page
    await browser.evaluate(f"localStorage.setItem('tgi-py.api-key', '{KEY}')")


ANSWERS = "[...document.querySelectorAll('.message.assistant .content')].map(e => e.textContent)"
IS_IDLE = "!document.getElementById('send').disabled"


async def test_the_page_asks_for_the_key_lists_the_model_and_streams_an_answer(server, browser):
    await browser.open(f"{server.url}/")
    # /v1/models answered 401: the page asks for the key before it can list anything
    await browser.wait_for("document.getElementById('key-dialog').open")
    # typed, then Enter: as a person answers it
    assert await browser.evaluate("document.activeElement.id") == "key-input"
    await browser.send("Input.insertText", text=KEY)
    enter = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
    await browser.send("Input.dispatchKeyEvent", type="keyDown", text="\r", **enter)
    await browser.send("Input.dispatchKeyEvent", type="keyUp", **enter)
    rows = await browser.wait_for("""(() => {
        const rows = [...document.querySelectorAll('#models tbody tr')];
        return rows.length && rows.map(r => [...r.cells].map(c => c.textContent));
    })()""")
    model_id = requests.get(f"{server.url}/v1/models", timeout=10,
                            headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    assert rows == [[model_id, "running", "Stop"]]
    assert await browser.evaluate("document.getElementById('model').value") == model_id
    assert await browser.evaluate("localStorage.getItem('tgi-py.api-key')") == KEY

    await _send(browser, PROMPT, max_tokens=12)
    stats = await browser.wait_for(f"{IS_IDLE} && document.getElementById('stats').textContent")
    assert await browser.evaluate(ANSWERS) == [_greedy_answer(server, 12)]
    assert "12 tokens" in stats and "tokens/s" in stats, stats
    assert float(stats.split(" tokens/s")[0].rsplit(" ", 1)[-1]) > 0

    # in a new chat, a long answer stopped at its first tokens: what came stays (tried again
    # where a fast machine ended all 400 tokens before the click)
    for _ in range(3):
        await browser.evaluate("document.getElementById('clear').click()")
        assert await browser.evaluate(ANSWERS) == []
        await _send(browser, PROMPT, max_tokens=400)
        await browser.wait_for(f"{ANSWERS}.length === 1 && {ANSWERS}[0].length > 0")
        await browser.evaluate("document.getElementById('stop').click()")
        await browser.wait_for(IS_IDLE)
        if await browser.evaluate(
                "document.querySelector('.message.assistant').classList.contains('stopped')"):
            break
    else:
        pytest.fail("each answer ended before its stop button was clicked")
    stopped = await browser.evaluate(ANSWERS + "[0]")
    whole = _greedy_answer(server, 400)
    assert stopped and whole.startswith(stopped) and len(stopped) < len(whole)
    assert await browser.evaluate("document.getElementById('error').hidden")
    assert browser.page_log == []


async def test_an_error_from_the_server_is_shown(server, browser):
    await _store_key(browser, server)
    await browser.open(f"{server.url}/")
    await browser.wait_for("document.querySelectorAll('#models tbody tr').length")
    await _send(browser, PROMPT, max_tokens=100000)  # past the model's context: a 422
    error = await browser.wait_for(f"{IS_IDLE} && !document.getElementById('error').hidden && "
                                   "document.getElementById('error').textContent")
    # the body's message, as the router wrote it
    assert error.startswith("422: Input validation error: ") and "100000" in error, error
    assert await browser.evaluate(
        "document.querySelector('.message.assistant').classList.contains('failed')")


async def test_a_model_pulled_from_the_page_shows_up_ready_to_start(server, browser,
                                                                    tiny_llama):
    await _store_key(browser, server)
    await browser.open(f"{server.url}/")
    await browser.wait_for("document.querySelectorAll('#models tbody tr').length")
    await browser.evaluate("""(() => {
        document.getElementById("pull-source").value = %s;
        document.getElementById("pull-id").value = "pulled";
        document.getElementById("pull").click();
    })()""" % json.dumps(str(tiny_llama)))
    status = await browser.wait_for("document.getElementById('pull-status').textContent")
    assert status.startswith("pulling ") and "as pulled" in status
    # the page polls while the model downloads
    row = "document.querySelector('#models tr[data-id=\"pulled\"]')"
    cells = await browser.wait_for(f"""{row}?.cells[1].textContent === 'downloaded'
        && [...{row}.cells].map(c => c.textContent)""", timeout=30)
    assert cells == ["pulled", "downloaded", "Start"]
    options = await browser.evaluate("[...document.getElementById('model').options]"
                                     ".map(o => o.textContent)")
    assert "pulled (downloaded)" in options
    assert browser.page_log == []


async def test_docs_render_swagger_ui_over_our_document(server, browser):
    await _store_key(browser, server)
    await browser.open(f"{server.url}/docs")
    title = await browser.wait_for(
        "document.querySelector('.swagger-ui .info .title')?.textContent")
    assert title.startswith("tgi-py")
    paths = await browser.wait_for("""(() => {
        const paths = [...document.querySelectorAll('.opblock-summary-path')];
        return paths.length && paths.map(p => p.textContent.replace(/\\u200b/g, ''));
    })()""")
    assert {"/generate", "/v1/chat/completions", "/docs"} <= set(paths)
    assert browser.page_log == []
