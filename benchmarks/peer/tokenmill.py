"""tokenmill's two systems for the llama.cpp comparison: the in-process engine and the four services.

Both run with the run's EngineSettings (the same executor knobs and scheduler limits; with
``--compile`` the executor's torch.compile'd decode step) and the preset's KV pool; every
request greedy with ``ignore_eos`` and ``max_tokens`` = the output length. A run sends
``streams`` copies of one prompt at once and lasts until the last token: the engine batches
them (continuous batching), which is the point of the 32-stream figure.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.harness.client import greedy_request, same_request
from benchmarks.harness.engine import EngineSettings, run_batch, warmed_engine
from benchmarks.harness.launch import LaunchSpec, launched
from benchmarks.peer.figures import Run
from services.executor.config import ExecutorConfig


class InProcess:
    """services.inprocess.Engine in this process: scheduler core and model runner, no gRPC."""

    name = "tokenmill in-process"

    def __init__(self, engine: EngineSettings, config: ExecutorConfig) -> None:
        self.engine = warmed_engine(engine, config)

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        batch = run_batch(self.engine, [prompt] * streams, output_len)
        return Run(streams, batch.output_tokens, batch.seconds), batch.outputs


class Services:
    """The four services started by the harness's launch, driven over the public gRPC API."""

    name = "tokenmill services"

    def __init__(self, address: str) -> None:
        self.address = address

    def run(self, prompt: Sequence[int], streams: int, output_len: int) -> tuple[Run, list[list[int]]]:
        seconds, records = same_request(self.address, greedy_request(list(prompt), output_len), streams)
        outputs = [r.output_ids for r in records]
        return Run(streams, sum(map(len, outputs)), seconds), outputs


def services_stack(engine: EngineSettings, config: ExecutorConfig, threads: int):
    """Context manager: the four services with exactly the in-process engine's settings and
    executor config, ``threads`` OpenMP threads each; yields a Stack."""
    return launched(LaunchSpec(config.model, tuple(engine.executor_flags(config)), tuple(engine.scheduler_flags()),
                               threads=threads))
