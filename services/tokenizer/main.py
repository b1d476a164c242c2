"""Run the tokenizer service: ``python -m services.tokenizer`` or ``tokenmill serve tokenizer``."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.logging import configure_logging
from services.common.metrics import rpc_interceptors, serve_metrics
from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import RunningServer, run_service, start_server
from services.common.service_config import publish_port
from services.common.settings import parse_config
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.text_service import TextService

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


async def serve(config: TokenizerConfig) -> RunningServer:
    """Load the tokenizer, start the server (SERVING on return) and publish the port file."""
    servicer = TokenizerServicer(TextService(config.model))

    def add(server: grpc.aio.Server) -> list[str]:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    running = await start_server("tokenizer", add, host=config.host, port=config.port,
                                 interceptors=rpc_interceptors(config.metrics_port))
    serve_metrics(running, config.metrics_port)
    publish_port(running, config.port_file)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(TokenizerConfig, argv, prog="tokenmill serve tokenizer")
    configure_logging("tokenizer", config.log_level)
    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)
    return 0
