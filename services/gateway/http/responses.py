"""``POST /v1/responses``: OpenAI's Responses API, stateless, as a translation over the chat path.

A request becomes a ChatCompletionRequest (``instructions`` a system message first, ``input``
items messages, ``function_call``/``function_call_output`` items an assistant's ``tool_calls`` and
``tool`` messages, flat function tools nested as chat's) and goes through
``create_chat_completion``: the same intake, routing and engine call. Its answer, whole or as chat
chunks, is read back into a response object or the Responses event sequence. Nothing is stored:
``previous_response_id``, ``store: true`` and ``conversation`` are refused naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from services.gateway.http.chat import create_chat_completion
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.http.streaming import SSE_HEADERS, EventStream, dumps

STATEFUL_FIELDS = ("previous_response_id", "conversation")


class ResponsesRequest(BaseModel):
    """The fields of ``responses.create`` the gateway serves; anything else is refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None


def _text_of(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(field, f"{field}: a string or a list of text parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise bad_request(f"{field}[{i}]", f"{field}[{i}]: only input_text and output_text parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        field = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{field}.role", f"{field}.role: one of user, system, developer, assistant")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{field}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or f"call_{i}", "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, f"{field}.output")})
        elif kind == "reasoning":
            continue  # a previous turn's reasoning is not part of the next prompt
        else:
            raise bad_request(f"{field}.type", f"{field}.type: {kind!r} is not supported (message, function_call, "
                              "function_call_output)")
    return messages


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}].type", f"tools[{i}].type: only function tools are supported")
            tools.append({"type": "function", "function": {k: tool[k] for k in
                                                           ("name", "description", "parameters", "strict")
                                                           if tool.get(k) is not None}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice", "tool_choice: none, auto, required or {type: function, name}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request is, or a 400 naming what the gateway cannot serve."""
    for name in STATEFUL_FIELDS:
        if getattr(body, name) is not None:
            raise bad_request(name, f"{name}: this gateway is stateless and stores no responses; "
                              "send the whole conversation as input")
    if body.store:
        raise bad_request("store", "store: this gateway is stateless; send store false (or leave it out)")
    for name in sorted(body.model_extra or {}):
        raise bad_request(name, f"{name}: not supported by this gateway's Responses API")
    if body.text is not None and (body.text.get("format") or {}).get("type", "text") != "text":
        raise bad_request("text.format", "text.format: only text is supported")
    tools, choice = _tools(body)
    chat = {"model": body.model, "messages": _messages(body), "stream": body.stream,
            "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
            "user": body.user}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise bad_request(where, f"{where}: {error['msg']}") from None


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _response(body: ResponsesRequest, rid: str, created: int, status: str, output: list[dict],
              usage: dict | None, finish_reason: str | None = None) -> dict:
    incomplete = finish_reason == "length"
    return {"id": rid, "object": "response", "created_at": created, "model": body.model,
            "status": "incomplete" if status == "completed" and incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "output": output, "parallel_tool_calls": body.parallel_tool_calls
            is not False, "previous_response_id": None, "store": False, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"id": f"rs_{rid}", "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": f"fc_{call_id}", "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    chat = to_chat(body)
    answer = await create_chat_completion(chat, request)
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-tokenmill")}
    created = int(time.time())
    if isinstance(answer, EventStream):
        return EventStream(_events(body, answer.body_iterator, created), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    completion = json.loads(answer.body)
    rid = "resp_" + completion["id"].removeprefix("chatcmpl-")
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(rid, message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(rid, message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    payload = _response(body, rid, created, "completed", output, _usage(completion.get("usage")),
                        choice["finish_reason"])
    return Response(dumps(payload), media_type="application/json", headers=headers)


async def _chat_chunks(frames: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The chat stream's chunks as dicts, from its SSE frames (one or more per bytes)."""
    pending = b""
    async for frame in frames:
        pending += frame if isinstance(frame, bytes) else frame.encode()
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data != b"[DONE]":
                yield json.loads(data)


class _EventWriter:
    """The Responses event sequence of one stream: its numbering, its output items and the one open."""

    def __init__(self, body: ResponsesRequest, created: int) -> None:
        self.body = body
        self.created = created
        self.seq = 0
        self.rid = ""
        self.output: list[dict] = []
        self.open_item: dict | None = None  # the item whose deltas are arriving
        self.calls: dict[int, dict] = {}  # tool call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return f"event: {kind}\n".encode() + b"data: " + dumps({"type": kind, "sequence_number": self.seq - 1,
                                                                  **fields}) + b"\n\n"

    def started(self, chat_id: str) -> list[bytes]:
        self.rid = "resp_" + chat_id.removeprefix("chatcmpl-")
        start = _response(self.body, self.rid, self.created, "in_progress", [], None)
        return [self.event("response.created", response=start), self.event("response.in_progress", response=start)]

    def failed(self, error: dict) -> list[bytes]:
        """A failure reported in-band by the chat stream."""
        response = _response(self.body, self.rid or "resp_failed", self.created, "failed", self.output, None)
        response["error"] = {"code": error.get("code") or "server_error", "message": error.get("message")}
        return [self.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param")),
                self.event("response.failed", response=response)]

    def completed(self, usage: dict | None, finish_reason: str | None) -> list[bytes]:
        frames = self.close_item()
        final = _response(self.body, self.rid, self.created, "completed", self.output, _usage(usage), finish_reason)
        # response.completed even when cut (its status says incomplete): the SDK's stream helper builds
        # its final response from that event alone.
        return [*frames, self.event("response.completed", response=final)]

    def close_item(self) -> list[bytes]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        event = self.event
        if item["type"] == "message":
            part = item["content"][0]
            return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "reasoning":
            part = item["content"][0]
            return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"]),
                    event("response.output_item.done", output_index=index, item=item)]
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=item["arguments"]),
                event("response.output_item.done", output_index=index, item=item)]

    def open_new(self, item: dict) -> list[bytes]:
        frames = self.close_item()
        self.output.append(item)
        self.open_item = item
        index = len(self.output) - 1
        frames.append(self.event("response.output_item.added", output_index=index,
                                 item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            frames.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={**item["content"][0], "text": ""}))
        return frames

    def part_delta(self, kind: str, text: str) -> list[bytes]:
        """``text`` onto the open item of ``kind`` (reasoning or message), opening one if another
        kind is open; its delta event (reasoning_text, or output_text with its logprobs)."""
        frames = []
        if self.open_item is None or self.open_item["type"] != kind:
            make = _reasoning_item if kind == "reasoning" else _message_item
            frames = self.open_new(make(self.rid, "", "in_progress"))
        self.open_item["content"][0]["text"] += text
        name, extra = (("response.reasoning_text.delta", {}) if kind == "reasoning"
                       else ("response.output_text.delta", {"logprobs": []}))
        return [*frames, self.event(name, item_id=self.open_item["id"], output_index=self.output.index(self.open_item),
                                    content_index=0, delta=text, **extra)]

    def call_delta(self, call: dict) -> list[bytes]:
        frames = []
        item = self.calls.get(call.get("index", 0))
        if item is None:
            function = call.get("function") or {}
            item = _call_item(call.get("id") or f"call_{self.rid}_{len(self.calls)}", function.get("name", ""), "",
                              "in_progress")
            self.calls[call.get("index", 0)] = item
            frames = self.open_new(item)
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            frames.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=arguments))
        return frames

    def delta(self, delta: dict) -> list[bytes]:
        frames = []
        if delta.get("reasoning_content"):
            frames += self.part_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            frames += self.part_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            frames += self.call_delta(call)
        return frames


async def _events(body: ResponsesRequest, frames: AsyncIterator[bytes], created: int) -> AsyncIterator[bytes]:
    """The chat stream read back as the Responses API's event sequence."""
    writer = _EventWriter(body, created)
    finish_reason = None
    usage = None
    async for chunk in _chat_chunks(frames):
        if "error" in chunk:
            for frame in writer.failed(chunk["error"]):
                yield frame
            return
        if not writer.rid:
            for frame in writer.started(chunk["id"]):
                yield frame
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            for frame in writer.delta(choice.get("delta") or {}):
                yield frame
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
    for frame in writer.completed(usage, finish_reason):
        yield frame
