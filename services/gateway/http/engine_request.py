"""One HTTP request's engine calls: OpenAI request fields -> the engine's GenerateRequest, one
per choice, each beside what routing sees of it (``call_plan``, the routed calls; the gateway's
intake builds the routing side, services/gateway/intake.py).

``n`` choices are n engine calls. With a seed, choice j draws with a seed derived from it
(j = 0 keeps the seed itself, so n=1 and the first of n=2 agree), so a seeded request is
reproducible as a whole; without one each call draws on its own. OpenAI's seed is a signed
64-bit integer and the engine's unsigned: negative seeds wrap around (two's complement).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from fastapi import Request

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.http.context import HttpContext, api_key_of
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, SamplingFields
from services.gateway.intake import forwarded_auth, ids_prefix, max_output_tokens, route_request, text_prefix
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest

SEED_STRIDE = 0x9E3779B97F4A7C15
"""2^64 / golden ratio: consecutive choices get seeds far apart."""


def choice_seed(seed: int, index: int) -> int:
    return (seed + index * SEED_STRIDE) % (1 << 64)


def _logit_bias(fields: SamplingFields) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (fields.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token_id < 2**31:
            raise bad_request("logit_bias", f"logit_bias token id {token_id} is out of range")
        out[token_id] = value
    return out


def _fill_common(message: generation_pb2.GenerateRequest, fields: SamplingFields, max_tokens: int | None,
                 logprobs: int | None, prompt_logprobs: int | None) -> None:
    s = message.sampling
    if fields.temperature is not None:
        s.temperature = fields.temperature
    if fields.top_p is not None:
        s.top_p = fields.top_p
    if fields.top_k is not None and fields.top_k > 0:
        s.top_k = fields.top_k
    if fields.min_p is not None:
        s.min_p = fields.min_p
    if fields.repetition_penalty is not None:
        s.repetition_penalty = fields.repetition_penalty
    s.presence_penalty = fields.presence_penalty or 0.0
    s.frequency_penalty = fields.frequency_penalty or 0.0
    s.logit_bias.update(_logit_bias(fields))
    if logprobs is not None:
        s.logprobs = logprobs
    if prompt_logprobs is not None:
        s.prompt_logprobs = prompt_logprobs
    stop = message.stop
    if max_tokens is not None:
        stop.max_tokens = max_tokens
    if fields.stop is not None:
        stop.stop.extend([fields.stop] if isinstance(fields.stop, str) else fields.stop)
    stop.stop_token_ids.extend(fields.stop_token_ids or ())
    stop.ignore_eos = fields.ignore_eos
    stop.min_tokens = fields.min_tokens
    stop.include_stop_str_in_output = fields.include_stop_str_in_output
    message.priority = fields.priority


def per_choice(template: generation_pb2.GenerateRequest, fields: SamplingFields, request_id: str,
               index: int, count: int) -> generation_pb2.GenerateRequest:
    """Choice ``index`` of ``count``: the template with its own request id and seed."""
    if count == 1 and fields.seed is None:
        template.request_id = request_id
        return template
    message = generation_pb2.GenerateRequest()
    message.CopyFrom(template)
    message.request_id = f"{request_id}-{index}"
    if fields.seed is not None:
        message.sampling.seed = choice_seed(fields.seed, index % fields.n)
    return message


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one string, strings, token ids, or lists of ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "prompt must not be an empty list")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if any(isinstance(p, list) and not p for p in prompt):
        raise bad_request("prompt", "a token-id prompt must not be empty")
    return list(prompt)


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """Top alternatives per prompt token the engine computes: ``echo`` with ``logprobs`` shows
    the prompt's tokens with as many as the output's, ``prompt_logprobs`` asks its own."""
    wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


def completion_template(body: CompletionRequest, prompt: str | list[int]) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest()
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    # echo with max_tokens 0 reads the prompt's logprobs from a one-token run (the engine always
    # writes one); the gateway drops that token (completions.py)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    _fill_common(message, body, max_tokens, body.logprobs, completion_prompt_logprobs(body))
    return message


def chat_template(body: ChatCompletionRequest) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest()
    for turn in body.messages:
        role = "system" if turn.role == "developer" else turn.role
        calls = [common_pb2.ChatToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in turn.tool_calls or ()]
        # content null beside calls stays unset, as transformers would leave it (common.proto).
        content = None if turn.content is None and calls else turn.text()
        message.chat.messages.add(role=role, content=content, tool_calls=calls,
                                  tool_call_id=turn.tool_call_id or "", name=turn.name or "")
    message.chat.add_generation_prompt = body.add_generation_prompt
    if body.tools:
        # The template's ``tools``, as transformers' apply_chat_template gets them: OpenAI's tool
        # objects. Sent whatever tool_choice is: the model knows what it may call.
        message.chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools],
                                             ensure_ascii=False)
        if body.tool_choice in (None, "auto", "none", "required"):  # OpenAI's default with tools is auto
            message.chat.tool_choice = body.tool_choice or "auto"
        elif isinstance(body.tool_choice, NamedToolChoice):
            message.chat.tool_choice, message.chat.tool_function = "function", body.tool_choice.function.name
    max_tokens = max_output_tokens(body.max_completion_tokens, body.max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    _fill_common(message, body, max_tokens, logprobs, body.prompt_logprobs)
    return message


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
