"""``POST /v1/chat/completions``: a conversation through the model's chat template.

Streamed, each choice opens with a ``{"role": "assistant", "content": ""}`` delta, then its
content deltas, then one chunk with an empty delta and its ``finish_reason``. A reply
constrained to a tool call (structured.py) opens with ``content`` null and streams
``tool_calls`` deltas instead, ending with ``finish_reason`` "tool_calls" ("length" when
max_tokens cut the call: its arguments are then partial, streamed or not). With tools and
``tool_choice`` auto, a reply in a format the gateway parses (auto_tools.py) streams content
deltas and ``tool_calls`` deltas as the parser reads them, ending with "tool_calls" when it
made calls; with ``parallel_tool_calls`` false the choice ends at its first whole call, its engine
stream cancelled there.

A choice ended by one of its ``stop`` strings carries vLLM's ``stop_reason`` (that string) beside
``finish_reason`` "stop", in its last chunk when streamed.

A route with a reasoning parser (its ``reasoning_parser``, else the gateway's
``--reasoning-parser``; services/gateway/reasoning) splits each free-text reply's ``<think>``
section into ``reasoning_content`` (a message field, streamed as ``reasoning_content`` deltas)
before anything else reads it: the tool-call parser reads the content alone. A reply constrained
to JSON or to a call has no reasoning section.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from services.gateway.http.choices import ChoiceState, ChoiceStreams, usage_of
from services.gateway.http.context import context_of, request_id_of
from services.gateway.http.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.http.engine_request import call_plan, chat_template
from services.gateway.http import auto_tools
from services.gateway.http.errors import OpenAIError, bad_request, from_error
from services.gateway.http.logprobs import chat_logprobs, vllm_prompt_logprobs
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.http.streaming import SSE_HEADERS, EventStream, ChunkFrames, dumps, event_stream, sse
from services.gateway.http.structured import OutputPlan, call_readers, plan_output
from services.gateway.http.tokens import TokenNamer
from services.gateway import reasoning
from services.gateway.reasoning.think import ThinkParser
from services.gateway.intake import chat_prefix
from services.gateway.tool_calls.reader import ReplyReader


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context_of(request)
    if (unsupported := body.unsupported()) is not None:
        raise bad_request(*unsupported)
    if (invalid := body.invalid_history()) is not None:
        raise bad_request(*invalid)
    route = ctx.dispatcher.route(body.model)
    namer = ctx.namer(route)
    rid = request_id_of(request)
    prefix = chat_prefix([(m.role, m.text()) for m in body.messages])
    plan = plan_output(body)
    template = chat_template(body)
    if plan.structured is not None:
        template.structured_output.CopyFrom(plan.structured)
    calls, metadata = call_plan(ctx, route, body, request, [(prefix, template)], rid)
    streams = ChoiceStreams(ctx.dispatcher, route, calls, metadata, ctx.timeout_s)
    try:
        await unless_disconnected(request, streams.start())
    except ClientDisconnected:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer here, to name the field
        raise _refusal(exc, plan) from None
    states = [ChoiceState(i, 0) for i in range(len(calls))]
    if plan.tool is None:
        await auto_tools.learn_formats(body, ctx.dispatcher, [message.request_id for _, message in calls], metadata)
    readers = (call_readers(plan.tool, rid, len(calls)) if plan.tool is not None else
               auto_tools.readers(body, route, ctx.tool_call_parser, ctx.dispatcher,
                                  [message.request_id for _, message in calls], f"call_{rid}"))
    thinking = reasoning.parser_name(route.reasoning_parser, ctx.reasoning_parser) if plan.structured is None else None
    thinkers = [reasoning.PARSERS[thinking]() if thinking else None for _ in calls]
    head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model}
    if body.stream:
        # Known before the first chunk: Anthropic's message_start (http/messages.py) reports it.
        request.state.prompt_tokens = streams.prompt_tokens()
        usage_chunks = body.stream_options is not None and bool(body.stream_options.include_usage)
        last = (lambda: sse({**head, "choices": [], "usage": usage_of(states)})) if usage_chunks else (lambda: None)
        chunks = _chunks(streams, states, readers, thinkers, head, body, namer, usage_chunks)
        return EventStream(event_stream(chunks, streams.close, last), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **streams.target_header})
    return await _whole_reply(request, streams, states, readers, thinkers, head, body, namer)


async def _whole_reply(request: Request, streams: ChoiceStreams, states: list[ChoiceState],
                       readers: list[ReplyReader | None], thinkers: list[ThinkParser | None], head: dict,
                       body: ChatCompletionRequest, namer: TokenNamer) -> Response:
    """The non-streamed answer: every choice collected, then read into its message."""
    thoughts: list[list[str]] = [[] for _ in states]
    answers: list[list[str]] = [[] for _ in states]
    await unless_disconnected(request, _collect(streams, states, readers, thinkers, thoughts, answers))
    choices = [_choice(s, reader, thinker, thoughts[s.index], answers[s.index], body, namer)
               for s, reader, thinker in zip(states, readers, thinkers)]
    payload = {**head, "object": "chat.completion", "choices": choices, "usage": usage_of(states),
               "system_fingerprint": None}
    if body.prompt_logprobs is not None:  # vLLM's: the conversation's prompt is every choice's
        payload["prompt_logprobs"] = vllm_prompt_logprobs(states[0].prompt_logprobs, namer, body.prompt_logprobs)
    return Response(dumps(payload), media_type="application/json", headers=streams.target_header)


def _choice(s: ChoiceState, reader: ReplyReader | None, thinker: ThinkParser | None, thoughts: list[str],
            answers: list[str], body: ChatCompletionRequest, namer: TokenNamer) -> dict:
    """One collected choice as a chat.completion choice: its message, reasoning, logprobs and finish."""
    if thinker is not None:
        thought, text = thinker.finish()
        thoughts.append(thought)
        answers.append(text)
        if reader is not None:
            reader.feed(text)
    message, finish_reason = ({"role": "assistant", "content": "".join(s.text)}, s.finish_reason) \
        if reader is None else _read_message(s, reader)
    if thinker is not None:
        if reader is None:
            message["content"] = "".join(answers)
        message["reasoning_content"] = "".join(thoughts) or None
    choice = {"index": s.index, "message": message,
              "logprobs": chat_logprobs(s.logprobs, namer) if body.logprobs else None,
              "finish_reason": finish_reason}
    if s.stop_string is not None and finish_reason == "stop":
        choice["stop_reason"] = s.stop_string  # vLLM's: the stop string that matched
    return choice


async def _collect(streams: ChoiceStreams, states: list[ChoiceState], readers: list[ReplyReader | None],
                   thinkers: list[ThinkParser | None], thoughts: list[list[str]], answers: list[list[str]]) -> None:
    """Each choice's events applied; a choice with a reasoning parser has its reasoning and
    content collected apart, and only its content read for calls."""
    try:
        async for index, reply in streams.events():
            states[index].apply(reply)
            reader, thinker = readers[index], thinkers[index]
            if reply.WhichOneof("event") != "delta" or (reader is None and thinker is None):
                continue
            text = reply.delta.text
            if thinker is not None:
                thought, text = thinker.feed(text)
                thoughts[index].append(thought)
                answers[index].append(text)
            if reader is not None:
                reader.feed(text)
                if reader.done:  # parallel_tool_calls false: its call is made, the rest is not wanted
                    await streams.end(index)
                    states[index].end()
    finally:
        await streams.close()


def _refusal(exc: BaseException, plan: OutputPlan) -> OpenAIError:
    """An engine's refusal of the request's constraint names the OpenAI field it came from."""
    error = from_error(exc)
    if plan.field and error.status == 400 and error.message.startswith("structured_output."):
        error.param = plan.field
        error.message = f"{plan.field}: {error.message.split(' ', 1)[1]}"
    return error


def _read_message(state: ChoiceState, reader: ReplyReader) -> tuple[dict, str | None]:
    """A finished choice read for calls (tool_choice auto, or a reply constrained to a call: a
    call cut by max_tokens is still one, "length", its arguments partial), its text fed as it
    came: its content and the calls in it."""
    reader.finish(whole=state.finish_reason == "stop")
    whole = reader.whole()
    if not whole.calls:
        return {"role": "assistant", "content": whole.content}, state.finish_reason
    tool_calls = [{"id": reader.call_id(i), "type": "function", "function": {"name": name, "arguments": arguments}}
                  for i, (name, arguments) in enumerate(whole.calls)]
    return ({"role": "assistant", "content": whole.content, "tool_calls": tool_calls},
            _calls_finish(state.finish_reason))


def _calls_finish(finish_reason: str | None) -> str | None:
    """A reply that made calls and ended by itself finished to call them; "length" stays."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


async def _chunks(streams: ChoiceStreams, states: list[ChoiceState], readers: list[ReplyReader | None],
                  thinkers: list[ThinkParser | None], head: dict, body: ChatCompletionRequest, namer: TokenNamer,
                  usage_chunks: bool) -> AsyncIterator[bytes]:
    extra = {"usage": None} if usage_chunks else {}
    opened = [False] * len(states)
    frames = ChunkFrames(head, chat=True, usage_null=usage_chunks)

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason == "stop" and states[index].stop_string is not None:
            choice["stop_reason"] = states[index].stop_string  # vLLM's: the stop string that matched
        return sse({**head, "choices": [choice], **extra})

    async for index, reply in streams.events():
        state = states[index]
        state.apply(reply)
        kind = reply.WhichOneof("event")
        if kind == "started":
            continue
        reader, thinker = readers[index], thinkers[index]
        if not opened[index]:
            opened[index] = True
            calls_only = reader is not None and not reader.parser.writes_content
            yield chunk(index, {"role": "assistant", "content": None if calls_only else ""})
        answer = reply.delta.text if kind == "delta" else ""
        if thinker is not None:  # the reasoning first: what follows reads the content alone
            thought, answer = thinker.feed(answer) if kind == "delta" else thinker.finish()
            if thought:
                yield chunk(index, {"reasoning_content": thought})
        if reader is not None:
            # Read for calls (tool_choice auto, or constrained to one): content and calls as they come.
            text, tool_deltas = reader.feed(answer)
            if kind != "delta":
                tail, last_deltas = reader.finish(whole=state.finish_reason == "stop")
                text, tool_deltas = text + tail, tool_deltas + last_deltas
            logprobs = chat_logprobs(reply.delta.logprobs, namer) if body.logprobs and kind == "delta" else None
            if (text or logprobs) and reader.parser.writes_content:
                yield chunk(index, {"content": text}, logprobs)
            for tool_delta in tool_deltas:
                yield chunk(index, {"tool_calls": [tool_delta]})
            if kind == "delta" and reader.done:  # parallel_tool_calls false, its call made
                await streams.end(index)
                state.end()
                kind = "finished"
            if kind == "finished":
                finish_reason = _calls_finish(state.finish_reason) if reader.calls else state.finish_reason
                yield chunk(index, {}, finish_reason=finish_reason)
            continue
        if kind == "delta":
            delta = reply.delta
            if not answer and not (body.logprobs and delta.logprobs):
                continue
            if not body.logprobs:
                yield frames.text(index, answer)
                continue
            yield chunk(index, {"content": answer}, chat_logprobs(delta.logprobs, namer))
            continue
        if answer:  # what the reasoning parser held back to the end
            yield frames.text(index, answer)
        yield chunk(index, {}, finish_reason=state.finish_reason)
