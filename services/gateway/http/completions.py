"""``POST /v1/completions``: prompts (a string, strings, token ids, lists of ids) continued.

Choice ``i * n + j`` is choice j of prompt i. ``echo`` puts the prompt before each choice's
text (a token-id prompt needs the route's tokenizer to be shown as text); ``echo`` with
``logprobs`` would need the prompt's logprobs, which the engine does not return: a 400.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from services.gateway.http.choices import ChoiceState, ChoiceStreams, usage_of
from services.gateway.http.context import context_of, request_id_of
from services.gateway.http.disconnect import unless_disconnected
from services.gateway.http.engine_request import completion_prompts, completion_template
from services.gateway.http.errors import bad_request
from services.gateway.http.logprobs import completion_logprobs
from services.gateway.http.protocol import CompletionRequest
from services.gateway.http.streaming import SSE_HEADERS, ChunkFrames, dumps, event_stream, sse
from services.gateway.http.requests import call_plan
from services.gateway.http.tokens import TokenNamer


def _echo_texts(body: CompletionRequest, prompts: list, namer: TokenNamer) -> list[str]:
    if not body.echo:
        return [""] * len(prompts)
    if body.logprobs is not None:
        raise bad_request("echo", "echo with logprobs needs the prompt's logprobs, which tokenmill does not return; "
                                  "drop one of them")
    texts = []
    for prompt in prompts:
        text = prompt if isinstance(prompt, str) else namer.decode(prompt)
        if text is None:
            raise bad_request("echo", "echo of a token-id prompt needs the model's tokenizer (the route's "
                                      "'tokenizer' in the gateway's routes file)")
        texts.append(text)
    return texts


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    if (unsupported := body.unsupported()) is not None:
        raise bad_request(*unsupported)
    route = ctx.dispatcher.route(body.model)
    namer = ctx.namer(route)
    prompts = completion_prompts(body)
    echoes = _echo_texts(body, prompts, namer)
    rid = request_id_of(request)
    templates = [(p, completion_template(body, p)) for p in prompts]
    calls, metadata = call_plan(ctx, route, body, request, templates, rid)
    streams = ChoiceStreams(ctx.dispatcher, route, calls, metadata, ctx.timeout_s)
    await unless_disconnected(request, streams.start())
    states = [ChoiceState(i, i // body.n) for i in range(len(calls))]
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": body.model}
    if body.stream:
        return StreamingResponse(_stream(streams, states, head, body, echoes, namer), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await unless_disconnected(request, _collect(streams, states))
    choices = []
    for state in states:
        echo = echoes[state.prompt_index]
        logprobs = (completion_logprobs(state.logprobs, namer, len(echo)) if body.logprobs is not None else None)
        choices.append({"index": state.index, "text": echo + "".join(state.text), "logprobs": logprobs,
                        "finish_reason": state.finish_reason})
    payload = {**head, "choices": choices, "usage": usage_of(states), "system_fingerprint": None}
    return Response(dumps(payload), media_type="application/json")


async def _collect(streams: ChoiceStreams, states: list[ChoiceState]) -> None:
    try:
        async for index, reply in streams.events():
            states[index].apply(reply)
    finally:
        await streams.close()


def _stream(streams: ChoiceStreams, states: list[ChoiceState], head: dict, body: CompletionRequest,
            echoes: list[str], namer: TokenNamer) -> AsyncIterator[bytes]:
    usage_chunks = body.stream_options is not None and bool(body.stream_options.include_usage)
    last = (lambda: sse({**head, "choices": [], "usage": usage_of(states)})) if usage_chunks else (lambda: None)
    return event_stream(_chunks(streams, states, head, body, echoes, namer, usage_chunks), streams.close, last)


async def _chunks(streams: ChoiceStreams, states: list[ChoiceState], head: dict, body: CompletionRequest,
                  echoes: list[str], namer: TokenNamer, usage_chunks: bool) -> AsyncIterator[bytes]:
    extra = {"usage": None} if usage_chunks else {}
    offsets = [len(echoes[s.prompt_index]) for s in states]
    fresh = [bool(echoes[s.prompt_index]) for s in states]
    frames = ChunkFrames(head, chat=False, usage_null=usage_chunks)
    async for index, reply in streams.events():
        state = states[index]
        state.apply(reply)
        kind = reply.WhichOneof("event")
        if kind == "started":
            continue
        text = reply.delta.text if kind == "delta" else ""
        if fresh[index]:  # echo: the prompt opens the choice's first chunk, as OpenAI streams it
            text, fresh[index] = echoes[state.prompt_index] + text, False
        if kind == "delta" and not text and not reply.delta.token_ids:
            continue
        if kind == "delta" and body.logprobs is None:
            yield frames.text(index, text)
            continue
        logprobs = None
        if body.logprobs is not None and kind == "delta":
            logprobs = completion_logprobs(reply.delta.logprobs, namer, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": state.finish_reason if kind == "finished" else None}
        yield sse({**head, "choices": [choice], **extra})
