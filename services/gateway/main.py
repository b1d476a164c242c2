"""Gateway entry point: ``python -m services.gateway`` / ``tokenmill gateway --config FILE``.

One process, one event loop: the gRPC server (the Generation API, ``--port``, 50050), the
OpenAI-compatible HTTP server (``--http-port``, 8000) and the pool's polls of the targets.
"""

from __future__ import annotations

import asyncio
import time

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer
from services.common.service_config import write_port_file, remove_port_file
from services.common.service_main import announce_serving, registrar, service_main, start_service
from services.common.tls import ClientTLS
from services.gateway.api_keys import load_api_keys
from services.gateway.config import GatewayServiceConfig, token_namers
from services.gateway.dispatch import Dispatcher
from services.gateway.grpc_servicer import GatewayServicer
from services.gateway.http.app import build_app
from services.gateway.http.connection_limits import ConnectionLimits
from services.gateway.http.context import HttpContext
from services.gateway.http.server import HttpServer, start_http
from services.gateway.metrics import GatewayMetrics
from services.gateway.pool import TargetPool
from services.gateway.routes_file import load_routes
from services.gateway.routing.build import build_route

FIRST_POLL_WAIT_S = 2.0
"""At start, how long to wait for every target's first poll, so the first requests find them."""


async def serve(config: GatewayServiceConfig) -> RunningServer:
    config.validate()
    routes = load_routes(config.config)
    metrics = GatewayMetrics()
    pool = TargetPool(routes.targets, interval_s=config.profile_interval_s, window_s=config.profile_window_s,
                      default_tls=ClientTLS.for_backends(config), metrics=metrics,
                      max_message_bytes=config.max_message_bytes)
    built = {name: build_route(spec, pool.states) for name, spec in routes.models.items()}
    dispatcher = Dispatcher(built, pool, default_model=routes.default_model, max_attempts=config.max_attempts,
                            metrics=metrics)
    await pool.start(wait_s=FIRST_POLL_WAIT_S)
    api_keys = load_api_keys(config.api_keys_file, metrics) if config.api_keys_file else None
    servicer = GatewayServicer(dispatcher, config.request_timeout_s, api_keys)
    running = await start_service(config, "gateway", registrar(
        servicer, generation_pb2_grpc.add_GenerationServicer_to_server, generation_pb2, "Generation"))
    running.on_stop(pool.close)
    running.dispatcher = dispatcher  # for in-process tests and benchmarks
    running.http_port = None
    if config.http_port >= 0:
        ctx = HttpContext(dispatcher, metrics, timeout_s=config.request_timeout_s, max_choices=config.max_choices,
                          max_request_bytes=config.max_request_bytes, created=int(time.time()),
                          tool_call_parser=config.tool_call_parser, api_keys=api_keys,
                          reasoning_parser=config.reasoning_parser, body_timeout_s=config.http_body_timeout_s,
                          namers=token_namers(routes.models, config.config))
        limits = ConnectionLimits(config.http_header_timeout_s, config.http_max_header_bytes,
                                  config.http_max_connections)
        http = await start_http(build_app(ctx), config.host, config.http_port, limits, config.http_keep_alive_s)
        running.http_port = http.port
        running.on_stopping(lambda grace: _drain(running, http, grace))
        if config.http_port_file:
            write_port_file(config.http_port_file, http.port)
            running.on_stop(lambda: remove_port_file(config.http_port_file, http.port))
    await announce_serving(running, config)
    return running


async def _drain(running: RunningServer, http: HttpServer, grace: float) -> None:
    """Stop both APIs at once (health is NOT_SERVING already): HTTP closes its listener and idle
    connections, the gRPC server sends GOAWAY so new calls get UNAVAILABLE (a client's channel
    reconnects to another replica); the open streams of both finish within the one grace. Were
    the gRPC server stopped only after the HTTP streams, it would keep taking new calls on open
    connections all the while."""
    await asyncio.gather(http.stop(grace), running.server.stop(grace))


def main(argv: list[str] | None = None) -> int:
    return service_main("gateway", GatewayServiceConfig, serve, argv)
