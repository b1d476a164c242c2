"""Run the tokenizer service: ``python -m services.tokenizer`` or ``tokenmill serve tokenizer``."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import RunningServer
from services.common.service_main import announce_serving, registrar, service_main, start_service
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.text_service import TextService


async def serve(config: TokenizerConfig) -> RunningServer:
    """Load the tokenizer, start the server (SERVING on return) and publish the port file."""
    config.validate()
    servicer = TokenizerServicer(TextService(config.model, config.template_text()),
                                 chat_template_timeout_s=config.chat_template_timeout_s)
    running = await start_service(config, "tokenizer", registrar(
        servicer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer_pb2, "Tokenizer"))
    running.on_stop(servicer.close)
    await announce_serving(running, config)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("tokenizer", TokenizerConfig, serve, argv)
