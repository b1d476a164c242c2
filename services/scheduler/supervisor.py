"""The scheduler service around its engine core: backend links, reconnection, health, outputs.

The engine core (engine/core.py) runs the loop; this builds its gRPC ports and runs it:

- The links to the executors and tokenizers are connected at start and reconnected when they
  go (link_keeper.py); the core's lanes and output stage run as tasks. The drafter link keeps
  itself connected (a missing drafter only costs speed).
- Health follows ``ready``: NOT_SERVING while no executor takes new requests or every
  tokenizer is away.
- Requests enter through ``submit`` (request_entry.py), their deltas on a queue the Generate
  handler reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from services.common.tls import ClientTLS
from services.scheduler.adapter_admin import AdapterAdmin
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.request_table import FinishedObserver
from services.scheduler.link_keeper import ExecutorKeeper, Reconnects, TokenizerKeeper
from services.scheduler.links.drafter_link import DrafterLink
from services.scheduler.links.executor_link import ExecutorLink
from services.scheduler.links.tokenizer_link import TokenizerPool
from services.scheduler.request_entry import SHUTTING_DOWN, RequestEntry

_log = structlog.get_logger("tokenmill.scheduler")


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
        if not backends.executor_addresses or len(set(backends.executor_addresses)) != len(backends.executor_addresses):
            raise ValueError(f"executor_addresses must name one or more distinct executors, got "
                             f"{list(backends.executor_addresses)}")
        # An idle loop finds a lost executor's port disconnected and detaches it.
        self.executors = {address: ExecutorLink(address, backends.tls, on_lost=lambda: self.core.wake(),
                                                secret=backends.secret) for address in backends.executor_addresses}
        self.tokenizers = TokenizerPool(backends.tokenizer_addresses, backends.tls,
                                        on_lost=lambda index: self.tokenizer_keeper.lost(index), secret=backends.secret)
        self.drafter = (DrafterLink(backends.drafter_address, backends.drafter_deadline_s, backends.tls,
                                    backends.secret) if backends.drafter_address else None)
        self.core = EngineCore(limits, self.tokenizers.links, drafter=self.drafter, speculation=speculation,
                               clock=clock, on_finished=on_finished,
                               on_executor_lost=lambda address, error: self.executor_keeper.lost(address, error))
        self.adapter_admin = AdapterAdmin(self.core.adapters, lambda: [
            lane.port for lane in self.core.lanes.values() if lane.port.connected and hasattr(lane.port, "load_adapter")])
        """Adapters loaded and unloaded while serving, on every executor (adapter_admin.py)."""
        self.health = HealthReport(lambda: self.ready)
        self.entry = RequestEntry(self.core)
        self.reconnects = Reconnects(stopping=lambda: self.entry.stopping)
        self.executor_keeper = ExecutorKeeper(self.core, self.executors, self.tokenizers, self.adapter_admin,
                                              connect_timeout_s, self.reconnects, self.health.changed)
        self.tokenizer_keeper = TokenizerKeeper(self.core, self.tokenizers, connect_timeout_s, self.reconnects,
                                                self.health.changed)
        self.unavailable_reason, self.check_accepting = self.entry.unavailable_reason, self.entry.check_accepting
        self.submit, self.prepare_grammar, self.abort = self.entry.submit, self.entry.prepare_grammar, self.entry.abort
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.tokenizer_keeper.connect_all()
        await self.executor_keeper.connect_all()
        if self.drafter is not None:
            self.drafter.start()  # in the background: requests never wait for a drafter
        self._tasks = [asyncio.create_task(self.core.run(), name="scheduler-loop"),
                       asyncio.create_task(self.core.publisher.run(), name="scheduler-publisher")]

    @property
    def ready(self) -> bool:
        return self.entry.unavailable_reason() is None and self.tokenizers.connected

    async def shutdown(self, grace: float) -> None:
        """Refuse new requests, let running ones finish for up to ``grace`` seconds, then end
        the rest with Finished (error), so no client stream hangs."""
        self.entry.stopping = True
        self.health.stop()
        deadline = time.monotonic() + grace
        while self.core.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.core.requests.end_all(SHUTTING_DOWN)
        self.reconnects.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self.executors.values()), return_exceptions=True)
        await self.tokenizers.close()
        if self.drafter is not None:
            await self.drafter.close()
