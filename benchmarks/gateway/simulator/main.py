"""Engine simulator entry point: ``python -m benchmarks.gateway.simulator --engines SPECS``.

Serves one gRPC server per simulated engine (each with health and reflection, as every tokenmill
server), all on this process's one event loop: a pool of 64 engines costs one process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from services.common.logging import configure_logging
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, run_service, start_server
from services.common.service_main import registrar
from services.common.settings import parse_config
from benchmarks.gateway.simulator.config import SimulatorConfig
from services.gateway.http.connection_limits import ConnectionLimits
from services.gateway.http.server import start_http
from benchmarks.gateway.simulator.engine import SimEngine, SimSpec
from benchmarks.gateway.simulator.http_api import build_app
from benchmarks.gateway.simulator.profile import SimProfile
from benchmarks.gateway.simulator.servicer import SimulatorServicer


async def serve_engine(spec: SimSpec, host: str = "127.0.0.1", port: int = 0,
                       window_s: float = 60.0, http: bool = False) -> RunningServer:
    """One simulated engine on its own server (port 0 = any free port); with ``http`` its
    OpenAI-compatible HTTP API too, on a port of its own (``running.http_port``)."""
    profile = SimProfile(window_s)
    engine = SimEngine(spec, on_finished=profile.record)
    servicer = SimulatorServicer(engine, profile)
    running = await start_server(f"sim-{spec.name}", registrar(
        servicer, generation_pb2_grpc.add_GenerationServicer_to_server, generation_pb2, "Generation"),
        host=host, port=port)
    running.sim_engine = engine
    running.http_port = None
    if http:
        server = await start_http(build_app(engine), host, 0, ConnectionLimits(10.0, 65536, 1024))
        running.http_port = server.port
        running.on_stop(lambda: server.stop(grace=0))
    return running


async def serve_all(config: SimulatorConfig) -> RunningServer:
    specs = config.specs()
    http = bool(config.http_ports_file)
    servers = await asyncio.gather(*(serve_engine(s, config.host, 0, config.profile_window_s, http) for s in specs))
    first = servers[0]
    for other in servers[1:]:
        first.on_stop(lambda other=other: other.stop(grace=0))
    if config.ports_file:
        path = Path(config.ports_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({s.name: srv.port for s, srv in zip(specs, servers)}))
        tmp.replace(path)
    if http:
        path = Path(config.http_ports_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({s.name: srv.http_port for s, srv in zip(specs, servers)}))
        tmp.replace(path)
    return first


def main(argv: list[str] | None = None) -> int:
    config = parse_config(SimulatorConfig, argv, prog="tokenmill-sim")
    try:
        config.validate()
    except ValueError as exc:
        print(f"tokenmill-sim: error: {exc}", file=sys.stderr)
        return 2
    configure_logging("simulator", config.log_level)
    run_service(lambda: serve_all(config), grace=0.5)
    return 0
