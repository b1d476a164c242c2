"""The gateway's ``tokenmill.v1.Generation``: the engines' own API, routed.

A gRPC client talks to the gateway as it would to one engine. The model id comes from the
``x-tokenmill-model`` metadata (absent: the routes file's default model); SLA and routing
metadata from the keys of services/gateway/intake.py (which builds the routing request, as for HTTP); ``authorization`` is passed on, or,
with the gateway's API keys (api_keys.py), checked here (its limits too) and replaced by each
target's own token.
Generate streams what the chosen engine streams (Started held until the first token, so a
failure before it can still move to another target). Abort goes to the engine serving the
request; GetModelInfo answers for a healthy target of the model (with the model id as its
name); GetProfile sums the live state of the model's healthy targets.
"""

from __future__ import annotations

import dataclasses

import uuid
from collections.abc import Mapping

import grpc.aio

from services.common.errors import InvalidArgumentError, UnavailableError
from services.gateway.api_keys import ApiKey, ApiKeys
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.gateway.dispatch import Dispatcher, engine_error
from services.gateway.intake import MODEL_HEADER, chat_prefix, forwarded_auth, ids_prefix, route_request, text_prefix
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}


def routed(route: Route, request: generation_pb2.GenerateRequest, md: Mapping[str, str]) -> RouteRequest:
    """The intake's routing request of a Generate call (its fields read off the protobuf here)."""
    stop, sampling = request.stop, request.sampling
    max_tokens = stop.max_tokens if stop.HasField("max_tokens") else None
    params = {"max_tokens": max_tokens, "priority": request.priority, "top_k": sampling.top_k}
    if sampling.HasField("temperature"):
        params["temperature"] = sampling.temperature
    kind = request.WhichOneof("prompt")
    if kind == "text":
        prefix = text_prefix(request.text)
    elif kind == "chat":
        prefix = chat_prefix([(m.role, m.content) for m in request.chat.messages])
    elif kind == "token_ids":
        prefix = ids_prefix(request.token_ids.ids)
    else:
        prefix = ""
    return route_request(route, md, max_tokens=max_tokens, prefix=prefix, params=params)


class GatewayServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher, timeout_s: float, api_keys: ApiKeys | None = None) -> None:
        self.dispatcher = dispatcher
        self.timeout_s = timeout_s
        self.api_keys = api_keys
        self._owners: dict[str, str] = {}
        """With API keys: the tenant of each request in flight here, so only it may Abort it."""

    def _route(self, md: Mapping[str, str]) -> Route:
        return self.dispatcher.route(md.get(MODEL_HEADER) or self.dispatcher.default_model)

    def _engine_auth(self, md: Mapping[str, str], route: Route) -> tuple[ApiKey | None, tuple[tuple[str, str], ...] | None]:
        """(the caller's gateway API key, the metadata for the engine): with keys, the key is
        checked and not sent on, and the gateway calls with each target's own token (None);
        keyless, the caller's Authorization goes to the engine."""
        if self.api_keys is None:
            return None, forwarded_auth(md.get("authorization"))
        key = self.api_keys.authenticate(md.get("authorization"))
        key.check_model(route.model)
        return key, None

    async def Generate(self, request, context):
        md = _metadata(context)
        route = self._route(md)
        # A model id naming an adapter chooses it; so may the body's own field (the Generation
        # API's), both held to the key's allow-list.
        request.adapter = route.adapter or request.adapter
        route = dataclasses.replace(route, adapter=request.adapter) if request.adapter else route
        key, engine_md = self._engine_auth(md, route)
        if key is not None and route.adapter and not key.may_use_adapter(route.adapter):
            raise self.dispatcher.unknown_model(route.adapter)
        if not request.request_id:
            request.request_id = uuid.uuid4().hex  # one id on every target tried, and for Abort
        remaining = context.time_remaining()
        timeout = self.timeout_s if remaining is None else min(self.timeout_s, remaining)
        if key is None:
            # Only a keyed gateway names its clients' shares; a keyless one passes none on.
            request.fairness_key = ""
            async for reply in self.dispatcher.generate(route, routed(route, request, md), request,
                                                        engine_md, timeout):
                yield reply
            return
        key.check_priority(request.priority)
        request.cache_salt = key.cache_salt  # the caller's own values, if any, are replaced
        request.fairness_key = key.tenant
        if request.request_id in self._owners:
            raise InvalidArgumentError(f"request_id {request.request_id!r} is already in use by a running request")
        with self.api_keys.in_flight(key):
            rr = routed(route, request, md)
            rr.budget = self.api_keys.admit(key, rr.expected_output_tokens)
            self._owners[request.request_id] = key.tenant
            try:
                async for reply in self.dispatcher.generate(route, rr, request, engine_md, timeout):
                    yield reply
            finally:
                del self._owners[request.request_id]
                rr.budget.settle()

    async def Abort(self, request, context):
        md = _metadata(context)
        engine_md = forwarded_auth(md.get("authorization"))
        if self.api_keys is not None:
            key = self.api_keys.authenticate(md.get("authorization"))
            if self._owners.get(request.request_id) != key.tenant:
                return generation_pb2.AbortResponse(found=False)  # another tenant's is not found either
        target = self.dispatcher.live.get(request.request_id)
        if target is None:
            return generation_pb2.AbortResponse(found=False)
        if target.upstream is not None:  # an HTTP upstream: its stream is closed, the request ends ABORT
            return generation_pb2.AbortResponse(found=target.upstream.abort(request.request_id))
        if self.api_keys is not None:
            engine_md = target.own_metadata
        try:
            return await target.stub.Abort(request, metadata=engine_md, timeout=10)
        except grpc.aio.AioRpcError as err:
            raise engine_error(err) from None

    def _healthy_targets(self, route: Route):
        pool = self.dispatcher.pool
        return [pool.targets[s.name] for s in dict.fromkeys(route.node.leaves()) if s.healthy]

    async def GetModelInfo(self, request, context):
        md = _metadata(context)
        route = self._route(md)
        _, engine_md = self._engine_auth(md, route)
        targets = self._healthy_targets(route)
        known = next((t.model_info for t in targets if t.model_info is not None), None)
        if known is None and targets:
            # The gateway's polls were refused (an engine with tenants and no token_env for
            # it): ask with the caller's own token, so the caller gets the info or the engine's
            # real answer (UNAUTHENTICATED), not "no healthy target".
            try:
                known = await targets[0].stub.GetModelInfo(
                    request, metadata=targets[0].own_metadata if engine_md is None else engine_md, timeout=10)
            except grpc.aio.AioRpcError as err:
                raise engine_error(err) from None
        if known is None:
            raise UnavailableError(f"no healthy target serves model '{route.model}' now")
        info = generation_pb2.ModelInfo()
        info.CopyFrom(known)
        info.model_name = route.model
        return info

    async def GetProfile(self, request, context):
        md = _metadata(context)
        route = self._route(md)
        self._engine_auth(md, route)
        targets = self._healthy_targets(route)
        if not targets:
            raise UnavailableError(f"no healthy target serves model '{route.model}' now")
        out = generation_pb2.LatencyProfile(window_seconds=self.dispatcher.pool.window_s)
        profiles = [t.state.estimator.profile for t in targets if t.state.estimator.profile is not None]
        for p in profiles:
            out.num_requests += p.num_requests
            out.num_running += p.num_running
            out.num_waiting += p.num_waiting
            out.ttft_p99_ms = max(out.ttft_p99_ms, p.ttft_p99_ms)
            out.tpot_p99_ms = max(out.tpot_p99_ms, p.tpot_p99_ms)
        weighted = [p for p in profiles if p.num_requests > 0]
        total = sum(p.num_requests for p in weighted)
        if total:
            out.ttft_p50_ms = sum(p.ttft_p50_ms * p.num_requests for p in weighted) / total
            out.tpot_p50_ms = sum(p.tpot_p50_ms * p.num_requests for p in weighted) / total
            out.tokens_per_second_per_stream = sum(p.tokens_per_second_per_stream * p.num_requests
                                                   for p in weighted) / total
        if profiles:
            out.kv_cache_usage = sum(p.kv_cache_usage for p in profiles) / len(profiles)
        return out
