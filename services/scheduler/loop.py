"""The scheduler service's loop: one asyncio task owns the scheduler core.

    schedule → Step (executor stream) → update → Detokenize (tokenizer streams) → publish

With overlapped scheduling (``SchedulerLimits.overlap_scheduling``, on by default) the loop
keeps two steps in flight: it sends step N+1 before it reads step N's result, so the
executor starts N+1 as soon as N is done, while the result travels back and the loop
updates the core and plans N+2:

    schedule N, send N; schedule N+1, send N+1
    loop: receive N → update N → publish N → schedule N+2, send N+2 → receive N+1 → ...

Stops are then seen a step late (the core drops the surplus token; see its docstring).
Off, it is one step at a time: schedule N, send N, receive N, update N, schedule N+1.

Speculative decoding (a drafter configured): before planning a step with nothing in flight,
the loop asks the drafter (services/scheduler/drafter_link.py) for drafts for the requests
ready to verify some, each up to its adaptive k; a late or missing answer means no drafts.
A step that verifies drafts is not overlapped: where the request's next step starts depends
on how many drafts are accepted. So while any running request still wants drafts the loop
keeps one step in flight; once every request's k has fallen to 0 (drafts do not pay), it
overlaps again.

RPC handlers call ``submit``/``abort`` (plain method calls on the same event loop, so no
locks) and read their request's queue. Detokenization and publishing run in a second task
fed in step order, so the next executor step is not held up by the tokenizer round trip;
a stop string found there ends the request at the next step boundary (the extra token is
never shown).

Every backend link reconnects. When the executor stream breaks, every running request ends
with one final Finished (reason error, the cause in error_message: a client that saw partial
output must not see a bare UNAVAILABLE, or a retry would duplicate text), the core is
rebuilt empty and the loop reconnects in the background. When a tokenizer's Detokenize
session ends, the requests pinned to it end the same way (their text state died with it)
and that link reconnects on its own. Health follows ``ready``: NOT_SERVING while the
executor or every tokenizer is away.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from services.common.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.step import StepPlan
from services.common.stop import StopConditions
from services.scheduler.clients import DetokenizeBatch, ExecutorLink, TokenizerPool
from services.scheduler.drafter_link import DrafterLink
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.outputs import RequestUpdate
from services.scheduler.core.request import FinishReason
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import DraftLength, SpeculationConfig
from services.scheduler.core.waiting_queue import QueueFullError
from services.scheduler.kv_slots import KVSlotUsage, kv_slot_usage
from services.scheduler.requests import RequestState, admit, model_eos_token_ids

_log = structlog.get_logger("tokenmill.scheduler")

PROMPT_CONTEXT_TOKENS = 8
"""Prompt tail sent with a new detokenize stream: enough to space the first output token."""


@dataclass(slots=True)
class RequestHandle:
    request_id: str
    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    """GenerationDelta items, or an Exception that ends the stream."""


@dataclass(slots=True)
class _Tracked:
    state: RequestState
    handle: RequestHandle
    tokenizer: int
    stream_opened: bool = False


@dataclass(slots=True)
class StepTimeTotals:
    """Where the loop's time goes, summed over the steps it sent (seconds): read by the
    metrics collector and the benchmark's services-vs-in-process breakdown."""

    steps: int = 0
    sequences: int = 0
    """Sequences scheduled, summed over steps (steps / sequences = mean batch size)."""
    schedule_s: float = 0.0
    executor_s: float = 0.0
    """Awaiting the executor (sending the plan, then reading its result): plan encoding, the
    gRPC round trip, the executor's compute, result decoding, and whatever else the event loop
    runs meanwhile (publisher, RPC handlers). With overlapped scheduling only the part of
    the step not hidden behind the loop's own work."""
    update_s: float = 0.0
    overlapped: int = 0
    """Steps sent while the previous step was still in flight (overlapped scheduling)."""
    detokenize_rounds: int = 0
    """Detokenize round trips of the publisher: fewer than steps when it caught up on several
    steps at once (see SchedulerLoop._publish)."""


@dataclass(slots=True)
class _Sent:
    """A step sent to the executor whose result the loop has not read yet."""

    plan: StepPlan
    schedule_s: float
    send_s: float


@dataclass(slots=True)
class _Published:
    """One step's updates on their way to the detokenizers, in step order."""

    updates: list[RequestUpdate]
    closed: list[tuple[int, int]]
    """(stream id = seq id, tokenizer index) of detokenize streams to close after this step."""


EXECUTOR_UNAVAILABLE = "the executor is unavailable (restarting or unreachable); retry shortly"
"""What a request hears while the executor is away. No address: the door sends it before
authentication, to any caller."""


class SchedulerLoop:
    def __init__(self, limits: SchedulerLimits, executor: ExecutorLink, tokenizers: TokenizerPool,
                 connect_timeout_s: float, on_finished=None, clock: Callable[[], float] = time.monotonic,
                 drafter: DrafterLink | None = None, speculation: SpeculationConfig | None = None) -> None:
        self.limits = limits
        self.drafter = drafter
        self.speculation = speculation or SpeculationConfig()
        """The operator's limits; each executor session's core config adds the executor's facts."""
        self.executor = executor
        executor.on_lost = self._on_executor_lost
        self.tokenizers = tokenizers
        for index, link in enumerate(tokenizers.links):
            link.on_lost = functools.partial(self._on_tokenizer_lost, index)
        self._tokenizer_reconnects: dict[int, asyncio.Task] = {}
        self._serving_reported = True
        """What health was last told (the server starts SERVING once start() returns)."""
        self._serving_task: asyncio.Task | None = None
        self.connect_timeout_s = connect_timeout_s
        self.clock = clock
        self.on_finished = on_finished or (lambda delta, output: None)
        self.core: Scheduler | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._tracked: dict[str, _Tracked] = {}
        self._pending_close: list[tuple[int, int]] = []
        self._wake = asyncio.Event()
        self._publish_queue: asyncio.Queue[_Published | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._reconnecting: asyncio.Task | None = None
        self.on_serving_change: Callable[[bool], Awaitable[None]] = _ignore_serving_change
        """Told when the executor link goes down and comes back (the server's health follows it)."""
        self.step_count = 0
        self.last_step_time = 0.0
        self.step_times = StepTimeTotals()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.tokenizers.connect(self.connect_timeout_s)
        await self._connect_executor()
        if self.drafter is not None:
            self.drafter.start()  # in the background: requests never wait for a drafter
        self._tasks = [asyncio.create_task(self._run(), name="scheduler-loop"),
                       asyncio.create_task(self._publish(), name="scheduler-publisher")]

    async def _connect_executor(self) -> None:
        info = await self.executor.connect(self.connect_timeout_s)
        self.core = Scheduler(SchedulerConfig.for_executor(self.limits, info))
        if self.drafter is not None:
            self.drafter.forget_all()  # seq ids start over with the new core
        tokenizer_eos = self.tokenizers.info.eos_token_ids if self.tokenizers.info else ()
        self.eos_token_ids = model_eos_token_ids(tokenizer_eos, info)
        _log.info("executor_connected", address=self.executor.address, num_blocks=info.num_blocks,
                  block_size=info.block_size, max_model_len=info.max_model_len)

    async def shutdown(self, grace: float) -> None:
        """Refuse new requests, let running ones finish for up to ``grace`` seconds, then end
        the rest with UNAVAILABLE, so no client stream hangs."""
        self._stopping = True
        deadline = self.clock() + grace
        while self._tracked and self.clock() < deadline:
            await asyncio.sleep(0.02)
        self._end_all("the server is shutting down")
        for task in self._tasks + ([self._reconnecting] if self._reconnecting else []) + list(
                self._tokenizer_reconnects.values()):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.executor.close()
        await self.tokenizers.close()
        if self.drafter is not None:
            await self.drafter.close()

    # ------------------------------------------------------------------ requests
    @property
    def ready(self) -> bool:
        return (self.core is not None and self.executor.connected and self.tokenizers.connected
                and not self._stopping)

    def unavailable_reason(self) -> str | None:
        """Why no request can be accepted now (the server stops, the executor is away); None if one can."""
        if self._stopping:
            return "the server is shutting down"
        if self.core is None or not self.executor.connected:
            return EXECUTOR_UNAVAILABLE
        return None

    def check_accepting(self) -> None:
        """Raise UnavailableError while the server stops or the executor is away (restarting)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise UnavailableError(reason)

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: StopConditions,
               priority: int, num_speculative_tokens: int | None = None, tenant: str = "") -> RequestHandle:
        """Admit a request (services/scheduler/requests.py); its deltas arrive on the handle's queue.

        Raises UnavailableError while the executor is away or the server stops, InvalidArgumentError
        for a request_id in use, ValueError (naming the field) for a request the core refuses, and
        ResourceExhaustedError when the waiting queue is full.
        """
        self.check_accepting()
        if request_id in self._tracked:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use by a running request")
        tokenizer = self.tokenizers.pick()  # UnavailableError when every tokenizer is away
        try:
            state = admit(self.core, request_id, prompt_ids, sampling, stop, self.eos_token_ids, priority,
                          self.clock(), tenant)
        except QueueFullError as exc:
            raise ResourceExhaustedError(str(exc)) from None
        if self.drafter is not None:
            # None = the server's cap; 0 turns speculation off for this request.
            cap = self.speculation.num_speculative_tokens
            state.request.draft_length = DraftLength(
                self.speculation, cap if num_speculative_tokens is None else min(cap, num_speculative_tokens))
        handle = RequestHandle(request_id, len(prompt_ids))
        self._tracked[request_id] = _Tracked(state, handle, tokenizer)
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Abort a request (client cancelled or Abort RPC); its blocks are freed now."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        if self.core is not None:
            self.core.abort_request(request_id)
        if tracked.stream_opened:
            self._pending_close.append((tracked.state.request.seq_id, tracked.tokenizer))
        delta = tracked.state.abort(self.clock())
        tracked.handle.queue.put_nowait(delta)
        self.on_finished(delta, tracked.state.output)
        self._wake.set()
        return True

    def stats(self):
        return self.core.get_stats() if self.core is not None else None

    def kv_slots(self) -> KVSlotUsage | None:
        core = self.core
        return kv_slot_usage(core.running, core.config.block_size) if core is not None else None

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        sent: deque[_Sent] = deque()
        """Steps sent and not yet read, oldest first: one, or two with overlapped scheduling."""
        overlap_depth = 2 if self.limits.overlap_scheduling else 1
        while True:
            core = self.core
            if core is None:
                sent.clear()
                await asyncio.sleep(0.05)  # reconnecting
                continue
            if not self.executor.connected:
                # The step stream ended between steps (the executor died while we were idle):
                # handle it as a failed step now, not when the next request is sent into it.
                _log.error("executor_stream_ended_while_idle", address=self.executor.address)
                self._executor_lost(f"executor at {self.executor.address} ended the step stream")
                continue
            # Keep the executor's queue full: plan and send until `depth` steps are in flight
            # or there is nothing to plan before a result comes back.
            depth = 1 if self._speculating(core) else overlap_depth
            while len(sent) < depth:
                started = time.perf_counter()
                if not sent and self.drafter is not None:
                    await self._draft(core)
                    if self.core is not core:
                        break
                plan = core.schedule(self.clock())
                if plan.is_empty and not plan.finished_seq_ids:
                    break
                scheduled = time.perf_counter()
                try:
                    await self.executor.send(plan)
                except (UnavailableError, InvalidArgumentError) as exc:
                    _log.error("executor_step_failed", error=str(exc), step_id=plan.step_id)
                    self._executor_lost(str(exc))
                    break
                if sent:
                    self.step_times.overlapped += 1
                sent.append(_Sent(plan, scheduled - started, time.perf_counter() - scheduled))
            if self.core is not core:
                continue
            if not sent:
                self._wake.clear()
                if self._pending_close:
                    self._publish_queue.put_nowait(_Published([], self._take_pending_close()))
                await self._wake.wait()
                continue
            step = sent.popleft()
            plan = step.plan
            waited = time.perf_counter()
            try:
                result = await self.executor.receive(plan.step_id)
            except (UnavailableError, InvalidArgumentError) as exc:
                _log.error("executor_step_failed", error=str(exc), step_id=plan.step_id)
                self._executor_lost(str(exc))
                continue
            if self.core is not core:
                continue
            stepped = time.perf_counter()
            updates = core.update(plan, result)
            self.step_count += 1
            self.last_step_time = self.clock()
            totals = self.step_times
            totals.steps += 1
            totals.sequences += len(plan.new) + len(plan.running)
            totals.schedule_s += step.schedule_s
            totals.executor_s += step.send_s + stepped - waited
            totals.update_s += time.perf_counter() - stepped
            closed = self._take_pending_close()
            for update in updates:
                tracked = self._tracked.get(update.request_id)
                if update.finish_reason is not None and tracked is not None:
                    closed.append((update.seq_id, tracked.tokenizer))
            self._publish_queue.put_nowait(_Published(updates, closed))
            # Let RPC handlers and the publisher run between steps.
            await asyncio.sleep(0)

    def _speculating(self, core: Scheduler) -> bool:
        """Some running request would verify drafts: keep one step in flight (see above)."""
        if self.drafter is None or not self.drafter.connected:
            return False
        return any(r.draft_length is not None and r.draft_length.wants_drafts() for r in core.running)

    async def _draft(self, core: Scheduler) -> None:
        """Ask the drafter for the requests ready to verify drafts; set what comes back in time."""
        if not self.drafter.connected:
            return
        asks = []
        for request in core.requests_ready_to_draft():
            k = request.draft_length.next_k()
            if k > 0:
                asks.append((request, k))
        if not asks:
            return
        drafts = await self.drafter.propose(asks, (r.seq_id for r in core.running))
        if drafts is None:  # no answer in time: this step goes without drafts
            return
        for request, _ in asks:
            draft = drafts.get(request.seq_id)
            if draft and not request.is_finished:
                request.spec_token_ids = draft
            elif not draft:
                request.draft_length.observe_no_draft()

    def _take_pending_close(self) -> list[tuple[int, int]]:
        closed, self._pending_close = self._pending_close, []
        return closed

    def _on_executor_lost(self) -> None:
        self._wake.set()  # the step loop, if idle, finds the link disconnected and reconnects

    def _executor_lost(self, error: str) -> None:
        """End every request with Finished (error), drop the core (its block accounting
        described the dead executor's memory) and reconnect in the background."""
        self._end_all(error)
        self.core = None
        # run_service froze the objects alive at start-up out of the cyclic GC, the first core
        # among them; its free-block list is a cycle, so without this it would never be freed
        # (about 100 bytes a KV block, once per process: later cores are not frozen).
        gc.unfreeze()
        self._serving_changed()
        self._reconnecting = asyncio.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """Retry until the executor is back; health reports NOT_SERVING meanwhile."""
        # Free the dropped core now (the step loop has let go of it by the time this task
        # runs), not at some later full collection, so the next core's blocks and the load
        # that resumes can reuse its memory. One full collection per executor loss, while no
        # request runs.
        gc.collect()
        delay = 0.2
        while not self._stopping:
            try:
                await self._connect_executor()
            except Exception as exc:  # noqa: BLE001 - e.g. a config the core refuses: keep trying, loudly
                _log.warning("executor_reconnect_failed", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self._serving_changed()
            self._wake.set()
            return

    def _on_tokenizer_lost(self, index: int) -> None:
        """A tokenizer's Detokenize session ended: end the requests whose text state lived
        there, and reconnect that link in the background."""
        link = self.tokenizers.links[index]
        _log.error("tokenizer_lost", address=link.address)
        self._end_all(f"tokenizer at {link.address} went away", tokenizer=index)
        self._pending_close = [(seq, i) for seq, i in self._pending_close if i != index]
        self._serving_changed()
        if not self._stopping and index not in self._tokenizer_reconnects:
            self._tokenizer_reconnects[index] = asyncio.create_task(self._reconnect_tokenizer(index),
                                                                    name=f"tokenizer-{index}-reconnect")

    async def _reconnect_tokenizer(self, index: int) -> None:
        link = self.tokenizers.links[index]
        delay = 0.1
        try:
            while not self._stopping:
                try:
                    await link.connect(min(self.connect_timeout_s, 2.0))
                except Exception as exc:  # noqa: BLE001 - keep trying, loudly
                    _log.warning("tokenizer_reconnect_failed", address=link.address, error=str(exc),
                                 retry_in_s=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                _log.info("tokenizer_reconnected", address=link.address)
                return
        finally:
            self._tokenizer_reconnects.pop(index, None)
            self._serving_changed()
            self._wake.set()

    def _serving_changed(self) -> None:
        """Tell health what ``ready`` now says, in order, from one task."""
        if self._serving_task is None or self._serving_task.done():
            self._serving_task = asyncio.create_task(self._report_serving(), name="scheduler-health")

    async def _report_serving(self) -> None:
        while not self._stopping and self._serving_reported != self.ready:
            self._serving_reported = self.ready
            _log.info("serving_changed", serving=self._serving_reported)
            await self.on_serving_change(self._serving_reported)

    def _end_all(self, error: str, tokenizer: int | None = None) -> None:
        """End every request (or those pinned to one tokenizer) with a final Finished whose
        reason is error: one Finished per stream, whatever it had already received."""
        now = self.clock()
        for request_id, tracked in list(self._tracked.items()):
            if tokenizer is not None and tracked.tokenizer != tokenizer:
                continue
            del self._tracked[request_id]
            if self.core is not None:
                self.core.finish_request(request_id, FinishReason.ERROR)
            if tracked.stream_opened and tokenizer is None:
                self._pending_close.append((tracked.state.request.seq_id, tracked.tokenizer))
            delta = tracked.state.abort(now, FinishReason.ERROR)
            delta.error_message = error
            tracked.handle.queue.put_nowait(delta)
            self.on_finished(delta, tracked.state.output)
        self._wake.set()

    # ------------------------------------------------------------------ detokenize + publish
    async def _publish(self) -> None:
        while True:
            items = [await self._publish_queue.get()]
            # Steps that queued while the last reply was awaited (the publisher fell behind the
            # loop, as it does when the cores are contended) go out in one Detokenize message per
            # tokenizer: each message is a write and a read in two processes. Only requests
            # without stop strings: their text is needed at once, to stop at the right token.
            while not self._publish_queue.empty():
                items.append(self._publish_queue.get_nowait())
            groups = [items] if len(items) > 1 and all(map(self._text_can_wait, items)) else [[i] for i in items]
            for group in groups:
                try:
                    await self._publish_steps(group)
                except Exception as exc:  # noqa: BLE001 - the publisher must outlive any one step
                    _log.exception("publish_failed", error=str(exc))
                    now = self.clock()
                    for update in (u for item in group for u in item.updates):
                        tracked = self._tracked.pop(update.request_id, None)
                        if tracked is not None:
                            if self.core is not None:
                                self.core.finish_request(update.request_id, FinishReason.ERROR)
                            delta = tracked.state.abort(now, FinishReason.ERROR)
                            delta.error_message = f"detokenizing failed: {exc}"
                            tracked.handle.queue.put_nowait(delta)
                            self.on_finished(delta, tracked.state.output)

    def _text_can_wait(self, item: _Published) -> bool:
        """No request of `item` has stop strings (whose text must be checked step by step)."""
        for update in item.updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is not None and tracked.state.output.matcher is not None:
                return False
        return True

    async def _publish_steps(self, items: list[_Published]) -> None:
        """Detokenize and publish the updates of `items` (consecutive steps, oldest first).

        A stream's tokens of several steps go in one entry; its text goes to its last update
        and the earlier ones publish their tokens with empty text (see _publish).
        """
        self.step_times.detokenize_rounds += 1
        n = len(self.tokenizers.links)
        batches = [DetokenizeBatch([], [], []) for _ in range(n)]
        live: list[tuple[RequestUpdate, _Tracked]] = []
        entries: dict[int, list[int]] = {}
        """seq id -> its token list in a batch (several steps' tokens appended to one)."""
        for update in (u for item in items for u in item.updates):
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            batch = batches[tracked.tokenizer]
            if not tracked.stream_opened:
                tracked.stream_opened = True
                prompt_tail = tracked.state.request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
                batch.new_streams.append((update.seq_id, prompt_tail))
            if update.seq_id in entries:
                entries[update.seq_id].extend(update.new_token_ids)
            else:
                entries[update.seq_id] = ids = list(update.new_token_ids)
                batch.appended.append((update.seq_id, ids))
            live.append((update, tracked))
        for seq_id, index in (c for item in items for c in item.closed):
            batches[index].closed.append(seq_id)
        active = [i for i, b in enumerate(batches) if b.new_streams or b.appended or b.closed]
        links = self.tokenizers.links
        active = [i for i in active if links[i].connected]  # a lost link's requests have ended
        if len(active) == 1:
            # One tokenizer (the usual stack): awaited directly, since gather wraps each call in
            # a Task: 14-18 us of CPU per step, measured on this 2-core CPU (see docs/benchmarks.md).
            try:
                replies = [await links[active[0]].detokenize(batches[active[0]])]
            except Exception as exc:  # noqa: BLE001 - sorted below as gather's would be
                replies = [exc]
        else:
            replies = await asyncio.gather(*(links[i].detokenize(batches[i]) for i in active), return_exceptions=True)
        texts: dict[int, str] = {}
        for reply in replies:
            if isinstance(reply, UnavailableError):
                # The link called on_lost: its requests have ended with Finished (error).
                _log.error("detokenize_failed", error=str(reply))
            elif isinstance(reply, BaseException):
                raise reply
            else:
                texts.update(reply)
        now = self.clock()
        last = {update.seq_id: position for position, (update, _) in enumerate(live)}
        for position, (update, tracked) in enumerate(live):
            if self._tracked.get(update.request_id) is not tracked:
                continue
            text = texts.get(update.seq_id, "") if last[update.seq_id] == position else ""
            delta, stop_string = tracked.state.on_update(update, text, now)
            if stop_string is not None and self.core is not None:
                self.core.finish_request(update.request_id, FinishReason.STOP, stop_string)
                self._pending_close.append((update.seq_id, tracked.tokenizer))
                self._wake.set()
            tracked.handle.queue.put_nowait(delta)
            if delta.finished:
                del self._tracked[update.request_id]
                self.on_finished(delta, tracked.state.output)


async def _ignore_serving_change(serving: bool) -> None:
    return None
