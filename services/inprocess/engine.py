"""The in-process engine: scheduler core + model runner + local detokenization, no gRPC.

The same scheduler core, request path (services/scheduler/requests.py: admit, then each
update to a delta) and model runner the services use, driven by a plain loop: ``step()`` is
schedule → execute → update → detokenize/stop strings. It is the reference
the four-service stack is compared against (outputs and throughput), and the engine behind
``tokenmill generate --in-process``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from services.common.generation import GenerationDelta
from services.common.sampling_params import SamplingParams
from services.common.stop import StopConditions
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.request import FinishReason
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.requests import RequestState, admit, model_eos_token_ids


@dataclass(slots=True)
class EngineConfig:
    executor: ExecutorConfig
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    """The scheduler's limits: the same type, defaults and checks as the scheduler service's.
    ``overlap_scheduling`` is the service loop's: the engine runs one step at a time (its core
    and model share one thread, so planning ahead would overlap nothing)."""


@dataclass(slots=True)
class _Tracked:
    state: RequestState
    detokenizer: IncrementalDetokenizer


class Engine:
    def __init__(self, config: EngineConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.runner = ModelRunner(config.executor)
        info = self.runner.info()
        self.info = info
        self.tokenizer = TextTokenizer.from_dir(config.executor.model)
        # Special-token text typed in a prompt ("<s>") stays text, as in sentencepiece and
        # the tokenizer service; this tokenizer only encodes prompts and decodes outputs.
        self.tokenizer.backend.encode_special_tokens = True
        self.eos_token_ids = model_eos_token_ids(self.tokenizer.eos_token_ids, info)
        limits = replace(config.limits, overlap_scheduling=False)
        self.scheduler = Scheduler(SchedulerConfig.for_executor(limits, info))
        self._tracked: dict[str, _Tracked] = {}
        self._num_admitted = 0
        """Requests admitted so far: names the next one without an id (req-N)."""

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | Sequence[int] | None, add_special_tokens: bool = True) -> list[int]:
        if prompt is None or (isinstance(prompt, str) and prompt == ""):
            # Generation from BOS alone.
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise ValueError("prompt is empty and the model has no BOS token to start from")
            return [bos]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int] | None,
        sampling: SamplingParams | None = None,
        stop: StopConditions | None = None,
        request_id: str | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> str:
        """Queue one request; returns its id. Raises ValueError (naming the field and the limit)
        for a request the scheduler refuses, QueueFullError when the waiting queue is full."""
        prompt_ids = self.encode_prompt(prompt, add_special_tokens)
        request_id = request_id or f"req-{self._num_admitted}"
        state = admit(self.scheduler, request_id, prompt_ids, sampling or SamplingParams(), stop or StopConditions(),
                      self.eos_token_ids, priority, self.clock())
        self._num_admitted += 1
        self._tracked[request_id] = _Tracked(
            state, IncrementalDetokenizer(self.tokenizer, prompt_ids, keep_leading_space=True))
        return request_id

    def abort(self, request_id: str) -> GenerationDelta | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        return tracked.state.abort(self.clock())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[GenerationDelta]:
        plan = self.scheduler.schedule(self.clock())
        if plan.is_empty and not plan.finished_seq_ids:
            return []
        result = self.runner.execute(plan)
        updates = self.scheduler.update(plan, result)
        now = self.clock()
        deltas: list[GenerationDelta] = []
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue
            text = tracked.detokenizer.append(update.new_token_ids)
            if update.finish_reason is not None:
                text += tracked.detokenizer.finish()
            delta, stop_string = tracked.state.on_update(update, text, now)
            if stop_string is not None:
                self.scheduler.finish_request(update.request_id, FinishReason.STOP, stop_string)
            if delta.finished:
                del self._tracked[update.request_id]
            deltas.append(delta)
        return deltas

    def generate(
        self,
        prompts: Iterable[str | Sequence[int] | None],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        stop: StopConditions | Sequence[StopConditions] | None = None,
    ) -> Iterator[tuple[int, GenerationDelta]]:
        """Run prompts to completion with continuous batching, yielding (prompt index, delta)."""
        prompts = list(prompts)
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        stops = stop if isinstance(stop, (list, tuple)) else [stop] * len(prompts)
        index = {}
        for i, (prompt, s, st) in enumerate(zip(prompts, samplings, stops)):
            index[self.add_request(prompt, s, st)] = i
        while self.has_unfinished():
            for delta in self.step():
                if delta.request_id in index:
                    yield index[delta.request_id], delta

    def generate_all(self, prompts, sampling=None, stop=None) -> list[GenerationDelta]:
        """Convenience: run to completion and return one merged delta (all text and tokens) per prompt."""
        prompts = list(prompts)
        merged = [GenerationDelta(request_id="") for _ in prompts]
        for i, delta in self.generate(prompts, sampling, stop):
            m = merged[i]
            m.request_id = delta.request_id
            m.text += delta.text
            m.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                m.logprobs = (m.logprobs or []) + delta.logprobs
            if delta.finished:
                m.finish_reason, m.stop_reason = delta.finish_reason, delta.stop_reason
                m.usage, m.timings = delta.usage, delta.timings
        return merged
