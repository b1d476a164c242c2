"""One HTTP request's engine calls: a routed GenerateRequest for each of its choices."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request

from services.gateway.http.context import HttpContext, api_key_of
from services.gateway.http.engine_request import per_choice
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import SamplingFields
from services.gateway.intake import forwarded_auth, ids_prefix, max_output_tokens, route_request, text_prefix
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
        if route.adapter and not api_key.may_use_adapter(route.adapter):
            raise ctx.dispatcher.unknown_model(route.adapter)  # as if absent: other keys' adapters stay unnamed
        api_key.check_priority(body.priority)
    params = body.model_dump(exclude_none=True, exclude={"messages", "prompt"})
    max_tokens = max_output_tokens(getattr(body, "max_completion_tokens", None), body.max_tokens)
    routed = [route_request(route, headers, max_tokens=max_tokens, params=params, body_metadata=getattr(
        body, "metadata", None), prefix=text_prefix(prompt) if isinstance(prompt, str) else ids_prefix(prompt))
        for prompt, _ in templates]
    if api_key is not None:
        # One request (of its key's requests_per_minute) reserving every call's most tokens;
        # the middleware settles it when the answer has gone.
        budget = ctx.api_keys.admit(api_key, routed[0].expected_output_tokens * total)
        request.scope["state"]["budget"] = budget
        for rr in routed:
            rr.budget = budget
    calls: Calls = []
    for prompt_index, (rr, (_, template)) in enumerate(zip(routed, templates)):
        template.adapter = route.adapter
        if api_key is not None:
            template.cache_salt = api_key.cache_salt
            template.fairness_key = api_key.tenant
        for j in range(body.n):
            index = prompt_index * body.n + j
            calls.append((rr, per_choice(template, body, request_id, index, total)))
    # A gateway API key is the gateway's, never an engine's: not sent on; the gateway calls with
    # each target's own token (None).
    return calls, forwarded_auth(headers.get("authorization")) if api_key is None else None
