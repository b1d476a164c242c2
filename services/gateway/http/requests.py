"""One HTTP request's engine calls: a routed GenerateRequest for each of its choices."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request

from services.gateway.http.context import HttpContext, api_key_of
from services.gateway.http.engine_request import per_choice
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import SamplingFields
from services.gateway.request_meta import MAX_PREFIX_CHARS, forwarded_auth, ids_prefix, metadata_from, sla_from
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest
from services.common.pb.tokenmill.v1 import generation_pb2

Calls = list[tuple[RouteRequest, generation_pb2.GenerateRequest]]


def call_plan(ctx: HttpContext, route: Route, body: SamplingFields, request: Request,
              templates: Sequence[tuple[str | list[int], generation_pb2.GenerateRequest]],
              request_id: str) -> tuple[Calls, tuple[tuple[str, str], ...] | None]:
    """(calls, metadata): ``templates`` holds each prompt's routing text (or ids) and request;
    metadata None = each target's own token (the gateway's API keys are on)."""
    total = len(templates) * body.n
    if total > ctx.max_choices:
        raise bad_request("n", f"this request asks for {total} choices ({len(templates)} prompts x n={body.n}); "
                               f"the limit is {ctx.max_choices}")
    headers = request.headers
    api_key = api_key_of(request)
    if api_key is not None:
        api_key.check_model(route.model)
        api_key.check_priority(body.priority)
    sla, worst = sla_from(headers, route.sla_ms, route.worst_case)
    metadata = metadata_from(headers, getattr(body, "metadata", None))
    params = body.model_dump(exclude_none=True, exclude={"messages", "prompt"})
    stop_max = params.get("max_completion_tokens", params.get("max_tokens"))
    expected = stop_max or route.expected_output_tokens
    budget = None
    if api_key is not None:
        # One request (of its key's requests_per_minute) reserving every call's most tokens;
        # the middleware settles it when the answer has gone.
        budget = ctx.api_keys.admit(api_key, expected * total)
        request.scope["state"]["budget"] = budget
    calls: Calls = []
    for prompt_index, (prompt, template) in enumerate(templates):
        if api_key is not None:
            template.cache_salt = api_key.cache_salt
            template.fairness_key = api_key.tenant
        prefix = prompt[:MAX_PREFIX_CHARS] if isinstance(prompt, str) else ids_prefix(prompt)
        rr = RouteRequest(route.model, expected, sla, worst, prefix, params, metadata, budget)
        for j in range(body.n):
            index = prompt_index * body.n + j
            calls.append((rr, per_choice(template, body, request_id, index, total)))
    # A gateway API key is the gateway's, never an engine's: not sent on; the gateway calls with
    # each target's own token (None).
    return calls, forwarded_auth(headers.get("authorization")) if api_key is None else None
