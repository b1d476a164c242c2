"""RenderChat's turns -> the chat template's ``messages``, tool calls and results included.

transformers' apply_chat_template hands a template each turn as a dict; an assistant turn that
called functions carries ``tool_calls`` as ``[{"id", "type": "function", "function": {"name",
"arguments"}}]`` with the arguments an object, not the JSON text OpenAI's API carries (Qwen2.5's
and Llama 3.1's templates write ``tool_call.function.arguments | tojson``: a string there would
be written as a quoted JSON string). So the arguments are parsed here, and text that is not
JSON is the request's error, naming the call. A tool turn carries ``tool_call_id``, and a turn
that has a ``name`` (a tool turn's function, as some clients send it; OpenAI's participant name
on others) carries it: transformers passes every key of a turn on, and some templates print it.
It drops the keys whose value is None, though, so a turn that only made calls (``content:
null``) has no ``content`` key here either.

A template that never reads ``tool_calls`` (SmolLM2's, most templates without a tool format)
would drop an assistant's calls from the history, leaving the model a conversation in which it
said nothing and a tool answered. For those the calls are written into the turn's content
instead, one ``{"name": ..., "arguments": ...}`` line each after its text: the shape the
gateway sent before calls travelled as structure, and the one most tool formats teach.
Whether a template reads them is read from its source (it names ``tool_calls``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import common_pb2


def messages_from_proto(messages: Iterable[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The template's ``messages``: role and content, ``tool_calls``, ``tool_call_id`` and ``name``
    where set: a key that is absent, as transformers hands a None over, not an empty string."""
    out: list[dict[str, Any]] = []
    for index, turn in enumerate(messages):
        message: dict[str, Any] = {"role": turn.role}
        # A turn that only made calls (content null) has no content key: transformers drops the
        # keys whose value is None. Any other keeps "" (templates concatenate a turn's content).
        if turn.HasField("content") or not turn.tool_calls:
            message["content"] = turn.content
        if turn.tool_calls:
            message["tool_calls"] = [_tool_call(index, number, call) for number, call in enumerate(turn.tool_calls)]
        if turn.tool_call_id:
            message["tool_call_id"] = turn.tool_call_id
        if turn.name:
            message["name"] = turn.name
        out.append(message)
    return out


def _tool_call(index: int, number: int, call: common_pb2.ChatToolCall) -> dict[str, Any]:
    try:
        # Blank: a call of a function without parameters, as some clients send it back.
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"messages[{index}].tool_calls[{number}].arguments is not JSON: {exc}") from None
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def reads_tool_calls(template_source: str | None) -> bool:
    """Whether a chat template looks at an assistant turn's ``tool_calls``."""
    return bool(template_source) and "tool_calls" in template_source


def calls_as_text(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` with each turn's ``tool_calls`` written after its text content (see the module
    docstring); turns without calls, and turns whose content is a list of parts, as they were."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        content = message.get("content")
        if not calls or not (content is None or isinstance(content, str)):
            out.append(message)
            continue
        lines = "\n".join(_call_line(call) for call in calls)
        rest = {key: value for key, value in message.items() if key != "tool_calls"}
        out.append({**rest, "content": f"{content}\n{lines}" if content else lines})
    return out


def _call_line(call: Any) -> str:
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    return '{"name": %s, "arguments": %s}' % (json.dumps(function.get("name"), ensure_ascii=False),
                                              json.dumps(function.get("arguments"), ensure_ascii=False))
