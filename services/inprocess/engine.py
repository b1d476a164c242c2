"""The in-process engine: the engine core over local ports, no gRPC.

The same EngineCore (services/scheduler/engine/core.py) the scheduler service runs drives a
model runner on a worker thread, a local detokenizer and optionally a local drafter
(services/inprocess/ports.py): overlapped scheduling, multi-step bursts, speculation and stop
strings work as in the services. ``step()`` is one round of that loop (schedule → execute →
update → text), run on the engine's own event loop, in a thread of its own, so the engine
works the same called from plain code or from inside another event loop (a test, a server). It is the reference the four-service stack
is compared against (outputs and throughput), and the engine behind
``tokenmill generate --in-process``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from services.common.adapters import AdapterInfo
from services.common.sampling_params import SamplingParams
from services.drafter.ngram import NgramProposer
from services.drafter.proposer import Proposer
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.inprocess.ports import LocalDetokenizer, LocalDrafter, LocalExecutor
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.vocab import servable_info
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.stop import StopConditions
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.structured.structured_output import StructuredOutput
from services.tokenizer.text_tokenizer import TextTokenizer


@dataclass(slots=True)
class EngineConfig:
    executor: ExecutorConfig
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    """The scheduler's limits: the same type, defaults and checks as the scheduler service's."""
    speculation: SpeculationConfig = field(default_factory=lambda: SpeculationConfig(num_speculative_tokens=0))
    """Speculative decoding; off unless num_speculative_tokens > 0 (then drafts come from the
    Engine's ``proposer``, n-gram lookup by default)."""


class Engine:
    def __init__(self, config: EngineConfig, clock=time.monotonic, proposer: Proposer | None = None) -> None:
        config.limits.validate()
        config.speculation.validate()
        self.config = config
        self.runner = ModelRunner(config.executor)
        self.tokenizer = TextTokenizer.from_dir(config.executor.model)
        self.info = servable_info(self.runner.info(), self.tokenizer.vocab_size)
        # Special-token text typed in a prompt ("<s>") stays text, as in sentencepiece and
        # the tokenizer service; this tokenizer only encodes prompts and decodes outputs.
        self.tokenizer.backend.encode_special_tokens = True
        drafter = None
        if config.speculation.num_speculative_tokens > 0:
            drafter = LocalDrafter(proposer or NgramProposer(
                num_speculative_tokens=config.speculation.num_speculative_tokens))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inprocess-engine", daemon=True)
        self._thread.start()
        self._executor = LocalExecutor(self.runner)
        self._outbox: list[GenerationDelta] = []
        self.core = self._run(self._make_core(config, clock, drafter))
        self._num_admitted = 0
        self.grammar_compiler = GrammarCompiler(config.limits.max_grammar_bytes)
        """Requests admitted so far: names the next one without an id (req-N)."""

    async def _make_core(self, config: EngineConfig, clock, drafter: LocalDrafter | None) -> EngineCore:
        # Built on the engine's loop: its events and queues belong to it.
        core = EngineCore(config.limits, [LocalDetokenizer(self.tokenizer)], drafter=drafter,
                          speculation=config.speculation, clock=clock)
        core.attach("local", self._executor, self.info, self.tokenizer.eos_token_ids)
        return core

    def _run(self, coroutine):
        """Run ``coroutine`` on the engine's loop and wait for it (the core is only ever touched there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _call(self, function, *args):
        return function(*args)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler core of the executor (its block manager, running and waiting requests)."""
        return self.core.scheduler

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.core.eos_token_ids

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
        num_speculative_tokens: int | None = None,
        structured_output: StructuredOutput | None = None,
        adapter: str = "",
    ) -> str:
        """Queue one request; returns its id. Raises ValueError (naming the field and the limit)
        for a request the scheduler refuses, ResourceExhaustedError when the waiting queue is
        full. ``structured_output`` is compiled here, on the caller's thread, as the
        scheduler's admission does on a worker thread (InvalidArgumentError, a ValueError)."""
        prompt_ids = self.encode_prompt(prompt, add_special_tokens)
        sampling = sampling or SamplingParams()
        if structured_output is not None:
            sampling = dataclasses.replace(sampling, grammar=self.grammar_compiler.compile_now(structured_output))
        request_id = request_id or f"req-{self._num_admitted}"
        self._run(self._call(self.core.submit, request_id, prompt_ids, sampling,
                             stop or StopConditions(), self._collect, priority, num_speculative_tokens,
                             "", "", adapter))
        self._num_admitted += 1
        return request_id

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Serve a LoRA adapter under ``name`` (the executor's LoadAdapter, in process)."""
        info = self.runner.load_adapter(name, path)
        self._run(self._call(self.core.adapters.learn, [info]))
        return info

    def unload_adapter(self, name: str) -> bool:
        found = self.runner.unload_adapter(name)
        self._run(self._call(self.core.adapters.forget, name))
        return found

    def _collect(self, delta: GenerationDelta) -> None:
        self._outbox.append(delta)

    def abort(self, request_id: str) -> GenerationDelta | None:
        """End a request now; returns its final delta (None for an unknown id)."""
        delta = self._run(self._call(self.core.abort, request_id))
        if delta is not None:
            self._outbox.remove(delta)  # returned here instead of by the next step
        return delta

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[GenerationDelta]:
        """One round of the engine loop; the deltas it produced."""
        self._run(self._step())
        deltas, self._outbox = self._outbox, []
        return deltas

    async def _step(self) -> None:
        await self.core.step()
        await self.core.publisher.drain()

    def generate(
        self,
        prompts: Iterable[str | Sequence[int] | None],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        stop: StopConditions | Sequence[StopConditions] | None = None,
        adapters: Sequence[str] | None = None,
    ) -> Iterator[tuple[int, GenerationDelta]]:
        """Run prompts to completion with continuous batching, yielding (prompt index, delta).
        ``adapters``: each prompt's LoRA adapter ("" = the base model)."""
        prompts = list(prompts)
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        stops = stop if isinstance(stop, (list, tuple)) else [stop] * len(prompts)
        adapters = list(adapters) if adapters is not None else [""] * len(prompts)
        index = {}
        for i, (prompt, s, st, adapter) in enumerate(zip(prompts, samplings, stops, adapters)):
            index[self.add_request(prompt, s, st, adapter=adapter)] = i
        while self.has_unfinished():
            for delta in self.step():
                if delta.request_id in index:
                    yield index[delta.request_id], delta

    def close(self) -> None:
        """Stop the worker thread and the event loop (also done when the engine is collected)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._executor.close()
            self._loop.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to close
            pass
