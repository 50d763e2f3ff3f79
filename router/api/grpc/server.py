"""The public gRPC API's server: its transport settings, and its life inside the aiohttp app's.

The calls themselves are router/api/grpc/service.py's.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.api.grpc.service import (SERVICE, ApiKeyInterceptor, StandardHealth,
                                     TextGenerationServicer, add_service)
from router.lifecycle.drain import FLUSH_TIMEOUT_S
from router.state import STATE, RouterState

log = logging.getLogger("tgi.router.grpc")


@dataclass(frozen=True, slots=True)
class Keepalive:
    """HTTP/2 keepalive: a peer that stops answering loses its connection, and with it its calls.

    grpc's defaults send no keepalive ping for two hours and never close an idle connection, so a
    client gone without a FIN, or one that stopped reading its socket, held its calls (their
    generations, blocks and slots) indefinitely. Here:
    - a connection with nothing received for `time_s` is pinged, calls or not, and closed when
      the ping is not answered within `timeout_s`;
    - a connection without calls for `idle_s` (HTTP's keep-alive timeout) is closed with a
      GOAWAY, which clients answer by reconnecting for their next call;
    - clients may ping as often as every `client_ping_s`, with or without calls (grpc's default
      minimum is five minutes: a client keepalive of a few seconds, as load balancers and
      Kubernetes clients set, was answered with GOAWAY "too_many_pings").
    """

    time_s: float = 60.0
    timeout_s: float = 20.0
    idle_s: float = 75.0
    client_ping_s: float = 10.0

    def options(self) -> list[tuple[str, int]]:
        """grpc's channel arguments for these settings."""
        timeout_ms = int(self.timeout_s * 1000)
        return [("grpc.keepalive_time_ms", int(self.time_s * 1000)),
                ("grpc.keepalive_timeout_ms", timeout_ms),
                # the wait for a ping's answer that grpc's transport enforces (a minute unset)
                ("grpc.http2.ping_timeout_ms", timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                # the server's own pings go on while no data flows (a stalled stream is when
                # they matter): grpc stops after two by default
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.max_connection_idle_ms", int(self.idle_s * 1000)),
                ("grpc.http2.min_recv_ping_interval_without_data_ms",
                 int(self.client_ping_s * 1000))]


KEEPALIVE = Keepalive()


def server_options(payload_limit: int) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments."""
    return [
        # a message larger than --payload-limit is refused (RESOURCE_EXHAUSTED), as HTTP's 413
        ("grpc.max_receive_message_length", payload_limit),
        # grpc shares a port with any other process by default; a second router on the same
        # port must fail to start, not take half the calls
        ("grpc.so_reuseport", 0),
        *KEEPALIVE.options()]


class GrpcServer:
    """The gRPC server, started and stopped with the app.

    Starts with the app, stops taking calls when it shuts down (draining beside HTTP), and is
    gone at cleanup, before the batching loop stops."""

    def __init__(self, state: RouterState):
        self.state = state
        self.server: grpc.aio.Server | None = None
        self.health = StandardHealth(state)
        self.refresher: asyncio.Task | None = None
        self.stopping: asyncio.Future | None = None

    @property
    def address(self) -> str:
        config = self.state.config
        host = f"[{config.hostname}]" if ":" in config.hostname else config.hostname
        return f"{host}:{config.grpc_port}"

    async def start(self, app: web.Application) -> None:
        config = self.state.config
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
        server = grpc.aio.server(interceptors=interceptors,
                                 options=server_options(config.payload_limit))
        add_service(TextGenerationServicer(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), server)
        try:
            server.add_insecure_port(self.address)
        except RuntimeError:  # grpc's "Failed to bind": the router stops with this message
            raise ValueError(f"--grpc-port {config.grpc_port}: cannot listen on {self.address} "
                             "(is the port in use?)") from None
        await self.health.refresh()  # serving from the first call on
        await server.start()
        self.server = server
        self.refresher = asyncio.create_task(self.health.refresh_forever())
        log.info("gRPC API (%s) listening on %s", SERVICE, self.address)

    async def drain(self, app: web.Application) -> None:
        if self.server is None or self.stopping is not None:
            return
        # Watch streams hear NOT_SERVING and end; new calls are refused from now on (balancers
        # see UNAVAILABLE) and the calls in flight have the router's drain to finish: at its end
        # the generations end with UNAVAILABLE, and a call still open after the flush is cancelled
        await self.health.stop()
        grace = self.state.config.drain_timeout + FLUSH_TIMEOUT_S
        self.stopping = asyncio.ensure_future(self.server.stop(grace))

    async def stop(self, app: web.Application) -> None:
        if self.refresher is not None:
            self.refresher.cancel()
            await asyncio.gather(self.refresher, return_exceptions=True)
        if self.server is not None:
            await (self.stopping or self.server.stop(None))


def register(app: web.Application) -> None:
    """Serves the gRPC API with the app when --grpc-port is set (app[STATE] must be set)."""
    state = app[STATE]
    if state.config.grpc_port is None:
        return
    server = GrpcServer(state)
    app.on_startup.append(server.start)
    app.on_shutdown.append(server.drain)
    app.on_cleanup.append(server.stop)
