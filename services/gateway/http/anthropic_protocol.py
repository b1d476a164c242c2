"""Anthropic's Messages API request bodies, and their translation to the chat path's request.

A Messages request becomes one ChatCompletionRequest (protocol.py), which the chat handler
serves as any other: ``system`` is a system turn; text blocks join into a turn's content; an
assistant turn's ``tool_use`` blocks are its ``tool_calls`` (``input`` as JSON arguments); a user
turn's ``tool_result`` blocks are tool turns (``tool_call_id`` = ``tool_use_id``) ahead of its
text. ``tools`` are functions (``input_schema`` their parameters); ``tool_choice`` auto, any,
tool and none are chat's auto, required, a named function and none;
``disable_parallel_tool_use`` is ``parallel_tool_calls`` false. ``metadata`` is accepted and
ignored. Fields tokenmill cannot serve (``thinking``, images, documents) are refused naming them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, ChatCompletionRequest, at_most

_LOOSE = ConfigDict(extra="ignore")
"""Blocks carry fields tokenmill has no use for (``cache_control``, ``citations``): ignored."""


class TextBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | Annotated[list[TextBlock], at_most(MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class OtherBlock(BaseModel):
    """A block of a kind tokenmill does not serve (image, document, thinking...): refused by name."""
    model_config = _LOOSE
    type: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | OtherBlock, Field(union_mode="left_to_right")]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], at_most(MAX_CONTENT_PARTS)]


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    messages: Annotated[list[MessageParam], at_most(MAX_CHAT_MESSAGES)] = Field(min_length=1,
                                                                                max_length=MAX_CHAT_MESSAGES)
    system: str | Annotated[list[TextBlock], at_most(MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[ToolParam] | None, at_most(128)] = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Any = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] | None,
                              at_most(MAX_STOP_STRINGS)] = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def to_chat(body: CountTokensRequest, max_tokens: int, stream: bool = False) -> ChatCompletionRequest:
    """The chat path's request for a Messages (or count_tokens) request."""
    if body.thinking is not None:
        raise bad_request("thinking", "thinking is not supported by tokenmill's Messages API")
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for index, turn in enumerate(body.messages):
        messages.extend(_turn(turn, index))
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": max_tokens}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in body.tools]
    if (choice := body.tool_choice) is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice.name", "tool_choice.name is required when tool_choice.type is tool")
            if not any(t.name == choice.name for t in body.tools or ()):
                raise bad_request("tool_choice.name", f"tool_choice.name {choice.name!r} is not one of tools")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, name)) is not None:
                fields[name] = value
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        if stream:
            fields["stream"] = True
            fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        raise bad_request(None, f"the request does not translate to a chat request: {where}: "
                                f"{error.get('msg', 'invalid value')}") from None


def _turn(turn: MessageParam, index: int) -> list[dict[str, Any]]:
    """One Messages turn as chat turns: a user's tool results first (one tool turn each), then its text."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(turn.content):
        where = f"messages.{index}.content.{number}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if turn.role != "assistant":
                raise bad_request(where, f"{where}: a tool_use block belongs to an assistant turn")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            if turn.role != "user":
                raise bad_request(where, f"{where}: a tool_result block belongs to a user turn")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            raise bad_request(f"{where}.type", f"{where}.type: {block.type!r} blocks are not supported by tokenmill "
                                               f"(text, tool_use and tool_result are)")
    out = list(results)
    if texts or calls or not results:
        message: dict[str, Any] = {"role": turn.role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out
