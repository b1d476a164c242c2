"""The door of the Generation API: a bounded queue overall and per tenant, answered at once.

A request holds a place from the moment it passes the door until its first output (or its
end): while it is tokenized, waits in the core's queue and runs its prefill. Beyond the bound
the answer is RESOURCE_EXHAUSTED before anything is tokenized or copied, so a burst is refused
in well under a millisecond of scheduler time instead of queueing behind the tokenizer.

The refusal carries a ``grpc-retry-pushback-ms`` trailer: how long the places ahead take to
drain at the rate they have been draining (places freed per second over the last
``DRAIN_WINDOW_S``), so a client that honours it (gRPC's retry policy does: see
``docs/retry_service_config.json``) comes back about when there is room.

The overall bound is checked twice. First by ``DoorInterceptor``, the server's outermost
interceptor: while the queue is full it answers a Generate call with a prebuilt handler that
neither parses the request body nor enters the error mapping, the servicer or a log line (a
burst of refusals must cost the event loop as little as gRPC allows). Then by the servicer, whose
``enter`` takes the place (a place may have filled between the two) and checks the per-tenant
bound, which needs the authenticated tenant.

No I/O, no locks: called from the one event loop; the clock is injected for tests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import grpc.aio

from services.common.errors import ResourceExhaustedError

GENERATE_METHOD = "/tokenmill.v1.Generation/Generate"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

DRAIN_WINDOW_S = 10.0
"""The drain rate is measured over this many recent seconds."""
MIN_PUSHBACK_S = 0.05
MAX_PUSHBACK_S = 30.0
UNMEASURED_PUSHBACK_S = 1.0
"""Pushback while nothing has drained yet in the window (no rate to go by)."""


class DrainRate:
    """Places freed per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = DRAIN_WINDOW_S) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def per_second(self, now: float) -> float | None:
        """None until something drained within the window."""
        self._trim(now)
        if not self._times:
            return None
        # Over the span actually observed (at least a second), so a fresh burst of releases
        # is not read as a huge rate.
        span = max(now - self._times[0], 1.0)
        return len(self._times) / min(span, self.window_s)

    def pushback_s(self, ahead: int, now: float) -> float:
        """How long ``ahead`` places take to drain at the measured rate (clamped)."""
        rate = self.per_second(now)
        if rate is None:
            return UNMEASURED_PUSHBACK_S
        return min(max(ahead / rate, MIN_PUSHBACK_S), MAX_PUSHBACK_S)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()


@dataclass(slots=True)
class Place:
    """One request's place in the queue; ``Admission.leave`` frees it once."""

    tenant: str
    left: bool = False


class Admission:
    """Bounded places overall (``max_queued``) and per tenant (``max_queued_per_tenant``, 0 =
    only the overall bound). Tenant "" (authentication off) has only the overall bound."""

    def __init__(self, max_queued: int, max_queued_per_tenant: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _check_bounds(max_queued, max_queued_per_tenant)
        self.max_queued = max_queued
        self.max_queued_per_tenant = max_queued_per_tenant
        self.clock = clock
        self.queued = 0
        self.per_tenant: dict[str, int] = {}
        self.drain = DrainRate()
        self.rejected = 0

    @property
    def full(self) -> bool:
        """The overall bound is reached: a request arriving now is refused whoever sends it."""
        return self.queued >= self.max_queued

    def refuse_full(self) -> tuple[str, float]:
        """Count a refusal by the overall bound: (message naming the bound, pushback seconds)."""
        # The bound, not the depth: the door may answer before the caller is known.
        return self._refusal(f"the queue is full (max_waiting_requests={self.max_queued})", self.queued)

    def enter(self, tenant: str = "") -> Place:
        """Take a place, or raise ResourceExhaustedError naming the bound, with a pushback."""
        per_tenant = self.per_tenant.get(tenant, 0)
        if self.queued >= self.max_queued:
            message, retry_s = self.refuse_full()
            raise ResourceExhaustedError(message, retry_after_s=retry_s)
        if tenant and self.max_queued_per_tenant and per_tenant >= self.max_queued_per_tenant:
            message, retry_s = self._refusal(f"tenant {tenant!r} has {per_tenant} requests queued, "
                                             f"max_waiting_per_tenant={self.max_queued_per_tenant}", per_tenant)
            raise ResourceExhaustedError(message, retry_after_s=retry_s)
        self.queued += 1
        self.per_tenant[tenant] = per_tenant + 1
        return Place(tenant)

    def leave(self, place: Place) -> None:
        """Free the place (first output, or the request ended); later calls do nothing."""
        if place.left:
            return
        place.left = True
        self.queued -= 1
        remaining = self.per_tenant[place.tenant] - 1
        if remaining:
            self.per_tenant[place.tenant] = remaining
        else:
            del self.per_tenant[place.tenant]
        self.drain.record(self.clock())

    def pushback_s(self, ahead: int) -> float:
        """How long ``ahead`` places take to drain at the measured rate (clamped)."""
        return self.drain.pushback_s(ahead, self.clock())

    def _refusal(self, message: str, ahead: int) -> tuple[str, float]:
        self.rejected += 1
        retry_s = self.pushback_s(ahead)
        return f"{message}; retry in {retry_s:.2f} s", retry_s


def _check_bounds(max_queued: int, max_queued_per_tenant: int) -> None:
    if max_queued < 1:
        raise ValueError(f"max_queued must be >= 1, got {max_queued}")
    if max_queued_per_tenant < 0:
        raise ValueError(f"max_queued_per_tenant must be >= 0 (0 = no per-tenant bound), "
                         f"got {max_queued_per_tenant}")


AUTO_SHARE_TENANTS = 4
"""With authentication and no --max-waiting-per-tenant, each tenant may hold
max_waiting_requests / min(tenants, AUTO_SHARE_TENANTS) places."""


def per_tenant_bound(configured: int, max_queued: int, num_tenants: int) -> int:
    """The per-tenant bound Admission gets: ``configured`` when set (> 0); -1: none; 0 (the
    default): none without authentication (``num_tenants`` 0), else an equal share of the queue
    among up to AUTO_SHARE_TENANTS tenants, so one tenant can never fill the queue that every
    tenant shares (one tenant alone may use all of it)."""
    if configured > 0:
        return configured
    if configured < 0 or num_tenants <= 1:
        return 0
    return max(1, max_queued // min(num_tenants, AUTO_SHARE_TENANTS))


def pushback_trailer(retry_s: float) -> tuple[tuple[str, str], ...]:
    return ((PUSHBACK_TRAILER, str(max(0, round(retry_s * 1000)))),)


class DoorInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Generate, before its body is parsed (outermost interceptor), while the queue is
    full (RESOURCE_EXHAUSTED with the pushback) or no request can be accepted at all
    (UNAVAILABLE: ``unavailable`` names why, e.g. the executor is restarting).

    While the executor restarts, retrying clients send calls by the ten thousand; refused here,
    each costs no decoding, interceptor, servicer or log line, and leaves the scheduler's heap
    as it was. Measured with ``python -m benchmarks overload``: see docs/benchmarks.md, "Hardening runs".
    Other methods (health, GetProfile, Abort) always pass, so the server still answers its
    health checks (NOT_SERVING while the executor is away).
    """

    def __init__(self, admission: Admission, method: str = GENERATE_METHOD,
                 unavailable: Callable[[], str | None] | None = None) -> None:
        self.admission = admission
        self.method = method
        self.unavailable = unavailable

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method != self.method:
            return await continuation(handler_call_details)
        reason = self.unavailable() if self.unavailable is not None else None
        if reason is not None:
            return _refusal(grpc.StatusCode.UNAVAILABLE, reason, ())
        if not self.admission.full:
            return await continuation(handler_call_details)
        message, retry_s = self.admission.refuse_full()
        return _refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message, pushback_trailer(retry_s))


def _refusal(code: grpc.StatusCode, message: str, trailers) -> grpc.RpcMethodHandler:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message, trailing_metadata=trailers)

    # No deserializer: the body stays raw bytes, never parsed. A coroutine (not an async
    # generator) as a unary-stream behaviour is grpc.aio's writer form; it writes nothing.
    return grpc.unary_stream_rpc_method_handler(refuse)
