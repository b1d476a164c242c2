"""One Generate call's life in the scheduler, protobuf-free: from the door to its last delta.

The servicer turns the message into an intake (intake.py) and deltas into messages
(generation_codec.py); everything between is here: the call's id and its key among the
running requests, its place in the waiting queue, its tenant's token reservation, the deltas
it reads, the abort when its client goes away, and what it is charged however it ends.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import structlog

from services.common.errors import InvalidArgumentError
from services.common.metrics import TenantMetrics
from services.scheduler.admission import Admission
from services.scheduler.auth import AuthTable, Tenant, salted_scope
from services.scheduler.intake import Intake
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request_limits import MAX_FAIRNESS_KEY_CHARS, MAX_REQUEST_ID_CHARS
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


@dataclass
class GenerateCalls:
    """What every Generate call shares: the engine, the door, and the tenants' budgets and metrics
    (``auth_table`` is replaced when the tokens file is reloaded: auth.reload_auth)."""

    supervisor: Supervisor
    admission: Admission
    """The bounded queue at the door: refuses a request before it is tokenized."""
    auth_table: AuthTable | None = None
    tenant_metrics: TenantMetrics | None = None

    def open(self, request_id: str, tenant: Tenant | None, fairness_key: str) -> GenerateCall:
        """A new call, through the door: refused while the executor is away or its id is in use,
        and when the queue is full (before anything is parsed or tokenized)."""
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
        share = scheduling_tenant(tenant, fairness_key)
        return GenerateCall(self, request_id, key, tenant, share, self.admission.enter(share))

    def budget(self, tenant: Tenant | None) -> TokenBudget | None:
        table = self.auth_table
        return None if tenant is None or table is None else table.budget(tenant)

    def settle(self, tenant: Tenant | None, reservation: Reservation | None, prompt_tokens: int,
               final: GenerationDelta | None) -> None:
        """However a request ended: its tenant is charged what it used (its reservation settled)
        and its metrics observe it."""
        if tenant is None:
            return
        usage = final.usage if final is not None else None
        completion = usage.completion_tokens if usage is not None else 0
        budget = self.budget(tenant)
        if budget is not None and reservation is not None:
            budget.settle(reservation, prompt_tokens + completion)
        if self.tenant_metrics is not None and final is not None and usage is not None:
            self.tenant_metrics.observe_finished(tenant.name, final.finish_reason.value, usage.prompt_tokens,
                                                 completion)


class GenerateCall:
    """One request from its place in the queue to its final delta: ``submit``, ``next_delta``
    until None, ``end``; ``leave`` gives up its place in the queue (at its first output, or when
    it ends before one)."""

    def __init__(self, calls: GenerateCalls, request_id: str, key: str, tenant: Tenant | None, share: str,
                 place) -> None:
        self._calls = calls
        self.request_id = request_id
        self.key = key
        self.tenant = tenant
        self.share = share
        self._place = place
        self._deltas: asyncio.Queue | None = None
        self._reservation: Reservation | None = None
        self._prompt_tokens = 0
        self.final: GenerationDelta | None = None

    def submit(self, intake: Intake, most_tokens: int, cache_salt: str, adapter: str) -> int:
        """Reserve the tenant's tokens and submit the request; its prompt's length."""
        budget, scope = self._calls.budget(self.tenant), self.tenant.cache_scope if self.tenant is not None else ""
        reservation = budget.reserve(self.tenant.name, most_tokens) if budget is not None else None
        try:
            self._deltas = self._calls.supervisor.submit(
                self.key, intake.prompt_ids, intake.sampling, intake.stop, intake.priority, adapter=adapter,
                num_speculative_tokens=intake.num_speculative_tokens, tenant=self.share,
                cache_scope=salted_scope(scope, cache_salt))
        except BaseException:
            if reservation is not None:
                budget.settle(reservation, 0)  # refused: nothing was used
            raise
        self._reservation = reservation
        self._prompt_tokens = len(intake.prompt_ids)
        _log.info("request_started", prompt_tokens=self._prompt_tokens, max_tokens=intake.stop.max_tokens)
        return self._prompt_tokens

    async def next_delta(self) -> GenerationDelta | None:
        """The next output, with those queued behind it folded in; None after the final one."""
        if self.final is not None:
            return None
        item = await self._deltas.get()
        self.leave()  # first output: it is no longer queued
        coalesce(item, self._deltas)
        if item.finished:
            self.final = item
            _log.info("request_finished", finish_reason=item.finish_reason.value,
                      completion_tokens=item.usage.completion_tokens if item.usage else None)
        return item

    def end(self) -> None:
        """After a submitted request's stream: a client that went away (cancelled, deadline) has
        its request aborted and its blocks freed now; then it is settled (``GenerateCalls.settle``)."""
        if self.final is None:
            self._calls.supervisor.abort(self.key)
            self.final = _final_delta(self._deltas)  # the abort's, or one that came unread
            _log.info("request_cancelled")
        self._calls.settle(self.tenant, self._reservation, self._prompt_tokens, self.final)

    def leave(self) -> None:
        self._calls.admission.leave(self._place)
