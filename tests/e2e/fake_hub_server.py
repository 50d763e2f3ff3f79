"""A Hugging Face Hub on loopback serving a directory's repositories, for HF_ENDPOINT.

`root/<owner>/<repo>/<files>` is served as that repository at every revision: its file list
(`/api/models/<owner>/<repo>/tree/<revision>`, as list_repo_files reads it) and its files
(`/<owner>/<repo>/resolve/<revision>/<path>`, HEAD with the headers hf_hub_download needs, and GET).
The launcher's pulls reach it as they would reach the Hub, which the test machines cannot."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHubServer:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def log_message(self, *args):
                pass

            def _answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                parts = [unquote(p) for p in urlsplit(self.path).path.split("/") if p]
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                    data = json.dumps(hub.tree(parts[2], parts[3])).encode()
                    return self._send(200, data, {"Content-Type": "application/json"}, body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    path = hub.root / parts[0] / parts[1] / "/".join(parts[4:])
                    if ".." not in parts and path.is_file():
                        data = path.read_bytes()
                        etag = hashlib.sha256(data).hexdigest()
                        return self._send(200, data, {"X-Repo-Commit": COMMIT,
                                                      "ETag": f'"{etag}"'}, body)
                self._send(404, b'{"error": "Entry not found"}',
                           {"X-Error-Code": "EntryNotFound"}, body)

            def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def tree(self, owner: str, repo: str) -> list[dict]:
        base = self.root / owner / repo
        return [{"type": "file", "path": p.relative_to(base).as_posix(), "size": p.stat().st_size,
                 "oid": _sha1(p)} for p in sorted(base.rglob("*")) if p.is_file()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sha1(path: Path) -> str:
    with open(path, "rb") as file:  # in pieces: a repository may hold a huge (sparse) file
        return hashlib.file_digest(file, "sha1").hexdigest()
