"""Calls between our own processes never go through a proxy: with http_proxy and its kind set to
a port where nothing listens (as on a machine behind a proxy that cannot reach this one's
127.0.0.1), the launcher's readiness check and the router's gRPC channel to a shard over TCP still
reach their servers."""
import http.server
import socket
import threading

import pytest

from launcher.config import parse_args

PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY", "grpc_proxy")


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_proxy(monkeypatch):
    proxy = f"http://127.0.0.1:{_dead_port()}"
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    return proxy


@pytest.fixture
def health_server():
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_readiness_check_ignores_proxy_variables(dead_proxy, health_server, tmp_path,
                                                     monkeypatch):
    import urllib.error
    import urllib.request

    from launcher.supervisor import Supervisor

    for name in ("HOSTNAME", "PORT"):
        monkeypatch.delenv(name, raising=False)
    config = parse_args(["--hostname", "0.0.0.0", "--port", str(health_server)])
    assert Supervisor(config, tmp_path, "m")._router_healthy()
    # what it checks: an opener that honours the variables gets nowhere (a new one: urlopen's
    # own was built, with the proxies of its day, by whichever test opened a URL first)
    with pytest.raises(urllib.error.URLError):
        urllib.request.build_opener().open(f"http://127.0.0.1:{health_server}/health", timeout=2)


async def test_the_routers_channel_to_a_shard_over_tcp_ignores_proxy_variables(dead_proxy):
    import grpc

    from proto import generate_pb2 as pb
    from proto import generate_pb2_grpc as pb_grpc
    from router.shards.client import ShardClient

    class Shard(pb_grpc.TextGenerationServiceServicer):
        async def Health(self, request, context):
            return pb.HealthResponse()

    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServiceServicer_to_server(Shard(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ShardClient(f"127.0.0.1:{port}")
    try:
        await client.call("Health", pb.HealthRequest(), timeout=5)
        # what it checks: a channel that honours the variables gets nowhere
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as proxied:
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.TextGenerationServiceStub(proxied).Health(pb.HealthRequest(),
                                                                        timeout=5)
    finally:
        await client.close()
        await server.stop(None)
