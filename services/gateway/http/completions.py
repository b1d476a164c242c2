"""``POST /v1/completions``: prompts (a string, strings, token ids, lists of ids) continued.

Choice ``i * n + j`` is choice j of prompt i. ``echo`` puts the prompt before each choice's
text (a token-id prompt needs the route's tokenizer to be shown as text); streamed, the first
chunk of each choice opens with it. ``echo`` with ``logprobs`` shows the prompt's tokens first
(the engine computes prompt logprobs for it; the first token's are null), then the output's.
vLLM's ``prompt_logprobs`` adds each choice's in vLLM's shape.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from services.gateway.http.choices import ChoiceState, ChoiceStreams, usage_of
from services.gateway.http.context import context_of, request_id_of
from services.gateway.http.disconnect import unless_disconnected
from services.gateway.http.engine_request import call_plan, completion_prompts, completion_template
from services.gateway.http.errors import bad_request
from services.gateway.http.logprobs import completion_logprobs, echo_logprobs, end_offset, joined, vllm_prompt_logprobs
from services.gateway.http.protocol import CompletionRequest
from services.gateway.http.streaming import SSE_HEADERS, EventStream, ChunkFrames, dumps, event_stream, sse
from services.gateway.http.tokens import TokenNamer


def _echo_texts(body: CompletionRequest, prompts: list, namer: TokenNamer) -> list[str]:
    if not body.echo:
        return [""] * len(prompts)
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
        return EventStream(_stream(streams, states, head, body, echoes, namer), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **streams.target_header})
    await unless_disconnected(request, _collect(streams, states))
    choices = []
    for state in states:
        if body.max_tokens == 0:
            _nothing_written(state)
        echo = echoes[state.prompt_index]
        logprobs = None
        if body.logprobs is not None and body.echo:  # the prompt's tokens, then the output's
            prompt = echo_logprobs(state.prompt_logprobs, namer, body.logprobs)
            logprobs = joined(prompt, completion_logprobs(state.logprobs, namer, end_offset(prompt)))
        elif body.logprobs is not None:
            logprobs = completion_logprobs(state.logprobs, namer, 0)
        choice = {"index": state.index, "text": echo + "".join(state.text), "logprobs": logprobs,
                  "finish_reason": state.finish_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state.prompt_logprobs, namer, body.prompt_logprobs)
        choices.append(choice)
    payload = {**head, "choices": choices, "usage": usage_of(states), "system_fingerprint": None}
    return Response(dumps(payload), media_type="application/json", headers=streams.target_header)


def _nothing_written(state: ChoiceState) -> None:
    """An echo-only choice (max_tokens 0): the token the engine wrote past the prompt is not
    shown nor counted, as if the length limit had stopped it before it."""
    state.text.clear()
    state.logprobs.clear()
    state.completion_tokens = 0
    if state.finish_reason is not None:
        state.finish_reason, state.stop_string = "length", None


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
    offsets = [0] * len(states)
    fresh = [bool(echoes[s.prompt_index]) for s in states]
    frames = ChunkFrames(head, chat=False, usage_null=usage_chunks)
    async for index, reply in streams.events():
        state = states[index]
        state.apply(reply)
        kind = reply.WhichOneof("event")
        if kind == "started":
            continue
        written = kind == "delta" and body.max_tokens != 0
        if body.max_tokens == 0:
            _nothing_written(state)
        text = reply.delta.text if written else ""
        prompt = None
        if fresh[index]:  # echo: the prompt opens the choice's first chunk, as OpenAI streams it
            text, fresh[index] = echoes[state.prompt_index] + text, False
            if body.logprobs is not None:  # with its tokens' logprobs (the engine's first delta has them)
                prompt = echo_logprobs(state.prompt_logprobs, namer, body.logprobs)
                offsets[index] = end_offset(prompt)
        if kind == "delta" and not text and not (written and reply.delta.token_ids):
            continue
        if kind == "delta" and body.logprobs is None:
            yield frames.text(index, text)
            continue
        logprobs = None
        if body.logprobs is not None and written:
            logprobs = completion_logprobs(reply.delta.logprobs, namer, offsets[index])
            offsets[index] = end_offset(logprobs) if logprobs["tokens"] else offsets[index]
        if prompt is not None:
            logprobs = joined(prompt, logprobs) if logprobs is not None else prompt
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": state.finish_reason if kind == "finished" else None}
        yield sse({**head, "choices": [choice], **extra})
