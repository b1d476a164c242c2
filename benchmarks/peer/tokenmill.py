"""tokenmill's two systems for the llama.cpp comparison: the in-process engine and the four services.

Both run with the serving benchmark's ``EngineOptions`` (the same KV pool and limits) and,
with ``compile``, the executor's torch.compile'd decode step (``--compile``); every
request greedy with ``ignore_eos`` and ``max_tokens`` = the output length. A run sends
``streams`` copies of one prompt at once and lasts until the last token: the engine batches
them (continuous batching), which is the point of the 32-stream figure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

import uvloop

from benchmarks.peer.figures import Run
from benchmarks.serving.inprocess import EngineOptions, greedy, warm_up
from benchmarks.serving.services_run import launched_stack
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from services.executor import warmup
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.stack.client import build_request

ENGINE_OPTIONS = EngineOptions(kv_cache_bytes=32 * 1024**2)
"""stories260K's K/V is 2.5 KiB a token: 32 MiB holds 32 streams of 512 tokens with room to spare."""


class InProcess:
    """services.inprocess.Engine in this process: scheduler core and model runner, no gRPC."""

    name = "tokenmill in-process"

    def __init__(self, model_dir: str, compile: bool = False, kv_cache_bytes: int = ENGINE_OPTIONS.kv_cache_bytes,
                 num_scheduler_steps: int = SchedulerLimits().num_scheduler_steps,
                 multi_step_max_delay_ms: float = SchedulerLimits().multi_step_max_delay_ms) -> None:
        o = replace(ENGINE_OPTIONS, kv_cache_bytes=kv_cache_bytes)
        executor = ExecutorConfig(model=model_dir, dtype="fp32", device="cpu", attention_backend=o.attention_backend,
                                  block_size=o.block_size, kv_cache_bytes=o.kv_cache_bytes,
                                  compiled_decode=CompiledDecodeSettings(compile=compile))
        limits = replace(o.limits(), num_scheduler_steps=num_scheduler_steps,
                         multi_step_max_delay_ms=multi_step_max_delay_ms)
        self.engine = Engine(EngineConfig(executor, limits))
        warmup.warm_up(self.engine.runner)  # what the executor service runs before it reports SERVING
        warm_up(self.engine)

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        sampling, stop = greedy(output_len)
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        ids = [self.engine.add_request(list(prompt), sampling, stop) for _ in range(streams)]
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        seconds = time.perf_counter() - start
        outputs = [tokens.get(i, []) for i in ids]
        return Run(streams, sum(map(len, outputs)), seconds), outputs


class Services:
    """The four services started by services.stack's launcher, driven over the public gRPC API."""

    name = "tokenmill services"

    def __init__(self, address: str) -> None:
        self.address = address

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        # uvloop, as the services use: the client shares the cores with the stack it measures.
        return uvloop.run(self._run(list(prompt), streams, output_len))

    async def _run(self, prompt: list[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        request = build_request(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
        async with create_channel(self.address) as channel:
            await channel.channel_ready()  # connecting stays out of the timing
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one() -> list[int]:
                tokens: list[int] = []
                async for reply in stub.Generate(request, timeout=600):
                    if reply.WhichOneof("event") == "delta":
                        tokens.extend(reply.delta.token_ids)
                return tokens

            start = time.perf_counter()
            outputs = await asyncio.gather(*(one() for _ in range(streams)))
            seconds = time.perf_counter() - start
        return Run(streams, sum(map(len, outputs)), seconds), list(outputs)


def services_stack(model_dir: str, threads: int, compile: bool = False,
                   kv_cache_bytes: int = ENGINE_OPTIONS.kv_cache_bytes,
                   num_scheduler_steps: int = SchedulerLimits().num_scheduler_steps,
                   multi_step_max_delay_ms: float = SchedulerLimits().multi_step_max_delay_ms):
    """Context manager: the four services with ENGINE_OPTIONS (and this KV pool), ``threads`` OpenMP
    threads each; yields a Stack."""
    options = replace(ENGINE_OPTIONS, kv_cache_bytes=kv_cache_bytes)
    executor_flags = options.executor_flags() + (["--compile"] if compile else [])
    scheduler_flags = options.scheduler_flags() + ["--num-scheduler-steps", str(num_scheduler_steps),
                                                   "--multi-step-max-delay-ms", str(multi_step_max_delay_ms)]
    return launched_stack(model_dir, executor_flags, scheduler_flags, threads)
