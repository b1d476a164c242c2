"""The engine core: one loop for the services and the in-process engine, over one or more executors.

Transport-free: executors, detokenizers and the drafter are ports (ports.py). The scheduler
service drives it with gRPC links (services/scheduler/supervisor.py), the in-process engine
with local objects (services/inprocess/), both through ``step`` (one round of every
executor) or ``run`` (each executor's rounds as a task of its own), so "services vs
in-process" compares the same loop over two transports.

Each executor is an ``ExecutorLane`` (lane.py): its port, the scheduler core of its memory
(block manager, prefix cache, waiting queue, fairness and priorities are per executor) and
its steps in flight. A request is placed at admission on the executor holding the longest
cached prefix of its prompt, else the least loaded (placement.py). Sequence ids come from
one counter, so the drafter and the text streams see one namespace over all executors.

When an executor is lost, its requests move to the others as a preemption by recompute:
the engine knows every token of every request, so each restarts from its known tokens and
its stream goes on (the client sees a pause; greedy and seeded tokens are those of a run
without the loss, since seeded draws depend on the position only). With no executor left
they wait ``executor_wait_s`` for one to come back, then end with one Finished (error)
(failover.py; each lane's task is lane_tasks.py's).

Executors may take a role (prefill, decode, mixed): handoff.py moves a request whose prompt a
prefill executor computed to a decode executor, its KV blocks copied executor to executor.

Request handlers call ``submit``/``abort`` on the same event loop (no locks); each request's
deltas go to its sink.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence

from services.common.errors import ResourceExhaustedError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.kv_slots import KVSlotUsage, kv_slot_usage
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.core.stats import SchedulerStats, combined_stats
from services.scheduler.core.waiting_queue import QueueFullError
from services.scheduler.engine.adapters import AdapterTable, adapter_scope
from services.scheduler.engine.drafting import Drafting
from services.scheduler.engine.failover import Failover
from services.scheduler.engine.handoff import Handoff, HandoffContext
from services.scheduler.engine.lane import ExecutorLane, LaneContext
from services.scheduler.engine.lane_tasks import LaneTasks
from services.scheduler.engine.placement import ANY_ROLE, ROLES_FOR_NEW, choose_lane
from services.scheduler.engine.ports import DetokenizerPort, DrafterPort, ExecutorPort
from services.scheduler.engine.publisher import Publisher
from services.scheduler.engine.request_table import FinishedObserver, RequestTable
from services.scheduler.engine.step_times import StepTimeTotals
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request
from services.scheduler.request.stream import DeltaSink, RequestStream
from services.scheduler.request.stop import StopConditions

EXECUTOR_UNAVAILABLE = "the executor is unavailable (restarting or unreachable); retry shortly"
"""What a request hears while no executor is attached. No address: the door sends it before
authentication, to any caller."""


def model_eos_token_ids(tokenizer_eos_token_ids: Sequence[int], info: ExecutorInfo) -> tuple[int, ...]:
    """The EOS ids every request stops at: the tokenizer's when it names any, else the
    model config's (as the executor reports them)."""
    return tuple(tokenizer_eos_token_ids) or tuple(info.eos_token_ids)


class EngineCore:
    def __init__(self, limits: SchedulerLimits, detokenizers: Sequence[DetokenizerPort], *,
                 drafter: DrafterPort | None = None, speculation: SpeculationConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, on_finished: FinishedObserver | None = None,
                 on_executor_lost: Callable[[str, str], None] | None = None) -> None:
        if not detokenizers:
            raise ValueError("an engine needs at least one detokenizer")
        self.limits = limits
        self.detokenizers = list(detokenizers)
        self.clock = clock
        self.lanes: dict[str, ExecutorLane] = {}
        self.eos_token_ids: tuple[int, ...] = ()
        self._seq_ids = itertools.count()
        self.tasks = LaneTasks()
        self.requests = RequestTable(self.detokenizers, clock, self._finish_in_core, on_finished, self.wake)
        self.failover = Failover(self.lanes, self.requests, self.tasks, limits.executor_wait_s,
                                 on_executor_lost or (lambda name, error: None))
        self.step_times = StepTimeTotals()
        self.publisher = Publisher(self.requests, self.detokenizers, clock, self.step_times)
        live = lambda: [r.seq_id for lane in self.lanes.values() for r in lane.scheduler.running]  # noqa: E731
        drafting = Drafting(drafter, speculation or SpeculationConfig(), live) if drafter else None
        self.drafting = drafting
        self.handoff = Handoff(HandoffContext(self.lanes, self.requests, self.failover.requeue))
        self.adapters = AdapterTable()
        """The LoRA adapters requests may name (services/scheduler/engine/adapters.py)."""
        self._context = LaneContext(limits, clock, self.requests, self.publisher, self.step_times, drafting,
                                    self.failover.lost, self.handoff.after_update)

    # ------------------------------------------------------------------ executors
    def attach(self, name: str, port: ExecutorPort, info: ExecutorInfo,
               tokenizer_eos_token_ids: Sequence[int] = ()) -> ExecutorLane:
        """Serve on this executor under ``name``: a scheduler core for its memory
        (SchedulerConfig.for_executor raises ValueError naming the limit its facts break).
        Requests parked for want of an executor move to it."""
        if name in self.lanes:
            raise ValueError(f"executor {name!r} is already attached")
        scheduler = Scheduler(SchedulerConfig.for_executor(self.limits, info), self._seq_ids)
        self.eos_token_ids = model_eos_token_ids(tokenizer_eos_token_ids, info)
        self.adapters.learn(info.adapters)
        lane = ExecutorLane(name, port, info, scheduler, self._context)
        self.lanes[name] = lane
        self.tasks.start(lane)
        for request in self.failover.parked.take_all():
            self.failover.requeue(request)
        lane.wake()
        return lane

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler core of the only (or first) executor: for one-executor engines and tests."""
        lane = next(iter(self.lanes.values()), None)
        return lane.scheduler if lane is not None else None

    def wake(self) -> None:
        """Make idle lanes look again (a port or a request changed state)."""
        for lane in self.lanes.values():
            lane.wake()

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, stop: StopConditions,
               sink: DeltaSink, priority: int = 0, num_speculative_tokens: int | None = None,
               tenant: str = "", cache_scope: str = "", adapter: str = "") -> RequestStream:
        """Admit a request on the executor placement chooses; its deltas go to ``sink``, the
        last one finished.

        Raises UnavailableError while no executor (or no detokenizer) takes new requests,
        InvalidArgumentError for a request_id in use, ValueError (naming the field) for a
        request the scheduler core refuses, ResourceExhaustedError when the waiting queue is
        full. ``tenant`` ("" without authentication) is whom admission is fair between;
        ``cache_scope`` whose cached prefixes it may reuse (Request.cache_scope); ``adapter``
        the LoRA adapter it runs with ("" = the base model; NotFoundError when none of that name
        is loaded), which narrows that scope to the adapter's weights.
        """
        if adapter:
            cache_scope = adapter_scope(cache_scope, self.adapters.resolve(adapter))
        detokenizer = self.requests.check_new(request_id)
        now = self.clock()
        request = Request(request_id, prompt_ids, sampling, stop, self.eos_token_ids, priority=priority,
                          arrival_time=now, tenant=tenant, cache_scope=cache_scope, adapter=adapter)
        lanes = list(self.lanes.values())
        lane = choose_lane(request, lanes, ROLES_FOR_NEW) or choose_lane(request, lanes, ANY_ROLE)
        if lane is None:
            raise UnavailableError(EXECUTOR_UNAVAILABLE)
        try:
            lane.scheduler.add_request(request)
        except QueueFullError as exc:
            raise ResourceExhaustedError(str(exc)) from None
        if self.drafting is not None:
            request.draft_length = self.drafting.draft_length(num_speculative_tokens)
        stream = self.requests.add(request, now, sink, detokenizer)
        lane.wake()
        return stream

    def abort(self, request_id: str) -> GenerationDelta | None:
        """End a request from outside (client cancelled, Abort RPC); its blocks are freed now.
        Returns its final delta (also sent to its sink), None for an unknown id."""
        stream = self.requests.get(request_id)
        return self.requests.end(stream, FinishReason.ABORT) if stream is not None else None

    def has_unfinished(self) -> bool:
        return len(self.requests) > 0

    def stats(self) -> SchedulerStats | None:
        """Every executor's gauges and counters summed; None while none is attached."""
        return combined_stats([lane.scheduler.get_stats() for lane in self.lanes.values()]) if self.lanes else None

    def kv_slots(self) -> KVSlotUsage | None:
        usages = [kv_slot_usage(lane.scheduler.running, lane.scheduler.config.block_size,
                                 len(lane.scheduler.config.kv_group_windows))
                  for lane in self.lanes.values()]
        if not usages:
            return None
        return KVSlotUsage(sum(u.allocated_slots for u in usages), sum(u.used_slots for u in usages))

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Each executor's rounds as a task of its own, until cancelled."""
        await self.tasks.run(list(self.lanes.values()))

    async def step(self) -> bool:
        """One round of every executor, concurrently. False when none had anything to do."""
        lanes = list(self.lanes.values())
        if not lanes:
            return False
        return any(await asyncio.gather(*(lane.round() for lane in lanes)))

    def _finish_in_core(self, request_id: str, reason: FinishReason, stop_string: str | None) -> None:
        self.failover.parked.forget(request_id)
        self.handoff.forget(request_id)
        for lane in self.lanes.values():
            if lane.scheduler.finish_request(request_id, reason, stop_string):
                return
