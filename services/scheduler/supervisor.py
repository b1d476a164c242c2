"""The scheduler service around its engine core: backend links, reconnection, health, outputs.

The engine core (engine/core.py) runs the loop; this keeps its gRPC ports alive:

- It connects the tokenizers and the executors at start (at least one executor must answer;
  the others are retried in the background), attaches each executor to the core as a lane,
  and runs the core's lanes and output stage as tasks.
- Every backend link reconnects. When an executor's stream breaks, the core moves its requests
  to the other executors (or holds them until one is back, SchedulerLimits.executor_wait_s)
  and drops its lane; this reconnects in the background and attaches the new session. When a
  tokenizer's Detokenize session ends, the requests pinned to it end with Finished (error)
  (their text state died with it) and that link reconnects on its own. The drafter link keeps
  itself connected (a missing drafter only costs speed).
- Health follows ``ready``: NOT_SERVING while no executor takes new requests or every
  tokenizer is away.
- Each request's deltas go to a queue its Generate handler reads (``Supervisor.submit``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from services.common.errors import UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.tls import ClientTLS
from services.scheduler.adapter_admin import AdapterAdmin
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.engine.core import EXECUTOR_UNAVAILABLE, EngineCore
from services.scheduler.engine.request_table import FinishedObserver
from services.scheduler.engine.vocab import servable_info
from services.scheduler.links.backoff import retry_until_connected
from services.scheduler.links.drafter_link import DrafterLink
from services.scheduler.links.executor_link import ExecutorLink
from services.scheduler.links.tokenizer_link import TokenizerPool
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.stop import StopConditions

_log = structlog.get_logger("tokenmill.scheduler")

SHUTTING_DOWN = "the server is shutting down"
TOKENIZER_LOST = "the tokenizer holding this request's text went away; retry"
"""What a request hears when its tokenizer's Detokenize session ended (no address: it reaches clients)."""


class HealthReport:
    """Tells the server's health what ``ready`` says whenever a link changes, in order, from one
    task (reports are awaited, and a change may come while one is on its way)."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self._set_serving: Callable[[bool], Awaitable[None]] | None = None
        self._reported = True
        """What health was last told (the server starts SERVING once the supervisor started)."""
        self._task: asyncio.Task | None = None
        self._stopped = False

    def report_to(self, set_serving: Callable[[bool], Awaitable[None]]) -> None:
        """From now on, tell ``set_serving`` whenever ``ready`` changes."""
        self._set_serving = set_serving

    def changed(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._report(), name="scheduler-health")

    def stop(self) -> None:
        self._stopped = True

    async def _report(self) -> None:
        while not self._stopped and self._reported != self._ready():
            self._reported = self._ready()
            _log.info("serving_changed", serving=self._reported)
            if self._set_serving is not None:
                await self._set_serving(self._reported)


@dataclass(frozen=True, slots=True)
class Backends:
    """Where the scheduler's backends listen, and how to reach them."""

    executor_addresses: Sequence[str]
    tokenizer_addresses: Sequence[str]
    drafter_address: str = ""
    """Empty: no speculative decoding."""
    drafter_deadline_s: float = 0.05
    tls: ClientTLS | None = None
    secret: str = ""
    """The deployment's internal secret, sent on every call to a backend (internal_secret.py)."""


class Supervisor:
    def __init__(self, limits: SchedulerLimits, backends: Backends, connect_timeout_s: float, *,
                 speculation: SpeculationConfig | None = None, on_finished: FinishedObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.connect_timeout_s = connect_timeout_s
        if not backends.executor_addresses or len(set(backends.executor_addresses)) != len(backends.executor_addresses):
            raise ValueError(f"executor_addresses must name one or more distinct executors, got "
                             f"{list(backends.executor_addresses)}")
        self.executors = {address: ExecutorLink(address, backends.tls, on_lost=self._wake_core, secret=backends.secret)
                          for address in backends.executor_addresses}
        self.tokenizers = TokenizerPool(backends.tokenizer_addresses, backends.tls, on_lost=self._on_tokenizer_lost,
                                        secret=backends.secret)
        self.drafter = (DrafterLink(backends.drafter_address, backends.drafter_deadline_s, backends.tls,
                                    backends.secret)
                        if backends.drafter_address else None)
        self.core = EngineCore(limits, self.tokenizers.links, drafter=self.drafter, speculation=speculation,
                               clock=clock, on_finished=on_finished, on_executor_lost=self._on_executor_lost)
        self.adapter_admin = AdapterAdmin(self.core.adapters, lambda: [
            lane.port for lane in self.core.lanes.values() if lane.port.connected and hasattr(lane.port, "load_adapter")])
        """Adapters loaded and unloaded while serving, on every executor (adapter_admin.py)."""
        self._tasks: list[asyncio.Task] = []
        self._reconnecting: dict[str, asyncio.Task] = {}
        self._tokenizer_reconnects: dict[int, asyncio.Task] = {}
        self._stopping = False
        self.health = HealthReport(lambda: self.ready)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.tokenizers.connect(self.connect_timeout_s)
        results = await asyncio.gather(*(self._connect_executor(a) for a in self.executors), return_exceptions=True)
        failed = {address: r for address, r in zip(self.executors, results) if isinstance(r, BaseException)}
        if len(failed) == len(self.executors):
            raise next(iter(failed.values()))
        for address, error in failed.items():
            _log.warning("executor_unreachable_at_start", address=address, error=str(error))
            self._reconnect_later(address)
        if self.drafter is not None:
            self.drafter.start()  # in the background: requests never wait for a drafter
        self._tasks = [asyncio.create_task(self.core.run(), name="scheduler-loop"),
                       asyncio.create_task(self.core.publisher.run(), name="scheduler-publisher")]

    async def _connect_executor(self, address: str) -> None:
        link = self.executors[address]
        info = await link.connect(self.connect_timeout_s)
        info = dataclasses.replace(info, adapters=await self.adapter_admin.replay(link, info.adapters))
        tokenizer_eos = self.tokenizers.info.eos_token_ids if self.tokenizers.info else ()
        info = servable_info(info, self.tokenizers.info.vocab_size if self.tokenizers.info else None)
        self.core.attach(address, link, info, tokenizer_eos)
        _log.info("executor_connected", address=address, role=info.role, num_blocks=info.num_blocks,
                  block_size=info.block_size, max_model_len=info.max_model_len)

    async def shutdown(self, grace: float) -> None:
        """Refuse new requests, let running ones finish for up to ``grace`` seconds, then end
        the rest with Finished (error), so no client stream hangs."""
        self._stopping = True
        self.health.stop()
        deadline = time.monotonic() + grace
        while self.core.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.core.requests.end_all(SHUTTING_DOWN)
        pending = [*self._tasks, *self._reconnecting.values(), *self._tokenizer_reconnects.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self.executors.values()), return_exceptions=True)
        await self.tokenizers.close()
        if self.drafter is not None:
            await self.drafter.close()

    # ------------------------------------------------------------------ requests
    @property
    def ready(self) -> bool:
        return self.unavailable_reason() is None and self.tokenizers.connected

    def unavailable_reason(self) -> str | None:
        """Why no request can be accepted now (the server stops, no executor takes new
        requests); None if one can."""
        if self._stopping:
            return SHUTTING_DOWN
        if not any(lane.port.connected for lane in self.core.lanes.values()):
            return EXECUTOR_UNAVAILABLE
        return None

    def check_accepting(self) -> None:
        """Raise UnavailableError while the server stops or the executor is away (restarting)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise UnavailableError(reason)

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: StopConditions,
               priority: int, num_speculative_tokens: int | None = None, tenant: str = "",
               cache_scope: str = "", adapter: str = "") -> asyncio.Queue[GenerationDelta]:
        """Admit a request (EngineCore.submit, which names what it raises); its deltas arrive on
        the queue returned, the last one finished."""
        self.check_accepting()
        queue: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self.core.submit(request_id, prompt_ids, sampling, stop, queue.put_nowait, priority,
                         num_speculative_tokens, tenant, cache_scope, adapter)
        return queue

    async def prepare_grammar(self, grammar: str) -> str:
        """Have every executor that can build ``grammar``'s matcher and first mask now, at
        admission, so no step pays for it: "" when ready, else the first executor's reason."""
        ports = [lane.port for lane in self.core.lanes.values() if hasattr(lane.port, "prepare_grammar")]
        errors = await asyncio.gather(*(port.prepare_grammar(grammar) for port in ports))
        return next((error for error in errors if error), "")

    def abort(self, request_id: str) -> bool:
        """Abort a request (client cancelled or Abort RPC); its blocks are freed now."""
        return self.core.abort(request_id) is not None

    # ------------------------------------------------------------------ links going away
    def _wake_core(self) -> None:
        self.core.wake()  # an idle loop finds the executor port disconnected and detaches it

    def _on_executor_lost(self, address: str, error: str) -> None:
        # run_service froze the objects alive at start-up out of the cyclic GC, the first cores
        # among them; a free-block list is a cycle, so without this a lost executor's would never
        # be freed (about 100 bytes a KV block, once per lane: later cores are not frozen).
        gc.unfreeze()
        self.health.changed()
        self._reconnect_later(address)

    def _reconnect_later(self, address: str) -> None:
        task = self._reconnecting.get(address)
        if not self._stopping and (task is None or task.done()):
            self._reconnecting[address] = asyncio.create_task(self._reconnect(address),
                                                              name=f"executor-reconnect-{address}")

    async def _reconnect(self, address: str) -> None:
        """Retry until the executor is back; health reports NOT_SERVING meanwhile if it was the
        last one taking new requests."""
        # Free the dropped lane's core now (the engine has let go of it by the time this task
        # runs), not at some later full collection, so the next core's blocks and the load that
        # resumes can reuse its memory. One full collection per executor loss.
        gc.collect()
        # Any failure, e.g. a config the core refuses: keep trying, loudly.
        if await retry_until_connected(
                lambda: self._connect_executor(address), first_delay_s=0.2, max_delay_s=2.0,
                failed=lambda exc, delay: _log.warning("executor_reconnect_failed", address=address, error=str(exc),
                                                       retry_in_s=delay),
                stopped=lambda: self._stopping):
            self.health.changed()

    def _on_tokenizer_lost(self, index: int) -> None:
        """A tokenizer's Detokenize session ended: end the requests whose text state lived
        there, and reconnect that link in the background."""
        link = self.tokenizers.links[index]
        _log.error("tokenizer_lost", address=link.address)
        self.core.requests.end_all(TOKENIZER_LOST, detokenizer=index)  # the address is in the line above
        self.health.changed()
        if not self._stopping and index not in self._tokenizer_reconnects:
            self._tokenizer_reconnects[index] = asyncio.create_task(self._reconnect_tokenizer(index),
                                                                    name=f"tokenizer-{index}-reconnect")

    async def _reconnect_tokenizer(self, index: int) -> None:
        link = self.tokenizers.links[index]
        try:
            if await retry_until_connected(
                    lambda: link.connect(min(self.connect_timeout_s, 2.0)), first_delay_s=0.1, max_delay_s=1.0,
                    failed=lambda exc, delay: _log.warning("tokenizer_reconnect_failed", address=link.address,
                                                           error=str(exc), retry_in_s=delay),
                    stopped=lambda: self._stopping):
                _log.info("tokenizer_reconnected", address=link.address)
        finally:
            self._tokenizer_reconnects.pop(index, None)
            self.health.changed()
            self.core.wake()
