"""Run the drafter service: ``python -m services.drafter`` or ``tokenmill serve drafter``."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.logging import configure_logging
from services.common.metrics import rpc_interceptors, serve_metrics
from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.common.server import RunningServer, run_service, start_server
from services.common.service_config import publish_port
from services.common.settings import parse_config
from services.drafter.config import DrafterConfig
from services.drafter.servicer import DrafterServicer

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


async def serve(config: DrafterConfig) -> RunningServer:
    """Start the server (SERVING on return) and publish the port file."""
    servicer = DrafterServicer(config.proposer())

    def add(server: grpc.aio.Server) -> list[str]:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    running = await start_server("drafter", add, host=config.host, port=config.port,
                                 interceptors=rpc_interceptors(config.metrics_port))
    serve_metrics(running, config.metrics_port)
    publish_port(running, config.port_file)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DrafterConfig, argv, prog="tokenmill serve drafter")
    configure_logging("drafter", config.log_level)
    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)
    return 0
