"""The tokenmill systems of a run: the in-process engine, and the flags that give the services the same.

``EngineSettings`` is what the run varies in the engine: a few executor knobs (fields of
ExecutorConfig and of its compiled-decode path's settings: same names, defaults and help) and
every scheduler limit (SchedulerLimits, embedded whole). The in-process engine is built from ``executor_config`` and the limits;
the executor and scheduler services get ``executor_flags`` and ``scheduler_flags``, which
spell out the very same configs, so "services against in-process" compares equal settings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.flags import config_field
from benchmarks.harness.launch import executor_flags, scheduler_flags
from services.common.sampling_params import SamplingParams
from services.common.settings import embedded
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.inprocess.engine import Engine, EngineConfig
from services.runtime.model.attention.names import BACKEND_NAMES
from services.scheduler.core.config import SchedulerLimits


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine settings both tokenmill systems of a run share."""

    block_size: int = config_field(ExecutorConfig, "block_size")
    attention_backend: str = config_field(ExecutorConfig, "attention_backend",
                                          note=f"(one of {', '.join(BACKEND_NAMES)})")
    compile: bool = config_field(CompiledDecodeSettings, "compile")
    limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_")

    def validate(self) -> None:
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"--attention-backend: unknown {self.attention_backend!r}; "
                             f"known: {', '.join(BACKEND_NAMES)}")
        self.limits.validate()

    def executor_config(self, model: str, kv_cache_bytes: int, *, dtype: str = "fp32", device: str = "cpu",
                        **overrides) -> ExecutorConfig:
        """The executor's config for ``model`` (the runs on a CPU compare fp32)."""
        return ExecutorConfig(model=model, dtype=dtype, device=device, attention_backend=self.attention_backend,
                              block_size=self.block_size, kv_cache_bytes=kv_cache_bytes,
                              compiled_decode=CompiledDecodeSettings(compile=self.compile), **overrides)

    def executor_flags(self, config: ExecutorConfig) -> list[str]:
        """The executor service's flags for exactly ``config`` (every field spelled out)."""
        return executor_flags(config)

    def scheduler_flags(self) -> list[str]:
        """Every limit spelled out, so the scheduler service runs with exactly the engine's."""
        return scheduler_flags(self.limits)

    def engine(self, config: ExecutorConfig) -> Engine:
        return Engine(EngineConfig(config, self.limits))


def greedy(output_len: int) -> tuple[SamplingParams, StopConditions]:
    """Greedy and EOS ignored: exactly ``output_len`` tokens of work, as every baseline does."""
    return SamplingParams(temperature=0.0), StopConditions(max_tokens=output_len, ignore_eos=True)


def warm_up(engine: Engine) -> None:
    """One short request, so first-call costs (allocator, kernels) stay out of the timings."""
    sampling, stop = greedy(4)
    engine.add_request([5, 6, 7, 8], sampling, stop, request_id="warmup")
    while engine.has_unfinished():
        engine.step()


def warmed_engine(settings: EngineSettings, config: ExecutorConfig) -> Engine:
    """The engine, warmed up as the executor service is before it reports SERVING (every shape
    it will serve), and by one short request."""
    from services.executor import warmup

    engine = settings.engine(config)
    warmup.warm_up(engine.runner)
    warm_up(engine)
    return engine


@dataclass(frozen=True, slots=True)
class BatchRun:
    """Requests added at once and stepped until done."""

    seconds: float
    """From adding the first request to the last token."""
    first_tokens_s: float
    """From adding the first request until every request had its first token."""
    outputs: list[list[int]]
    """Each request's output ids, in the order given."""

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.outputs))


def run_batch(engine: Engine, prompts: Sequence[Sequence[int]], output_len: int) -> BatchRun:
    """Add ``prompts`` at once (greedy, ``output_len`` tokens each) and step until all finish."""
    sampling, stop = greedy(output_len)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    ids = [engine.add_request(list(p), sampling, stop) for p in prompts]
    first_tokens_at = None
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        if first_tokens_at is None and len(tokens) == len(ids):
            first_tokens_at = time.perf_counter()
    end = time.perf_counter()
    return BatchRun(end - start, (first_tokens_at or end) - start, [tokens.get(i, []) for i in ids])

