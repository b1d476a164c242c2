"""Run the drafter service: ``python -m services.drafter`` or ``tokenmill serve drafter``."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.common.server import RunningServer
from services.common.service_main import announce_serving, registrar, service_main, start_service
from services.drafter.config import DrafterConfig
from services.drafter.proposer import DraftMethod, Proposer
from services.drafter.servicer import DrafterServicer


def build_proposer(config: DrafterConfig) -> Proposer:
    """The configured proposer; for draft_model this loads the model (imported only then,
    so an n-gram drafter never imports torch)."""
    if config.method is DraftMethod.NGRAM:
        return config.ngram_proposer()
    from services.drafter.draft_model import DraftModelProposer

    return DraftModelProposer(config.draft, config.num_speculative_tokens)


async def serve(config: DrafterConfig) -> RunningServer:
    """Start the server (SERVING on return) and publish the port file."""
    servicer = DrafterServicer(build_proposer(config))
    running = await start_service(config, "drafter", registrar(
        servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, drafter_pb2, "Drafter"))
    await announce_serving(running, config)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("drafter", DrafterConfig, serve, argv)
