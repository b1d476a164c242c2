"""A whole stack in this process (tokenizer, executor and scheduler servers on port 0) for the
overload, deadline and fuzz tests: real servers, the real stories260K model, one call to start
and one to stop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR

ENGINE_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")


@dataclass
class SmallStack:
    tokenizers: list[RunningServer]
    executors: list[RunningServer]
    scheduler: RunningServer
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub

    @property
    def executor(self) -> RunningServer:
        return self.executors[0]

    @property
    def tokenizer(self) -> RunningServer:
        return self.tokenizers[0]

    def stats(self):
        return self.scheduler.app.core.stats()

    async def wait_idle(self, timeout: float = 3.0) -> float:
        """Wait until no request runs or waits and every KV block is free; return how long it took."""
        started = time.monotonic()
        while True:
            stats = self.stats()
            if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks:
                return time.monotonic() - started
            assert time.monotonic() - started < timeout, stats
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        await self.channel.close()
        for running in (self.scheduler, *self.executors, *self.tokenizers):
            await running.stop(grace=0)


async def start_small_stack(*, num_blocks: int = 128, block_size: int = 16, model=STORIES_DIR,
                            executor_overrides: dict | None = None, executors: int = 1, tokenizers: int = 1,
                            **scheduler_overrides) -> SmallStack:
    """``executors`` executors of ``num_blocks`` each and ``tokenizers`` tokenizers behind the one scheduler."""
    tokenizer_servers = [await serve_tokenizer(TokenizerConfig(port=0, model=str(model))) for _ in range(tokenizers)]
    servers = [await serve_executor(ExecutorServiceConfig(port=0, skip_warmup=True, executor=ExecutorConfig(
        model=str(model), block_size=block_size, num_blocks=num_blocks, **ENGINE_FLAGS), **(executor_overrides or {})))
        for _ in range(executors)]
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=tuple(e.address for e in servers), tokenizer_addresses=tuple(t.address for t in tokenizer_servers),
        connect_timeout_s=10, **scheduler_overrides))
    channel = create_channel(scheduler.address)
    return SmallStack(tokenizer_servers, servers, scheduler, channel, generation_pb2_grpc.GenerationStub(channel))
