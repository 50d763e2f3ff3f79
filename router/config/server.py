"""The server's settings: everything about the router process rather than one model it serves.

Where it listens (HTTP, /metrics, gRPC), who may call it (API key, CORS, body size), where its spans
go, and what tgi-launcher gives it to manage models (its model host, the registry, the defaults of
models started later, the default model's LoRA adapters).
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from router.config.flags import TRUE_FALSE, set_by_launcher, setting

# a LoRA adapter's name is only ever compared, never made a path: any printable text, as TGI
# names an adapter by its id or directory; without quotes and backslashes, a Prometheus label
MAX_ADAPTER_NAME_CHARS = 512
RESERVED_ADAPTER_NAMES = ("tgi",)  # what an OpenAI request gives when it means "the model"


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot name a LoRA adapter, or None.

    The launcher checks --lora-adapters with it before any shard starts; the router, every name
    it is given.
    """
    if (not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME_CHARS
            or not name.isprintable() or name != name.strip() or '"' in name or "\\" in name
            or name in RESERVED_ADAPTER_NAMES):
        return (f"invalid adapter name {str(name)[:200]!r}: printable text of at most "
                f"{MAX_ADAPTER_NAME_CHARS} characters, without quotes, backslashes or spaces at "
                "its ends, and not 'tgi'")
    return None


@dataclass(slots=True)
class ServerSettings:
    """The router process's settings (tgi-router's flags that are about no one model)."""

    hostname: str = setting("0.0.0.0", "Address to listen on.")
    port: int = setting(8080, "HTTP port.")
    prometheus_port: int = setting(None, "Also serve GET /metrics on this port, on --hostname "
                                         "(TGI's flag; TGI listens on 9000 by default, tgi-py "
                                         "only when asked). /metrics stays on --port too.",
                                   shown="none: /metrics on --port only")
    grpc_port: int = setting(None, "Port of the public gRPC API (proto/api.proto: Generate, "
                                   "GenerateStream, Tokenize, Info, Health, with grpc.health.v1 "
                                   "and server reflection), on --hostname.",
                             shown="none: no gRPC server")
    api_key: str = setting(None, "When set, every route but /health, /metrics and the pages "
                                 "(GET / and /docs, which ask for the key) needs "
                                 "'Authorization: Bearer <key>' (without it, /health and /metrics "
                                 "ignore X-Model-Id), and every gRPC call but health checks and "
                                 "reflection the metadata 'authorization: Bearer <key>'.",
                           shown="none: no key asked")
    cors_allow_origin: str = setting(None, "Comma-separated origins allowed by CORS ('*' for "
                                           "any). tgi-launcher also takes the flag once per "
                                           "origin, as TGI does.", shown="none: no CORS headers")
    allowed_local_model_path: str = setting(
        None, "Directories under which POST /v1/models/pull may read a local model directory or "
              ".gguf file, and a LoRA adapter loaded at run time its directory, comma-separated (tgi-launcher also takes the flag once per "
              "directory). A path is compared once its symlinks and '..' are resolved; any other "
              "is refused with a 403 that says nothing of what lies there. tgi-launcher adds its "
              "model cache (TGI_PY_CACHE), the model registry and its own --model-id.",
        shown="none: only tgi-launcher's model cache, registry and --model-id")
    max_images_per_request: int = setting(8, "Most images one request (or one prompt of an "
                                             "SGLang batch) may hold; more get a 4xx. Only a "
                                             "model that takes images (docs/apis.md, Images) "
                                             "takes any.")
    allowed_local_media_path: str = setting(
        None, "Directories (comma-separated) under which an image may name a local file (a "
              "file:// URL or an absolute path; vLLM's flag). A path is compared once its "
              "symlinks and '..' are resolved; any other is refused.",
        shown="none: no local file is read")
    disable_image_fetch: bool = setting(False, "Refuse image http(s) URLs with a 4xx instead of "
                                               "fetching them; data: URLs (and files under "
                                               "--allowed-local-media-path) still serve.")
    allowed_media_domains: str = setting(
        None, "Hosts (comma-separated) the router fetches image URLs from, whatever their "
              "addresses (vLLM's flag); a URL or redirect naming any other gets a 4xx. Without "
              "it, any host whose addresses are all public (no loopback, private, link-local or "
              "reserved address, checked at every redirect).",
        shown="none: any host with public addresses only")
    image_fetch_timeout: float = setting(10.0, "Seconds the router waits for one image URL's "
                                               "whole answer, redirects and body; past them the "
                                               "request gets a 4xx.")
    max_image_bytes: int = setting(20_971_520, "Largest image file in bytes, from a data: URL, "
                                               "a fetched URL or a local file; larger get a 4xx.")
    payload_limit: int = setting(2_000_000, "Largest request body in bytes; larger ones get "
                                            "413.")
    stream_write_timeout: float = setting(30.0, "Seconds a streamed answer (SSE, or a gRPC "
                                                "GenerateStream) may wait for its client to "
                                                "take more: past them the stream ends (gRPC "
                                                "DEADLINE_EXCEEDED; HTTP closes the "
                                                "connection) and its generation is cancelled.")
    otlp_endpoint: str = setting(None, "OTLP gRPC endpoint (http://host:4317) to export trace "
                                       "spans to.", shown="none: no spans exported")
    otlp_service_name: str = setting("tgi-py.router", "service.name of the exported spans.")
    drain_timeout: float = set_by_launcher(15.0, "Seconds the requests in flight get to finish "
                                                 "when the router stops (SIGTERM); each still "
                                                 "running then ends with a 503 (a stream with an "
                                                 "error event). tgi-launcher gives it most of its "
                                                 "--graceful-termination-timeout.")
    # set by tgi-launcher: the model lifecycle routes (pull, start, stop) go through its model host
    model_host_uds_path: str = set_by_launcher(None, "Unix socket of the launcher's model "
                                                     "host.", shown="none: models cannot be "
                                                                    "pulled, started or stopped")
    model_registry_dir: str = set_by_launcher(None, "Directory of the model registry.",
                                              shown="none: nothing is persisted")
    default_model_dtype: str = set_by_launcher("", "dtype of models started without one in "
                                                   "their settings.",
                                               shown="each shard's default for its device, "
                                                     "bfloat16 on a CPU with AVX2")
    default_model_device: str = set_by_launcher("auto", "device of models started without ngl "
                                                        "0.", choices=("cpu", "cuda", "auto"))
    autostart: str = set_by_launcher("false", "true: models running when the registry was last "
                                              "saved start again.", choices=TRUE_FALSE)
    ollama_autostart: int = setting(0, "Ollama's routes (/api/generate, /api/chat) start a "
                                       "stopped model a request names while fewer than this "
                                       "many models run; the models they start stop after "
                                       "their keep_alive (Ollama's 5 minutes) idle. 0: never "
                                       "(such a request gets a 409 saying how to start it).")
    lora_adapters: str = set_by_launcher(None, "LoRA adapters to load into the default model "
                                               "before serving: name=directory pairs, comma "
                                               "separated (a bare directory is named after "
                                               "itself). tgi-launcher resolves its "
                                               "--lora-adapters (Hub ids too) to this.",
                                         shown="none")

    def __post_init__(self):
        for name in ("prometheus_port", "grpc_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be a port number "
                                 "(1-65535)")
        if self.prometheus_port is not None and self.prometheus_port in (self.port,
                                                                          self.grpc_port):
            raise ValueError(f"--prometheus-port {self.prometheus_port} is also the HTTP --port "
                             "or the --grpc-port; pick another (GET /metrics is on --port "
                             "already)")
        if not 0 < self.stream_write_timeout <= 86400:
            raise ValueError(f"--stream-write-timeout {self.stream_write_timeout} must be a "
                             "number of seconds above 0 (at most a day)")
        if not self.drain_timeout >= 0:
            raise ValueError(f"--drain-timeout {self.drain_timeout} must be 0 or more seconds")
        if self.payload_limit < 1:
            raise ValueError(f"--payload-limit {self.payload_limit} must be a positive byte count")
        if self.max_images_per_request < 0:
            raise ValueError(f"--max-images-per-request {self.max_images_per_request} must be "
                             "0 or more")
        if not 0 < self.image_fetch_timeout <= 3600 or self.max_image_bytes < 1:
            raise ValueError(f"--image-fetch-timeout {self.image_fetch_timeout} must be above 0 "
                             f"(at most an hour) and --max-image-bytes {self.max_image_bytes} "
                             "positive")
        if self.grpc_port == self.port:
            raise ValueError(f"--grpc-port {self.grpc_port} is also the HTTP --port; pick another")
        self.autostart = self.autostart.lower()
        if self.autostart not in ("true", "false"):
            raise ValueError(f"--autostart {self.autostart!r} must be true or false")
        if self.ollama_autostart < 0:
            raise ValueError(f"--ollama-autostart {self.ollama_autostart} must be 0 or more")
        self.lora_adapter_dirs()  # its syntax, said at start
        self.media_hosts()

    def media_hosts(self) -> frozenset[str] | None:
        """--allowed-media-domains as lower-case host names; None when not given."""
        if self.allowed_media_domains is None:
            return None
        hosts = frozenset(h.strip().lower().strip("[]")  # an IPv6 address as URLs' hosts hold it
                          for h in self.allowed_media_domains.split(",") if h.strip())
        for host in hosts:
            if ("/" in host or ":" in host) and not _is_address(host):
                raise ValueError(f"--allowed-media-domains {host!r}: give host names (or IP "
                                 "addresses) alone, without a scheme, port or path")
        return hosts

    def lora_adapter_dirs(self) -> list[tuple[str, str]]:
        """--lora-adapters as (name, directory) pairs, in order."""
        pairs: list[tuple[str, str]] = []
        for item in (self.lora_adapters or "").split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, path = item.partition("=")
            if not sep:
                name, path = os.path.basename(item.rstrip("/")), item
            name, path = name.strip(), path.strip()
            if not name or not path:
                raise ValueError(f"--lora-adapters item {item!r}: write name=/path/to/adapter")
            if name in (n for n, _ in pairs):
                raise ValueError(f"--lora-adapters names {name!r} twice; give each adapter its "
                                 "own name")
            pairs.append((name, path))
        return pairs


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
