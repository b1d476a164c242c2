"""Run the executor service: ``python -m services.executor`` or ``tokenmill serve executor``.

Start-up order: bind the port (health NOT_SERVING, so a fixed-port clash fails before minutes
of loading), load the model and allocate the KV cache in the step worker thread, then report
SERVING and publish the port file. GetExecutorInfo and Step answer UNAVAILABLE until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from services.common.logging import configure_logging
from services.common.metrics import executor_step_histogram, rpc_interceptors, serve_metrics, timed_execute
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.server import RunningServer, run_service, start_server
from services.common.service_config import publish_port
from services.common.settings import parse_config
from services.executor.config import ExecutorServiceConfig
from services.executor.model_runner import ModelRunner
from services.executor.servicer import ExecutorServicer

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name

_log = structlog.get_logger("tokenmill.executor")


async def serve(config: ExecutorServiceConfig) -> RunningServer:
    """Start the server, load the model, then report SERVING; returns the running server."""
    engine_config = config.executor_config()
    engine_config.validate()  # bad flags fail before anything is bound or loaded
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
    servicer = ExecutorServicer(worker)

    def add(server: grpc.aio.Server) -> list[str]:
        executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    try:
        running = await start_server("executor", add, host=config.host, port=config.port, serving=False,
                                     interceptors=rpc_interceptors(config.metrics_port))
    except BaseException:
        worker.shutdown(wait=False)
        raise
    running.on_stop(lambda: asyncio.to_thread(worker.shutdown, True))
    try:
        runner = await asyncio.get_running_loop().run_in_executor(worker, ModelRunner, engine_config)
    except BaseException:
        await running.stop(grace=0)
        raise
    if config.metrics_port >= 0:
        runner.execute = timed_execute(runner.execute, executor_step_histogram())
    servicer.attach(runner)
    info = runner.info()
    _log.info("model_loaded", model=info.model, device=info.device, dtype=info.dtype,
              attention_backend=info.attention_backend, num_blocks=info.num_blocks,
              block_size=info.block_size, max_model_len=info.max_model_len)
    serve_metrics(running, config.metrics_port)
    await running.set_serving(True)
    publish_port(running, config.port_file)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ExecutorServiceConfig, argv, prog="tokenmill serve executor")
    configure_logging("executor", config.log_level)
    run_service(lambda: serve(config), grace=config.shutdown_grace_seconds)
    return 0
