"""`tokenmill up`'s four processes for a test module, and the in-process engine to compare with.

Stack tests that check what the served streams hold start the Launcher with some executor
settings and then run the same settings through ``services.inprocess.Engine``: one dict of
ExecutorConfig fields feeds both, so the two can never be configured apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import torch

from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.server import create_channel
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.stack.launcher import LaunchConfig, Launcher
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.engine_runs import generate_all


def executor_flags(settings: Mapping[str, object]) -> list[str]:
    """ExecutorConfig fields (``block_size=16``) as the executor's flags (``--block-size=16``)."""
    return [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]


@contextmanager
def launched_stack(model: str | Path, log_dir: str | Path, *, executor: Mapping[str, object],
                   scheduler_args: Sequence[str] = (), omp_threads: int = 1,
                   start_timeout_s: float = 120.0) -> Iterator[Launcher]:
    """The four services as processes, serving ``model`` with the ``executor`` settings."""
    launcher = Launcher(LaunchConfig(
        model=str(model), public_port=0, executor_args=executor_flags(executor),
        scheduler_args=list(scheduler_args), log_dir=str(log_dir), start_timeout_s=start_timeout_s,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(omp_threads)}))
    launcher.start()
    try:
        yield launcher
    finally:
        launcher.stop()


@asynccontextmanager
async def generation_stub(launcher: Launcher) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    async with create_channel(launcher.public_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def in_process_greedy(model: str | Path, executor: Mapping[str, object], prompts: Sequence[str], max_tokens: int,
                      *, threads: int | None = None) -> tuple[Engine, list[list[int]]]:
    """The in-process engine with the same executor settings, and its greedy token ids for each
    prompt (``max_tokens`` each, EOS ignored). ``threads`` sets torch's intra-op threads for the
    run, as OMP_NUM_THREADS does in the executor process, and restores them after."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(model), **executor)))
        outputs = generate_all(engine, prompts, SamplingParams(temperature=0.0),
                                      StopConditions(max_tokens=max_tokens, ignore_eos=True))
    finally:
        torch.set_num_threads(previous)
    return engine, [output.token_ids for output in outputs]
