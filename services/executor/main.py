"""Run the executor service: ``python -m services.executor`` or ``tokenmill serve executor``.

Start-up order: bind the port (health NOT_SERVING, so a fixed-port clash fails before minutes
of loading), load the model and allocate the KV cache in the step worker thread, warm up (the
shapes it will serve, on scratch state: services/executor/warmup.py; ``--skip-warmup`` skips
it), then report SERVING and publish the port file. GetExecutorInfo and Step answer
UNAVAILABLE until then.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from services.common.metrics import executor_step_histogram, expert_load_collector
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.server import RunningServer
from services.common.tls import ClientTLS
from services.common.service_main import announce_serving, internal_secret, registrar, service_main, start_service
from services.executor.config import ExecutorServiceConfig
from services.executor.model_runner import ModelRunner
from services.executor.servicer import ExecutorServicer
from services.executor.warmup import compile_cache_dirs, warm_up

_log = structlog.get_logger("tokenmill.executor")

READ_KV_METHOD = "/tokenmill.v1.Executor/ReadKVBlocks"
"""The one method another executor calls here (a decode executor pulling a prompt's KV)."""


async def serve(config: ExecutorServiceConfig) -> RunningServer:
    """Start the server, load the model, then report SERVING; returns the running server."""
    config.validate()  # bad flags fail before anything is bound or loaded
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
    loaded: asyncio.Future[ModelRunner] = loop.create_future()
    observe_step = executor_step_histogram().observe if config.metrics_port >= 0 else None
    servicer = ExecutorServicer(worker, loaded, observe_step, role=config.role,
                                peer_tls=ClientTLS.for_backends(config), idle_timeout_s=config.step_idle_timeout_s,
                                peer_secret=internal_secret(config), kv_peers=config.kv_peers,
                                lora_dir=config.executor.lora_dir)
    try:
        running = await start_service(config, "executor", registrar(
            servicer, executor_pb2_grpc.add_ExecutorServicer_to_server, executor_pb2, "Executor"),
            method_clients={READ_KV_METHOD: config.tls_peer_clients})
    except BaseException:
        worker.shutdown(wait=False)
        raise
    running.on_stop(lambda: asyncio.to_thread(worker.shutdown, True))
    caches = compile_cache_dirs()  # before anything compiles: a restart reuses the kernels
    try:
        runner = await loop.run_in_executor(worker, ModelRunner, config.executor)
        if config.skip_warmup:
            _log.info("warmup_skipped")
        else:
            report = await loop.run_in_executor(worker, warm_up, runner)
            _log.info("warmup_done", seconds=round(report.seconds, 3), steps=report.steps,
                      kernel_launches=report.kernel_launches, **report.path_facts,
                      **{k.lower(): v for k, v in caches.items()})
    except BaseException:
        await running.stop(grace=0)
        raise
    if runner.parallel is not None:
        # On the step thread, after any step in flight (stop callbacks run newest first, so
        # before that thread shuts down): the stop header must not cross a step's broadcasts.
        running.on_stop(lambda: loop.run_in_executor(worker, runner.close))
        runner.parallel.on_lost(_end_executor)
    if runner.model.config.moe is not None and config.metrics_port >= 0:
        from services.runtime.model.moe import expert_loads, reset_expert_loads

        reset_expert_loads(runner.model)  # count served tokens, not the warm-up's
        expert_load_collector().watch(lambda: expert_loads(runner.model))
    loaded.set_result(runner)
    info = runner.info()
    _log.info("model_loaded", model=info.model, device=info.device, dtype=info.dtype,
              attention_backend=info.attention_backend, forward_paths=[path.name for path in runner.paths],
              num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len)
    await announce_serving(running, config)
    return running


def _end_executor(reason: str) -> None:
    """A tensor-parallel rank is gone: this executor can run no more steps, so it ends, and the
    scheduler's recovery (reconnect, or failover onto another executor) takes its requests."""
    _log.error("executor_stopping", reason=reason, exit_status=LOST_RANK_EXIT_STATUS)
    sys.stderr.flush()
    os._exit(LOST_RANK_EXIT_STATUS)


LOST_RANK_EXIT_STATUS = 3


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("executor", ExecutorServiceConfig, serve, argv)
