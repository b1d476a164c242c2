"""The public Generation API: a thin adapter between protobuf and the scheduler loop."""

from __future__ import annotations

import asyncio
import uuid

import structlog

from services.common.errors import InvalidArgumentError
from services.common.metrics import TenantMetrics
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.step import ExecutorInfo
from services.scheduler.admission import Admission
from services.scheduler.auth import AuthTable, Tenant, current_tenant, salted_scope
from services.scheduler.generation_codec import delta_to_protos, model_info_to_proto, profile_to_proto
from services.scheduler.intake import GenerateIntake
from services.common.latency_profile import LatencyProfileRecorder
from services.scheduler.profile_cache import ProfileCache
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request_limits import MAX_FAIRNESS_KEY_CHARS, MAX_REQUEST_ID_CHARS, RequestLimits
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.supervisor import Supervisor
from services.scheduler.token_budget import Reservation, TokenBudget

_log = structlog.get_logger("tokenmill.scheduler")


def coalesce(delta: GenerationDelta, queue: asyncio.Queue) -> None:
    """Fold the deltas already waiting behind ``delta`` into it: one write for all of them.

    They wait only while this stream's previous write was still in flight, so a client that
    keeps up gets every step as it comes, and one that falls behind (or a server short of CPU)
    gets fewer, larger messages rather than a backlog. Stops at the final delta.
    """
    while not delta.finished and not queue.empty():
        delta.absorb(queue.get_nowait())


def scoped_request_id(tenant: Tenant | None, request_id: str) -> str:
    """The engine's id of a tenant's request: request ids are one namespace per tenant, so one
    tenant can neither see ("already in use") nor abort another's."""
    if tenant is None:
        return request_id
    return f"{len(tenant.name)}:{tenant.name}/{request_id}"


def scheduling_tenant(tenant: Tenant | None, fairness_key: str) -> str:
    """Whose share of the engine a request draws on (fairness, per-tenant queue bound, compile
    share): its tenant's, or its fairness_key's within it where the caller may split its share
    (any caller without authentication; a tenant with may_set_fairness_key)."""
    if len(fairness_key) > MAX_FAIRNESS_KEY_CHARS:  # before it keys any map
        raise InvalidArgumentError(f"fairness_key has {len(fairness_key)} characters; the limit "
                                   f"MAX_FAIRNESS_KEY_CHARS is {MAX_FAIRNESS_KEY_CHARS}")
    if tenant is None:
        return fairness_key
    return tenant.scheduling_tenant(fairness_key)


def _final_delta(queue: asyncio.Queue) -> GenerationDelta | None:
    """The finished delta among those queued and unread, if any."""
    final = None
    while not queue.empty():
        item = queue.get_nowait()
        if item.finished:
            final = item
    return final


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, supervisor: Supervisor, admission: Admission, *, max_prompt_chars: int = 0,
                 profile: LatencyProfileRecorder | None = None, model_name: str = "",
                 tenant_metrics: TenantMetrics | None = None, auth_table: AuthTable | None = None,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.supervisor = supervisor
        self.admission = admission
        """The bounded queue at the door: refuses a request before it is tokenized."""
        self.profile = profile
        self._profiles = ProfileCache(profile) if profile is not None else None
        """GetProfile's snapshots, cached and capped (profile_cache.py)."""
        self.model_name = model_name
        self.tenant_metrics = tenant_metrics
        self.auth_table = auth_table
        self.grammar_compiler = grammar_compiler or GrammarCompiler(SchedulerLimits().max_grammar_bytes)
        """Structured outputs, compiled at admission off the event loop (in the service, on its
        compile worker processes) and cached by content."""
        self.intake = GenerateIntake(supervisor, self.grammar_compiler, max_prompt_chars, model_name)

    def _executor_info(self) -> ExecutorInfo:
        return self.intake.executor_info()

    def limits(self) -> RequestLimits:
        return self.intake.limits()

    def _request_key(self, request_id: str, tenant) -> tuple[str, str]:
        """The call's request id (a fresh one when it gave none) and its key among the running
        requests (scoped by tenant); refused while the executor is away or the id is in use."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgumentError(f"request_id has {len(request_id)} characters; the limit is "
                                       f"{MAX_REQUEST_ID_CHARS}")
        request_id = request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        # While the executor is away (restarting), refuse at once: submit would refuse anyway,
        # after a tokenizer round trip for the prompt. The door (DoorInterceptor) refuses such
        # calls before they are decoded; this covers a call that passed it just before.
        self.supervisor.check_accepting()
        key = scoped_request_id(tenant, request_id)
        if self.supervisor.core.requests.get(key) is not None:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use by a running request")
        return request_id, key

    async def Generate(self, request, context):
        tenant = current_tenant.get()  # set by the auth interceptor; None without authentication
        request_id, key = self._request_key(request.request_id, tenant)
        share = scheduling_tenant(tenant, request.fairness_key)
        # The door first: a full queue is refused before anything is parsed or tokenized.
        place = self.admission.enter(share)
        try:
            intake = await self.intake.take(request, tenant, share)
            salt, adapter = request.cache_salt, request.adapter
            # The stream may last minutes: hold what was taken, not the message (the server's own
            # reference goes with RequestRelease, request_release.py).
            del request
            budget = self._budget(tenant)
            reservation = budget.reserve(tenant.name, self.intake.most_tokens(intake)) if budget is not None else None
            try:
                deltas = self.supervisor.submit(
                    key, intake.prompt_ids, intake.sampling, intake.stop, intake.priority,
                    num_speculative_tokens=intake.num_speculative_tokens,
                    tenant=share,
                    cache_scope=salted_scope(tenant.cache_scope if tenant is not None else "", salt),
                    adapter=adapter)
            except BaseException:
                if reservation is not None:
                    budget.settle(reservation, 0)  # refused: nothing was used
                raise
            prompt_tokens = len(intake.prompt_ids)
            _log.info("request_started", prompt_tokens=prompt_tokens, max_tokens=intake.stop.max_tokens)
            del intake
            final: GenerationDelta | None = None
            try:
                yield generation_pb2.GenerateResponse(
                    started=generation_pb2.Started(request_id=request_id, prompt_tokens=prompt_tokens))
                while final is None:
                    item = await deltas.get()
                    self.admission.leave(place)  # first output: it is no longer queued
                    coalesce(item, deltas)
                    for message in delta_to_protos(item):
                        yield message
                    if item.finished:
                        final = item
                        _log.info("request_finished", finish_reason=item.finish_reason.value,
                                  completion_tokens=item.usage.completion_tokens if item.usage else None)
            finally:
                if final is None:
                    # The client went away (cancelled, deadline): free its blocks now.
                    self.supervisor.abort(key)
                    final = _final_delta(deltas)  # the abort's, or one that came unread
                    _log.info("request_cancelled")
                self._ended(tenant, reservation, prompt_tokens, final)
        finally:
            self.admission.leave(place)

    def _budget(self, tenant: Tenant | None) -> TokenBudget | None:
        table = self.auth_table
        return None if tenant is None or table is None else table.budget(tenant)

    def _ended(self, tenant: Tenant | None, reservation: Reservation | None, prompt_tokens: int,
               final: GenerationDelta | None) -> None:
        """However the request ended: its tenant is charged what it used (its reservation
        settled) and its metrics observe it."""
        if tenant is None:
            return
        usage = final.usage if final is not None else None
        completion = usage.completion_tokens if usage is not None else 0
        budget = self._budget(tenant)
        if budget is not None and reservation is not None:
            budget.settle(reservation, prompt_tokens + completion)
        if self.tenant_metrics is not None and final is not None and usage is not None:
            self.tenant_metrics.observe_finished(tenant.name, final.finish_reason.value, usage.prompt_tokens,
                                                 completion)

    async def Abort(self, request, context):
        # Scoped to the caller: another tenant's request is as unknown as a made-up id.
        key = scoped_request_id(current_tenant.get(), request.request_id)
        return generation_pb2.AbortResponse(found=self.supervisor.abort(key))

    async def GetModelInfo(self, request, context):
        tokenizer = self.supervisor.tokenizers.info
        return model_info_to_proto(self._executor_info(), self.model_name, self.supervisor.core.eos_token_ids,
                                   tokenizer.tool_call_format if tokenizer is not None else "",
                                   self.supervisor.core.adapters.all())

    async def GetProfile(self, request, context):
        if self.profile is None:
            raise NotImplementedError("latency profiles are not enabled on this scheduler")
        window = request.window_seconds if request.HasField("window_seconds") else None
        core = self.supervisor.core
        executors = [(name, lane.role, lane.scheduler.get_stats(), core.handoff.counters.get(name))
                     for name, lane in core.lanes.items()]
        return profile_to_proto(self._profiles.snapshot(window), core.stats(), executors)
