"""`tgi-router`: the HTTP server in front of the shards."""
from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
import sys

from aiohttp import web

from proto.launcher_watch import watch_launcher
from proto.logs import configure_logging, is_json_output, log_source
from proto.tracing import init_tracing, shutdown_tracing
from router.api.openapi import openapi_document
from router.api.tgi import routes as tgi
from router.app import build_state, create_app
from router.config import log_level, parse_args
from router.http import access_log, connections
from router.lifecycle.drain import FLUSH_TIMEOUT_S

log = logging.getLogger("tgi.router")


async def serve(argv: list[str] | None) -> int:
    # ends this process (with SIGTERM, whose handler below stops it in order) once tgi-launcher
    # is gone; before that handler exists, SIGTERM just ends it
    watch_launcher()
    config = parse_args(argv)
    server = config.server
    init_tracing(server.otlp_service_name, server.otlp_endpoint)
    state = await build_state(config)
    state.templates.start()  # the first chat then finds its workers ready
    app = create_app(state)
    # the drain (on_shutdown) gave the requests their time already: the handlers then only write
    runner, listener = await connections.start_listening(app, server.hostname, server.port,
                                                         shutdown_timeout=FLUSH_TIMEOUT_S)
    metrics_runner = None
    if server.prometheus_port is not None:
        metrics_app = tgi.metrics_app(state)
        access_log.install(metrics_app)
        metrics_runner = web.AppRunner(metrics_app, access_log=None)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, server.hostname, server.prometheus_port).start()
        log.info("metrics also on http://%s:%d/metrics", server.hostname, server.prometheus_port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    fatal = asyncio.create_task(state.fatal.wait())
    await asyncio.wait([asyncio.create_task(stop.wait()), fatal],
                       return_when=asyncio.FIRST_COMPLETED)
    log.info("router stopping")
    for served in list(state.models.served.values()):
        served.batcher.stop_waiting()
    listener.close()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()
    shutdown_tracing()
    return 1 if state.fatal.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["print-schema"]:  # TGI's router subcommand: the OpenAPI document
        print(json.dumps(openapi_document(), indent=2))
        return 0
    # `kill -USR1 <pid>` prints every thread's stack: how to see where a stuck process is
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_logging(log_level(), json_output=is_json_output(), source=log_source("router"))
    try:
        return asyncio.run(serve(argv))
    except ValueError as err:
        log.error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
