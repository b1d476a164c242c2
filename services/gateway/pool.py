"""The targets as the gateway reaches them: one channel each, polled for health and profile.

Every ``interval_s`` each target is asked for its health and its ``GetProfile`` (over the
``window_s`` last seconds, so the profile follows the live load); the answers update the
target's routing state (routing/target.py). A target leaves the pool when its health says
NOT_SERVING, when it cannot be reached (UNAVAILABLE), when ``SLOW_POLLS_TO_LEAVE`` polls in a row
time out (one slow answer on a busy machine is not a dead target), or at once when a request's
call to it fails UNAVAILABLE (``eject``); it is probed at the same pace, and comes back after
``READMIT_AFTER`` polls in a row that found it SERVING. The model info of each target is read
once it first answers.

An HTTP upstream (kind openai or anthropic, services/gateway/upstreams) is polled the same way,
its health being its model listing's answer; it has no GetProfile, so each poll gives it the
passive profile the gateway measured from the streams it relayed (routing/passive_profile.py),
and its model info is the gateway's own (the route's model id, ``hermes`` tool calls: the form its
structured calls are relayed in).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import channel_options, create_channel
from services.common.tls import ClientTLS
from services.gateway.metrics import GatewayMetrics
from services.gateway.routes_file import TargetSpec
from services.gateway.routing.breaker import CircuitBreaker
from services.gateway.routing.passive_profile import PassiveProfile
from services.gateway.routing.profile import ProfileView
from services.gateway.routing.target import TargetState
from services.gateway.upstreams import http_upstream
from services.gateway.upstreams.client import HttpUpstream

_log = structlog.get_logger("tokenmill.gateway.pool")

READMIT_AFTER = 2
"""SERVING polls in a row that bring an ejected target back (one could be a flap)."""
SLOW_POLLS_TO_LEAVE = 3
"""Polls in a row that time out before a target leaves the pool."""
MIN_POLL_TIMEOUT_S = 2.0
MODEL_INFO_REFRESH_S = 2.0
"""How often an engine's model info is read again: its adapters change while it serves (the
gateway's own admin endpoint reads it at once after a change)."""
RECONNECT_OPTIONS = [
    # A target that restarts is found again within a second, not after gRPC's default back-off
    # (up to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(eq=False)
class Target:
    spec: TargetSpec
    state: TargetState
    channel: grpc.aio.Channel | None
    stub: generation_pb2_grpc.GenerationStub | None
    health: health_pb2_grpc.HealthStub | None
    model_info: generation_pb2.ModelInfo | None = None
    model_info_at: float = float("-inf")
    """When model_info was read (the pool's clock)."""
    successes: int = 0
    """SERVING polls in a row since it last failed."""
    ejected: bool = False
    """Out after a failure; needs READMIT_AFTER good polls to come back."""
    slow_polls: int = 0
    """Polls in a row that timed out."""
    own_metadata: tuple[tuple[str, str], ...] = field(default=())
    """The gateway's own bearer token, for its polls."""
    refused: str = ""
    """Why the target last refused the gateway's own GetModelInfo/GetProfile (its status code)."""
    upstream: HttpUpstream | None = None
    """An HTTP upstream's client (kind openai/anthropic); None for a tokenmill engine."""
    passive: PassiveProfile | None = None
    """An HTTP upstream's profile, measured from the streams the gateway relays."""
    breaker: CircuitBreaker | None = None
    """Out of the pool after its failures in a row, whatever its health says (routing/breaker.py)."""

    @property
    def name(self) -> str:
        return self.spec.name


def profile_view(msg: generation_pb2.LatencyProfile, read_at: float) -> ProfileView:
    return ProfileView(read_at, msg.num_requests, msg.ttft_p50_ms, msg.ttft_p99_ms, msg.tpot_p50_ms, msg.tpot_p99_ms,
                       msg.tokens_per_second_per_stream, msg.kv_cache_usage, msg.num_running, msg.num_waiting)


class TargetPool:
    def __init__(self, specs: tuple[TargetSpec, ...], *, interval_s: float = 0.25, window_s: float = 10.0,
                 default_tls: ClientTLS | None = None, metrics: GatewayMetrics | None = None,
                 max_message_bytes: int = 16 * 1024 * 1024, clock: Callable[[], float] = time.monotonic,
                 poll_timeout_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.poll_timeout_s = poll_timeout_s if poll_timeout_s is not None else max(4 * interval_s, MIN_POLL_TIMEOUT_S)
        self.window_s = window_s
        self.metrics = metrics or GatewayMetrics()
        self.clock = clock
        self.targets: dict[str, Target] = {}
        options = channel_options(max_message_bytes) + RECONNECT_OPTIONS
        for spec in specs:
            if spec.http:
                target = Target(spec, TargetState(spec.name, cost=spec.cost, tags=spec.tags), None, None, None,
                                model_info=generation_pb2.ModelInfo(model_name=spec.model, tool_call_format="hermes"),
                                upstream=http_upstream(spec), passive=PassiveProfile(window_s, spec.seed, clock))
                self.targets[spec.name] = target
                continue
            tls = ClientTLS(spec.tls.ca, spec.tls.cert, spec.tls.key) if spec.tls is not None else default_tls
            channel = create_channel(spec.address, options=options, tls=tls)
            own = (("authorization", f"Bearer {spec.token}"),) if spec.token else ()
            self.targets[spec.name] = Target(spec, TargetState(spec.name, cost=spec.cost, tags=spec.tags), channel,
                                             generation_pb2_grpc.GenerationStub(channel),
                                             health_pb2_grpc.HealthStub(channel), own_metadata=own)
        for target in self.targets.values():
            target.breaker = CircuitBreaker(target.spec.breaker.failures, target.spec.breaker.open_s, clock)
            target.state.max_concurrency = target.spec.max_concurrency
        self.states = {name: target.state for name, target in self.targets.items()}
        self._tasks: list[asyncio.Task] = []

    async def start(self, wait_s: float = 0.0) -> None:
        """Start polling; with ``wait_s``, wait up to that long for the first poll of every target."""
        first = [asyncio.ensure_future(self.poll_once(t)) for t in self.targets.values()]
        if wait_s > 0:
            await asyncio.wait(first, timeout=wait_s)
        for target in self.targets.values():
            self._tasks.append(asyncio.create_task(self._poll_forever(target), name=f"gateway-poll-{target.name}"))

    async def _poll_forever(self, target: Target) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once(target)

    async def poll_once(self, target: Target) -> None:
        timeout = self.poll_timeout_s
        if target.upstream is not None:
            serving = await target.upstream.probe(timeout)
            target.state.set_profile(target.passive.view(target.state.inflight))
            if serving is None:
                if target.state.inflight:
                    return  # busy, and its streams show it alive (a server that serves one call at a time)
                target.slow_polls += 1
                if target.slow_polls < SLOW_POLLS_TO_LEAVE:
                    return  # slow, not gone
            else:
                target.slow_polls = 0
            self._set_serving(target, bool(serving))
            return
        try:
            reply = await target.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                await self._read_profile(target, timeout)
            target.slow_polls = 0
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                target.slow_polls += 1
                if target.slow_polls < SLOW_POLLS_TO_LEAVE:
                    return  # slow, not gone: keep the state it has
            serving = False
            if target.state.healthy:
                _log.warning("target_unreachable", target=target.name, code=err.code().name, details=err.details())
        except Exception:  # noqa: BLE001 - a poll must never kill the polling task
            serving = False
            _log.exception("target_poll_failed", target=target.name)
        self._set_serving(target, serving)

    async def _read_profile(self, target: Target, timeout: float) -> None:
        request = generation_pb2.GetProfileRequest(window_seconds=self.window_s)
        try:
            if target.model_info is None or self.clock() - target.model_info_at >= MODEL_INFO_REFRESH_S:
                await self.read_model_info(target, timeout)
            msg = await target.stub.GetProfile(request, timeout=timeout, metadata=target.own_metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            # Serving but not telling (tenants without a gateway token, profiles off): route on
            # the gateway's own observations alone.
            self._refused(target, err)
            return
        target.refused = ""
        target.state.set_profile(profile_view(msg, self.clock()))

    async def read_model_info(self, target: Target, timeout: float) -> None:
        target.model_info = await target.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout,
                                                           metadata=target.own_metadata)
        target.model_info_at = self.clock()

    def serves_adapter(self, name: str, adapter: str) -> bool:
        """Whether target ``name`` said (in its last model info) that it serves ``adapter``."""
        info = self.targets[name].model_info
        return info is not None and any(a.name == adapter for a in info.adapters)

    @staticmethod
    def _refused(target: Target, err: grpc.aio.AioRpcError) -> None:
        code = err.code().name
        if target.refused == code:
            return  # said once, at the first refusal (at start, for a routes file that lacks a token)
        target.refused = code
        if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            _log.warning("target_refuses_the_gateway", target=target.name, code=code, details=err.details(),
                         consequence="no model info and no profile from this target: routing uses the gateway's "
                                     "own observations, and GetModelInfo and tool_call_parser auto ask with "
                                     "each caller's token",
                         fix=f"give target '{target.name}' a token_env in the routes file, naming a variable "
                             "that holds a token of the engine's tenants" if not target.spec.token else
                             f"the token of target '{target.name}' (its token_env) is not one the engine accepts")
        else:
            _log.info("target_profile_refused", target=target.name, code=code, details=err.details())

    def _set_serving(self, target: Target, serving: bool) -> None:
        state = target.state
        if serving and not target.breaker.admits():
            return  # open (or its probe is running): out whatever the health says
        if not serving:
            target.successes = 0
            if state.healthy:
                _log.warning("target_left_pool", target=target.name)
            state.healthy = False
        else:
            target.successes += 1
            if not state.healthy and (not target.ejected or target.successes >= READMIT_AFTER):
                _log.info("target_joined_pool", target=target.name)
                state.healthy = True
                target.ejected = False
        self.metrics.healthy.labels(target.name).set(1.0 if state.healthy else 0.0)

    def eject(self, target: Target, reason: str) -> None:
        """Take a target out now (a call to it failed); polls bring it back once it serves again."""
        if target.state.healthy:
            _log.warning("target_ejected", target=target.name, reason=reason)
        target.ejected = True
        target.successes = 0
        target.state.healthy = False
        self.metrics.healthy.labels(target.name).set(0.0)

    def trip(self, target: Target) -> None:
        """Its breaker opened: out of the pool until the breaker lets a probe through."""
        _log.warning("target_breaker_open", target=target.name, failures=target.breaker.consecutive,
                     open_s=target.breaker.open_s)
        target.state.healthy = False
        self.metrics.healthy.labels(target.name).set(0.0)

    def probe_started(self, target: Target) -> None:
        """The half-open breaker's one request went to it: no other until it ends."""
        target.state.healthy = False

    def probe_ended(self, target: Target) -> None:
        """The probe succeeded (or said nothing of the target): back in for every request."""
        if target.breaker.admits() and not target.ejected:
            target.state.healthy = True
            self.metrics.healthy.labels(target.name).set(1.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for target in self.targets.values():
            if target.upstream is not None:
                await target.upstream.close()
            else:
                await target.channel.close()
