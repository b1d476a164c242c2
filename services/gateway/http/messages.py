"""Anthropic's Messages API over the chat path.

    POST /v1/messages                 create, streamed or not
    POST /v1/messages/count_tokens    the prompt's tokens

A request is translated (anthropic_protocol.py) into a chat request and served by the chat
handler (chat.py): the same intake, routing, engine calls, tool-call parsers and constrained
calls; only its answer is translated here. A reply's text is a ``text`` block and each call a
``tool_use`` block (``input`` the parsed arguments); ``stop_reason`` is ``end_turn``,
``max_tokens``, ``stop_sequence`` (with ``stop_sequence``, the string that matched) or
``tool_use``. Streamed, events come in Anthropic's order: ``message_start``, then for each block
``content_block_start`` (the first one followed by ``ping``), its ``content_block_delta``
events (``text_delta``, or ``input_json_delta`` for a call's arguments) and
``content_block_stop``; then ``message_delta`` (stop_reason, usage) and ``message_stop``.
``message_start`` has the prompt's token count (the engine's Started event, read before the answer
begins), ``message_delta`` both counts. A failure after the answer began comes as an ``error`` event.

``count_tokens`` serves the request with max_tokens 1 and answers the prompt's token count, as
the engine's tokenizer renders it through the model's chat template (tools included).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from services.gateway.http.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from services.gateway.http.chat import create_chat_completion
from services.gateway.http.context import request_id_of
from services.gateway.http.errors import OpenAIError
from services.gateway.http.streaming import SSE_HEADERS, EventStream, dumps

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


async def create_message(body: MessagesRequest, request: Request) -> Response:
    chat = to_chat(body, body.max_tokens, stream=body.stream)
    answer = await create_chat_completion(chat, request)
    head = {"id": f"msg_{request_id_of(request)}", "type": "message", "role": "assistant", "model": body.model}
    if not body.stream:
        choice = json.loads(answer.body)
        usage = choice["usage"]
        first = choice["choices"][0]
        message = {**head, "content": _blocks(first["message"]),
                   **_stop(first, body.stop_sequences),
                   "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}
        return Response(dumps(message), media_type="application/json")
    assert isinstance(answer, EventStream)
    head["usage"] = {"input_tokens": getattr(request.state, "prompt_tokens", 0), "output_tokens": 0}
    return EventStream(_events(answer.body_iterator, head, body.stop_sequences), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    answer = await create_chat_completion(to_chat(body, 1), request)
    return Response(dumps({"input_tokens": json.loads(answer.body)["usage"]["prompt_tokens"]}),
                    media_type="application/json")


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})
    return blocks


def _input(arguments: str) -> Any:
    """A call's arguments as its ``input`` object; arguments cut by max_tokens are not JSON: {}."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(choice: dict[str, Any], stop_sequences: list[str] | None) -> dict[str, Any]:
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and matched is not None and matched in (stop_sequences or ()):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": _STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), "stop_sequence": None}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps({"type": name, **payload}) + b"\n\n"


async def _events(chunks: AsyncIterator[bytes], head: dict[str, Any],
                  stop_sequences: list[str] | None) -> AsyncIterator[bytes]:
    """The chat stream's chunks (``data: {...}`` frames) as Anthropic's events; closing it closes
    the chat stream (a client that went away aborts its engine calls)."""
    try:
        async for frame in _translated(chunks, head, stop_sequences):
            yield frame
    finally:
        await chunks.aclose()


async def _translated(chunks: AsyncIterator[bytes], head: dict[str, Any],
                      stop_sequences: list[str] | None) -> AsyncIterator[bytes]:
    yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None}})
    index = -1  # the open block's
    kind: str | None = None  # its type
    pinged = False
    finish: dict[str, Any] = {}
    usage: dict[str, Any] = {}

    def start(block: dict[str, Any]) -> list[bytes]:
        nonlocal index, kind, pinged
        frames = [_event("content_block_stop", {"index": index})] if kind is not None else []
        index += 1
        kind = block["type"]
        frames.append(_event("content_block_start", {"index": index, "content_block": block}))
        if not pinged:
            pinged = True
            frames.append(_event("ping", {}))
        return frames

    async for frame in chunks:
        for line in frame.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = OpenAIError(500, chunk["error"].get("message", "the engine failed"))
                error.status = {"rate_limit_error": 429, "service_unavailable": 503,
                                "timeout": 504}.get(chunk["error"].get("type"), 500)
                yield _event("error", {"error": error.anthropic_body()["error"]})
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if text := delta.get("content"):
                    if kind != "text":
                        for out in start({"type": "text", "text": ""}):
                            yield out
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "text_delta", "text": text}})
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    if call.get("id"):
                        for out in start({"type": "tool_use", "id": call["id"], "name": function.get("name", ""),
                                          "input": {}}):
                            yield out
                    if function.get("arguments"):
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": function["arguments"]}})
                if choice.get("finish_reason"):
                    finish = choice
    if kind is None:  # an empty reply: one empty text block, as Anthropic sends
        for out in start({"type": "text", "text": ""}):
            yield out
    yield _event("content_block_stop", {"index": index})
    yield _event("message_delta", {"delta": _stop(finish, stop_sequences),
                                   "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                                             "output_tokens": usage.get("completion_tokens", 0)}})
    yield _event("message_stop", {})

