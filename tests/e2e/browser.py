"""Headless Chromium for a test, driven over the DevTools protocol with aiohttp's websocket client
(no Selenium, no driver binary): open a page, evaluate JavaScript in it, wait for a condition."""
from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# --no-sandbox: Chromium refuses to start as root with its sandbox (CI containers run as root);
# --no-proxy-server: the page talks to a server on loopback, never through http_proxy
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions",
         "--no-proxy-server", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class PageError(AssertionError):
    """A JavaScript exception in an evaluation, or a condition not met in time; it carries
    what the page logged (uncaught errors, console.error) to tell why."""


class Browser:
    """One Chromium process and one page of it."""

    def __init__(self, process: subprocess.Popen, log, profile: tempfile.TemporaryDirectory,
                 session: aiohttp.ClientSession, socket: aiohttp.ClientWebSocketResponse):
        self.process = process
        self._log = log
        self._profile = profile
        self._session = session
        self._socket = socket
        self._ids = itertools.count(1)
        self.page_log: list[str] = []  # uncaught exceptions and console errors, in order

    @classmethod
    async def start(cls, binary: str, *, timeout: float = 20) -> Browser:
        profile = tempfile.TemporaryDirectory(prefix="tgi-py-chromium-")
        # a file, not a pipe: nothing reads Chromium's chatter while it runs
        log = tempfile.TemporaryFile()
        process = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile.name}",
                                    "about:blank"], stdout=subprocess.DEVNULL, stderr=log)
        session = aiohttp.ClientSession()
        try:
            port = await _devtools_port(Path(profile.name), process, log, timeout)
            async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                targets = await reply.json()
            page = next(t for t in targets if t["type"] == "page")
            socket = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await session.close()
            _stop(process, log)
            profile.cleanup()
            raise
        browser = cls(process, log, profile, session, socket)
        await browser.send("Runtime.enable")
        await browser.send("Page.enable")
        return browser

    async def send(self, method: str, **params) -> dict:
        """One DevTools command; its result. Events read meanwhile go to page_log."""
        message_id = next(self._ids)
        await self._socket.send_json({"id": message_id, "method": method, "params": params})
        async for message in self._socket:
            data = json.loads(message.data)
            if data.get("id") == message_id:
                if "error" in data:
                    raise PageError(f"{method}: {data['error']}")
                return data["result"]
            self._note(data)
        raise PageError(f"the browser closed its DevTools socket during {method}")

    def _note(self, event: dict) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.page_log.append(details.get("exception", {}).get("description")
                                 or details.get("text", ""))
        elif event.get("method") == "Runtime.consoleAPICalled" and params["type"] == "error":
            self.page_log.append(" ".join(str(arg.get("value", arg.get("description", "")))
                                          for arg in params["args"]))

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(f"{expression}: "
                            f"{details.get('exception', {}).get('description', details['text'])}")
        return result["result"].get("value")

    async def open(self, url: str, *, timeout: float = 10) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", timeout=timeout)

    async def wait_for(self, expression: str, *, timeout: float = 10):
        """Polls a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"not true after {timeout}s: {expression}\n"
                                f"page errors: {self.page_log}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self._socket.close()
        await self._session.close()
        _stop(self.process, self._log)
        self._profile.cleanup()


async def _devtools_port(profile: Path, process: subprocess.Popen, log, timeout: float) -> int:
    """The port Chromium chose for --remote-debugging-port=0, from the DevToolsActivePort file
    it writes in its profile once it listens."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"chromium exited with {process.returncode}: "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        lines = active.read_text().splitlines() if active.exists() else []
        if lines and lines[0].isdigit():
            return int(lines[0])
        await asyncio.sleep(0.05)
    raise RuntimeError(f"chromium wrote no DevToolsActivePort in {timeout}s")


def _stop(process: subprocess.Popen, log) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()
