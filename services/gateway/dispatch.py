"""One request through its route: rank the targets, call the first, move on when it fails early.

The dispatcher is the gateway's client of the engines' Generation API: it forwards the
GenerateRequest as it came (the HTTP front end builds one) and yields the engine's messages.
Started is held back until the first Delta (or Finished): until then nothing has been streamed
to the client, and a failure whose code the route retries (routing/build.py: UNAVAILABLE
always; RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED too under a ``fallback`` node), or a Finished
with reason ERROR (the engine lost its executor), moves the request to the next target, at most
``max_attempts`` in all. Once a token went out, a failure ends the stream. A request with a
structured output whose target went away UNAVAILABLE before Started (while admitting it) is
not retried: its structured output is quarantined (grammar_quarantine.py) and identical ones are
refused at once, so one hostile grammar cannot take down every replica in turn. That needs the
evidence of a death: the target was in the pool and off probation, the call reached it (not a
refused connection) and it did not answer busy; a target that is simply down is retried past
like any other failure before the first token.

A target at its rate limit (the routes file's ``requests_per_minute``/``tokens_per_minute``,
rate_limits.py) is passed over for the next in the ranking; with every ranked target at its
limit the request is refused (RESOURCE_EXHAUSTED with the shortest wait). Each call's tokens
(prompt + completion) settle its target's budget and are counted on the request's API key grant.

Each finished request feeds its target's estimator (TTFT and TPOT at the load it was sent
at) and the metrics; a call that fails UNAVAILABLE takes its target out of the pool at once.
Errors leave as the typed errors of services/common/errors.py (a RESOURCE_EXHAUSTED keeps the
engine's retry pushback), which each front end maps to its own statuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
import structlog

from services.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TokenmillError,
    UnavailableError,
    error_from_rpc,
)
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.grammar_quarantine import GrammarQuarantine, structured_digest
from services.gateway.metrics import GatewayMetrics
from services.gateway.pool import Target, TargetPool
from services.gateway.rate_limits import RateLimited, RateLimiter
from services.gateway.routing.breaker import TARGET_FAILURES
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import with_room_first
from services.gateway.upstreams.errors import UpstreamError, rpc_error

_log = structlog.get_logger("tokenmill.gateway.dispatch")

BACKOFF_S = 0.05
"""The first pause before ranking again once every ranked target failed retryably; doubled at
each further round, with full jitter (up to the request's deadline)."""

GOOD_FINISHES = (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_EOS)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished request as the gateway saw it (for the estimate's error and benchmarks)."""

    model: str
    target: str
    request_id: str
    estimate_ms: float | None
    """At dispatch, for the request's expected output tokens."""
    estimate_actual_ms: float | None
    """At dispatch, for the tokens it turned out to generate."""
    observed_ms: float
    ttft_ms: float
    completion_tokens: int
    sla_ms: float | None
    explore: bool


class _Retry(Exception):
    def __init__(self, code: str, error: TokenmillError, admitting: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.error = error
        self.admitting = admitting
        """The target was serving, the request reached it, and it went away before Started: it
        may have died of the request's structured output."""


CONNECT_FAILURES = ("failed to connect to all addresses", "DNS resolution failed", "Connection refused")
"""What grpc's details say when a call never reached its target (no connection could be made)."""


def reached(err: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call got to its target: False for a connection that was never made."""
    if isinstance(err, UpstreamError):
        return err.reached
    details = err.details() or ""
    return not any(sign in details for sign in CONNECT_FAILURES)


@dataclass(slots=True)
class _Call:
    """One attempt on one target, from its call's start to its end."""

    target: Target
    call: object
    """The engine's Generate call, or an HTTP upstream's equivalent."""
    request_id: str
    started_at: float
    load: float
    """The target's engine load when the call was sent (for its estimator)."""
    explore: bool
    probe: bool
    """The call is the target's circuit-breaker probe."""
    grant: object
    """The target's rate-limit grant, if it declares limits."""
    was_healthy: bool
    """The target was in the pool, not on probation, when the call was sent."""
    ttft_deadline: float | None
    replies: AsyncIterator = dataclasses.field(init=False)
    held: generation_pb2.GenerateResponse | None = None
    """Started, held back until the first Delta or Finished."""
    first_token_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    outcome: str = "cancelled"
    done: bool = False
    engine_failed: bool = False

    def __post_init__(self) -> None:
        self.replies = aiter(self.call)


def engine_error(err: grpc.aio.AioRpcError) -> TokenmillError:
    """The typed error of a failed engine call; RESOURCE_EXHAUSTED keeps the retry pushback."""
    error = error_from_rpc(err)
    if isinstance(error, ResourceExhaustedError):
        for key, value in err.trailing_metadata() or ():
            if key == "grpc-retry-pushback-ms":
                try:
                    error.retry_after_s = int(value) / 1000.0
                except ValueError:
                    pass
    return error


class Dispatcher:
    def __init__(self, routes: dict[str, Route], pool: TargetPool, *, default_model: str, max_attempts: int = 3,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.routes = routes
        self.pool = pool
        self.default_model = default_model
        self.max_attempts = max_attempts
        self.metrics = metrics or pool.metrics
        self.clock = clock
        self.live: dict[str, Target] = {}
        """request_id -> the target serving it now (for Abort)."""
        self.observers: list[Callable[[Outcome], None]] = []
        self.quarantine = GrammarQuarantine(clock)
        """Structured outputs a target died admitting: not sent again for a while."""
        self.rng = random.Random()
        """The backoff's jitter."""
        self.target_limits = {name: RateLimiter(target.spec.limits, f"target {name}", clock)
                              for name, target in pool.targets.items() if target.spec.limits}
        """The budgets of the targets that declare one."""

    def route(self, model: str) -> Route:
        """The route of a model id: a routes-file model, or a LoRA adapter one of its engines
        serves (its parent's route, with ``adapter`` set); NotFoundError naming the routes'
        models otherwise (never the adapters: an API key may be allowed only some of them)."""
        route = self.routes.get(model)
        if route is not None:
            return route
        parent = self.adapters().get(model)
        if parent is None:
            raise self.unknown_model(model)
        return dataclasses.replace(self.routes[parent], adapter=model)

    def unknown_model(self, model: str) -> NotFoundError:
        return NotFoundError(f"the model '{model}' does not exist (models: {', '.join(sorted(self.routes))})")

    def adapters(self) -> dict[str, str]:
        """Each LoRA adapter an engine target reports serving -> its route's model id (the
        first route in the routes file's order when several serve one name)."""
        found: dict[str, str] = {}
        for model, route in self.routes.items():
            for leaf in route.node.leaves():
                info = self.pool.targets[leaf.name].model_info
                for adapter in info.adapters if info is not None else ():
                    if adapter.name not in self.routes:
                        found.setdefault(adapter.name, model)
        return found

    def _serving(self, route: Route, ranked: Sequence) -> Sequence:
        """The ranked targets that serve the route's adapter (all of them for the base model)."""
        if not route.adapter:
            return ranked
        return [state for state in ranked if self.pool.serves_adapter(state.name, route.adapter)]

    async def generate(self, route: Route, request: RouteRequest, message: generation_pb2.GenerateRequest,
                       metadata: Sequence[tuple[str, str]] | None,
                       timeout_s: float) -> AsyncIterator[generation_pb2.GenerateResponse]:
        began = time.perf_counter()
        ranking = route.node.rank(request)
        self.metrics.routing_seconds.observe(time.perf_counter() - began)
        if not ranking.targets:
            if ranking.reason == "no_condition_matched":
                raise InvalidArgumentError(f"no routing rule of model '{route.model}' matches this request and the "
                                           "route has no default")
            raise UnavailableError(f"no healthy target serves model '{route.model}' now")
        if route.adapter and not self._serving(route, ranking.targets):
            raise UnavailableError(f"no healthy target of model '{route.model}' serves the model '{route.adapter}' now")
        digest = structured_digest(message)
        if digest is not None and self.quarantine.holds(digest):
            raise InvalidArgumentError("structured_output is quarantined: a target failed while admitting an "
                                       "identical one; it is refused without being sent")
        ranked = with_room_first(self._within_limits(route, self._serving(route, ranking.targets),
                                                     request.expected_output_tokens))
        deadline = self.clock() + timeout_s
        error: TokenmillError | None = None
        order = list(ranked)
        rounds = 0
        for attempt in range(self.max_attempts):
            if not order:
                # Every ranked target failed before its first token with a failure that is not the
                # request's doing: pause (exponential, jittered), rank again and retry; a target
                # that is only busy (a 503) is still in the pool and may be tried again.
                pause = BACKOFF_S * (2 ** rounds) * self.rng.random()
                rounds += 1
                if error is None or deadline - self.clock() <= pause:
                    break
                await asyncio.sleep(pause)
                order = with_room_first(list(self._within_limits(
                    route, self._serving(route, route.node.rank(request).targets), request.expected_output_tokens)))
                if not order:
                    break
            state = order.pop(0)
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise DeadlineExceededError(f"the request took more than {timeout_s:g} s")
            target = self.pool.targets[state.name]
            first = attempt == 0 and state is ranking.targets[0]
            reason = ranking.reason if first else "slots_full" if attempt == 0 else "fallback"
            self.metrics.decisions.labels(route.model, target.name, reason).inc()
            estimate = ranking.estimate_ms if first else None
            try:
                async for reply in self._attempt(route, request, target, message, metadata, remaining,
                                                 first and ranking.explore, estimate):
                    yield reply
                return
            except _Retry as retry:
                if digest is not None and retry.admitting:
                    self.quarantine.add(digest)
                    raise UnavailableError(f"target {target.name} failed while admitting this request's "
                                           "structured_output; it is not retried on another target, and identical "
                                           "ones are refused for a while") from None
                self.metrics.fallbacks.labels(route.model, target.name, retry.code).inc()
                error = retry.error
        raise error if error is not None else UnavailableError(f"no target could serve model '{route.model}'")

    def _within_limits(self, route: Route, ranked: Sequence, tokens: int) -> Sequence:
        """The ranked targets not at their rate limit; RateLimited when none is left for that."""
        if not self.target_limits:
            return ranked
        within, waits = [], []
        for state in ranked:
            limiter = self.target_limits.get(state.name)
            wait, limit = (0.0, "") if limiter is None else limiter.wait_s(tokens)
            if wait <= 0:
                within.append(state)
            else:
                waits.append((wait, limit))
                self.metrics.target_limited.labels(state.name, limit).inc()
        if within or not waits:
            return within
        wait, limit = min(waits)
        if wait == math.inf:
            raise InvalidArgumentError(f"max_tokens {tokens} is more than the tokens_per_minute of every target of "
                                       f"model '{route.model}': ask for fewer tokens")
        raise RateLimited(f"every target of model '{route.model}' is at its rate limit ({limit}): retry in "
                          f"{wait:.1f} s", limit, wait)

    async def _attempt(self, route: Route, request: RouteRequest, target: Target,
                       message: generation_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]] | None,
                       timeout_s: float, explore: bool, estimate: float | None):
        call = self._open(request, target, message, metadata, timeout_s, explore)
        try:
            async for reply in self._relay(route, request, call, estimate):
                yield reply
            self.metrics.requests.labels(route.model, target.name, "ok").inc()
            call.outcome = "UNAVAILABLE" if call.engine_failed else "ok"  # failed mid-stream: its breaker counts it
        except grpc.aio.AioRpcError as err:
            call.done = True
            code = call.outcome = err.code().name
            alive = getattr(err, "alive", False)
            self._failed(route, target, code, err.details() or "", alive)
            if call.first_token_at is None and code in route.retry_codes:
                # Only a target that was serving, was reached and went away while admitting the
                # request may have been killed by it: a refused connection or a busy answer is not.
                admitting = (code == "UNAVAILABLE" and call.was_healthy and call.held is None and not alive
                             and reached(err))
                raise _Retry(code, engine_error(err), admitting) from None
            raise engine_error(err) from None
        finally:
            self._close(route, request, call)

    def _open(self, request: RouteRequest, target: Target, message: generation_pb2.GenerateRequest,
              metadata: Sequence[tuple[str, str]] | None, timeout_s: float, explore: bool) -> _Call:
        """Count the attempt on its target (in flight, rate budget, breaker probe) and start its call."""
        state = target.state
        was_healthy = state.healthy
        load = state.engine_load()
        state.inflight += 1
        state.exploring += explore
        limiter = self.target_limits.get(target.name)
        grant = None if limiter is None else limiter.take(request.expected_output_tokens)
        probe = target.breaker.dispatched()
        if probe:
            self.pool.probe_started(target)
        limits = target.spec.timeouts
        if limits.total_s and limits.total_s < timeout_s:
            timeout_s = limits.total_s
        started_at = self.clock()
        if target.upstream is not None:
            # An HTTP upstream speaks the same events (services/gateway/upstreams); it gets the
            # gateway's own key, never the caller's.
            call = target.upstream.generate(message, timeout_s)
        else:
            # None: the gateway calls as itself (its API keys are on: a key is never an engine's token).
            call = target.stub.Generate(message, metadata=target.own_metadata if metadata is None else tuple(metadata),
                                        timeout=timeout_s)
        self.live[message.request_id] = target
        return _Call(target, call, message.request_id, started_at, load, explore, probe, grant,
                     was_healthy and not probe, started_at + limits.ttft_s if limits.ttft_s else None)

    async def _next(self, call: _Call) -> generation_pb2.GenerateResponse:
        """The call's next message; a target's ttft_s bounds the wait for its first token."""
        if call.ttft_deadline is None or call.first_token_at is not None:
            return await anext(call.replies)
        try:
            return await asyncio.wait_for(anext(call.replies), max(call.ttft_deadline - self.clock(), 0.0))
        except TimeoutError:
            call.call.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"target {call.target.name} sent no token within "
                                                               f"its ttft_s ({call.target.spec.timeouts.ttft_s:g} s)") \
                from None

    async def _relay(self, route: Route, request: RouteRequest, call: _Call, estimate: float | None):
        """The call's messages, Started held back until the first Delta or Finished; a Finished
        with ERROR before any token is a _Retry (the engine lost its executor)."""
        target = call.target
        while True:
            try:
                reply = await self._next(call)
            except StopAsyncIteration:
                return
            kind = reply.WhichOneof("event")
            if kind == "started":
                call.held = reply
                call.prompt_tokens = reply.started.prompt_tokens
                continue
            if kind == "delta":
                call.completion_tokens += len(reply.delta.token_ids)
            if kind == "finished":
                call.done = True
                finished = reply.finished
                call.prompt_tokens = finished.usage.prompt_tokens or call.prompt_tokens
                call.completion_tokens = finished.usage.completion_tokens
                if call.first_token_at is None and finished.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    call.outcome = "UNAVAILABLE"
                    self._failed(route, target, "UNAVAILABLE", "finished with error before any token")
                    raise _Retry("UNAVAILABLE", UnavailableError(finished.error_message or "the engine failed"))
                call.engine_failed = finished.finish_reason == common_pb2.FINISH_REASON_ERROR
                if finished.finish_reason in GOOD_FINISHES:
                    self._observe(route, request, target, call.load, call.started_at, call.first_token_at, finished,
                                  estimate, call.explore, call.request_id)
            elif call.first_token_at is None:
                call.first_token_at = self.clock()
            if call.held is not None:
                yield call.held
                call.held = None
            yield reply

    def _close(self, route: Route, request: RouteRequest, call: _Call) -> None:
        """The attempt's end, however it ended: its target's counts, breaker verdict, tokens and log line."""
        target, state = call.target, call.target.state
        state.inflight -= 1
        state.exploring -= call.explore
        self._judge(target, call.outcome, call.probe)
        if call.first_token_at is None and call.outcome != "ok":
            call.prompt_tokens = call.completion_tokens = 0  # moved on (or refused): nothing the client used
        self._count_tokens(request, call.grant, call.prompt_tokens, call.completion_tokens)
        _log.info("request_routed", request_id=call.request_id, model=route.model, target=target.name,
                  outcome=call.outcome, seconds=round(self.clock() - call.started_at, 4))
        if self.live.get(call.request_id) is target:
            del self.live[call.request_id]
        if not call.done:
            call.call.cancel()  # the client went away: the engine aborts the request at its next step

    @staticmethod
    def _count_tokens(request: RouteRequest, grant, prompt_tokens: int, completion_tokens: int) -> None:
        if grant is not None:
            grant.use(prompt_tokens, completion_tokens)
            grant.settle()
        if request.budget is not None:
            request.budget.use(prompt_tokens, completion_tokens)

    def _failed(self, route: Route, target: Target, code: str, details: str, alive: bool = False) -> None:
        self.metrics.requests.labels(route.model, target.name, code).inc()
        if code == "UNAVAILABLE" and not alive:
            self.pool.eject(target, details)

    def _judge(self, target: Target, outcome: str, probe: bool) -> None:
        """The request's verdict on its target, for the target's circuit breaker."""
        breaker = target.breaker
        if outcome == "ok":
            breaker.succeeded()
        elif outcome in TARGET_FAILURES:
            if breaker.failed():
                self.pool.trip(target)
            return
        else:
            breaker.ended_without_verdict()
        if probe:
            self.pool.probe_ended(target)

    def _observe(self, route: Route, request: RouteRequest, target: Target, load: float, started_at: float,
                 first_token_at: float | None, finished: generation_pb2.Finished,
                 estimate: float | None, explore: bool, request_id: str) -> None:
        now = self.clock()
        tokens = finished.usage.completion_tokens
        observed = (now - started_at) * 1000.0
        ttft = ((first_token_at or now) - started_at) * 1000.0
        estimator = target.state.estimator
        raw = estimator.raw_estimate_ms(tokens, load, request.worst_case, now)
        actual = None if raw is None else raw * estimator.median_ratio
        if actual is not None and actual > 0:
            self.metrics.estimate_ratio.labels(target.name).observe(observed / actual)
        estimator.observe(load, ttft, tokens, observed, now, raw)
        if target.passive is not None:
            target.passive.observe(ttft, observed, tokens)
        if self.observers:
            outcome = Outcome(route.model, target.name, request_id, estimate, actual, observed, ttft, tokens,
                              request.sla_ms, explore)
            for observer in self.observers:
                observer(outcome)
