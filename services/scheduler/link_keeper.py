"""The scheduler's executors and tokenizers, reconnected when they go.

- At start (after the tokenizers) the executors connect (at least one must answer; the others
  are retried in the background); each executor's session is attached to the core as a lane.
- When an executor's stream breaks, the core moves its requests to the other executors (or
  holds them until one is back, SchedulerLimits.executor_wait_s) and drops its lane; this
  reconnects in the background and attaches the new session.
- When a tokenizer's Detokenize session ends, the requests pinned to it end with Finished
  (error) (their text state died with it) and that link reconnects in the background.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable, Coroutine

import structlog

from services.scheduler.adapter_admin import AdapterAdmin
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.vocab import servable_info
from services.scheduler.links.backoff import retry_until_connected
from services.scheduler.links.executor_link import ExecutorLink
from services.scheduler.links.tokenizer_link import TokenizerPool

_log = structlog.get_logger("tokenmill.scheduler")

TOKENIZER_LOST = "the tokenizer holding this request's text went away; retry"
"""What a request hears when its tokenizer's Detokenize session ended (no address: it reaches clients)."""


class Reconnects:
    """One background reconnect per link at a time (keyed by an executor's address, a tokenizer's
    index), none once the server stops."""

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self.stopping = stopping
        self._tasks: dict[object, asyncio.Task] = {}

    def start(self, key: object, name: str, reconnect: Coroutine) -> None:
        task = self._tasks.get(key)
        if self.stopping() or (task is not None and not task.done()):
            reconnect.close()  # not started: one is already under way, or the server stops
            return
        self._tasks[key] = asyncio.create_task(reconnect, name=name)

    def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()


class ExecutorKeeper:
    def __init__(self, core: EngineCore, executors: dict[str, ExecutorLink], tokenizers: TokenizerPool,
                 adapter_admin: AdapterAdmin, connect_timeout_s: float, reconnects: Reconnects,
                 changed: Callable[[], None]) -> None:
        self.core = core
        self.executors = executors
        self.tokenizers = tokenizers
        self.adapter_admin = adapter_admin
        self.connect_timeout_s = connect_timeout_s
        self._reconnects = reconnects
        self._changed = changed
        """Told whenever an executor comes or goes (health follows)."""

    async def connect_all(self) -> None:
        """At least one executor must answer; the others are retried in the background."""
        results = await asyncio.gather(*(self._connect(a) for a in self.executors), return_exceptions=True)
        failed = {address: r for address, r in zip(self.executors, results) if isinstance(r, BaseException)}
        if len(failed) == len(self.executors):
            raise next(iter(failed.values()))
        for address, error in failed.items():
            _log.warning("executor_unreachable_at_start", address=address, error=str(error))
            self._reconnects.start(address, f"executor-reconnect-{address}", self._reconnect(address))

    async def _connect(self, address: str) -> None:
        link = self.executors[address]
        info = await link.connect(self.connect_timeout_s)
        info = dataclasses.replace(info, adapters=await self.adapter_admin.replay(link, info.adapters))
        tokenizer_eos = self.tokenizers.info.eos_token_ids if self.tokenizers.info else ()
        info = servable_info(info, self.tokenizers.info.vocab_size if self.tokenizers.info else None)
        self.core.attach(address, link, info, tokenizer_eos)
        _log.info("executor_connected", address=address, role=info.role, num_blocks=info.num_blocks,
                  block_size=info.block_size, max_model_len=info.max_model_len)

    def lost(self, address: str, error: str) -> None:
        """The core dropped an executor's lane: retry until it is back; health reports
        NOT_SERVING meanwhile if it was the last one taking new requests."""
        # run_service froze the objects alive at start-up out of the cyclic GC, the first cores
        # among them; a free-block list is a cycle, so without this a lost executor's would never
        # be freed (about 100 bytes a KV block, once per lane: later cores are not frozen).
        gc.unfreeze()
        self._changed()
        self._reconnects.start(address, f"executor-reconnect-{address}", self._reconnect(address))

    async def _reconnect(self, address: str) -> None:
        # Free the dropped lane's core now (the engine has let go of it by the time this task
        # runs), not at some later full collection, so the next core's blocks and the load that
        # resumes can reuse its memory. One full collection per executor loss.
        gc.collect()
        # Any failure, e.g. a config the core refuses: keep trying, loudly.
        if await retry_until_connected(
                lambda: self._connect(address), first_delay_s=0.2, max_delay_s=2.0,
                failed=lambda exc, delay: _log.warning("executor_reconnect_failed", address=address, error=str(exc),
                                                       retry_in_s=delay),
                stopped=self._reconnects.stopping):
            self._changed()


class TokenizerKeeper:
    def __init__(self, core: EngineCore, tokenizers: TokenizerPool, connect_timeout_s: float,
                 reconnects: Reconnects, changed: Callable[[], None]) -> None:
        self.core = core
        self.tokenizers = tokenizers
        self.connect_timeout_s = connect_timeout_s
        self._reconnects = reconnects
        self._changed = changed
        """Told whenever a tokenizer comes or goes (health follows)."""

    async def connect_all(self) -> None:
        await self.tokenizers.connect(self.connect_timeout_s)

    def lost(self, index: int) -> None:
        """A tokenizer's Detokenize session ended: end the requests whose text state lived
        there, and reconnect that link in the background."""
        link = self.tokenizers.links[index]
        _log.error("tokenizer_lost", address=link.address)
        self.core.requests.end_all(TOKENIZER_LOST, detokenizer=index)  # the address is in the line above
        self._changed()
        self._reconnects.start(index, f"tokenizer-{index}-reconnect", self._reconnect(index))

    async def _reconnect(self, index: int) -> None:
        link = self.tokenizers.links[index]
        try:
            if await retry_until_connected(
                    lambda: link.connect(min(self.connect_timeout_s, 2.0)), first_delay_s=0.1, max_delay_s=1.0,
                    failed=lambda exc, delay: _log.warning("tokenizer_reconnect_failed", address=link.address,
                                                           error=str(exc), retry_in_s=delay),
                    stopped=self._reconnects.stopping):
                _log.info("tokenizer_reconnected", address=link.address)
        finally:
            self._changed()
            self.core.wake()
