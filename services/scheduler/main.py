"""Scheduler service entry point: ``python -m services.scheduler`` / ``tokenmill serve scheduler``."""

from __future__ import annotations

from pathlib import Path

from services.common.logging import configure_logging
from services.common.metrics import request_metrics, rpc_interceptors, scheduler_collector, serve_metrics
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, run_service, start_server
from services.common.service_config import publish_port
from services.common.settings import parse_config
from services.scheduler.clients import ExecutorLink, TokenizerPool
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.loop import SchedulerLoop
from services.scheduler.profile import LatencyProfileRecorder
from services.scheduler.servicer import GenerationServicer


PROFILE_RETENTION_S = 600.0
"""GetProfile may ask for a window up to this long (or the configured one, if longer)."""


async def serve(config: SchedulerServiceConfig) -> RunningServer:
    profile = LatencyProfileRecorder(config.profile_window_s, retention_s=PROFILE_RETENTION_S)
    observers = [profile.on_finished]
    if config.metrics_port >= 0:
        observers.append(request_metrics().observe_finished)

    def on_finished(delta, output_state) -> None:
        for observe in observers:
            observe(delta, output_state)

    loop = SchedulerLoop(config.limits, ExecutorLink(config.executor_address),
                         TokenizerPool(config.tokenizer_addresses), config.connect_timeout_s,
                         on_finished=on_finished)
    await loop.start()
    model_name = Path(loop.executor.info.model).name
    servicer = GenerationServicer(loop, config.max_prompt_chars, profile=profile, model_name=model_name)

    def add(server):
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    if config.metrics_port >= 0:
        scheduler_collector().source = loop
    running = await start_server("scheduler", add, host=config.host, port=config.port,
                                 interceptors=rpc_interceptors(config.metrics_port))
    running.on_stopping(loop.shutdown)
    serve_metrics(running, config.metrics_port)
    publish_port(running, config.port_file)
    running.scheduler_loop = loop  # for in-process tests and metrics
    loop.on_serving_change = running.set_serving
    return running


def main(argv: list[str] | None = None) -> int:
    config = parse_config(SchedulerServiceConfig, argv, description="tokenmill scheduler: the public Generation API")
    configure_logging("scheduler", config.log_level)
    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)
    return 0
