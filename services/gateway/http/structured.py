"""OpenAI's ``response_format`` and ``tools`` -> the engine's StructuredOutput, and the tool
calls read back out of a constrained reply (whole, or as OpenAI's streamed deltas).

What maps to what:

- ``response_format`` ``json_object`` -> any JSON object; ``json_schema`` -> its schema
  (``strict`` or not: decoding is always constrained); ``text`` -> unconstrained.
- ``tool_choice`` a named function -> the reply is that function's arguments, constrained
  to its ``parameters`` schema; ``required`` -> the reply is ``{"name": <one of the tools>,
  "arguments": <its parameters>}`` (a Lark grammar with one alternative per tool, each
  embedding its schema), from which the call is read. Either answers ``tool_calls`` with
  ``finish_reason`` "tool_calls"; a call cut by max_tokens is still ``tool_calls``, its
  arguments the partial JSON generated, with ``finish_reason`` "length" (OpenAI's answer: the
  client sees the call was cut), streamed or not. A ``required`` reply cut before it named
  its function has neither content nor calls. The grammar's start is
  one call, so a constrained reply makes exactly one: what ``parallel_tool_calls: false`` asks.
- ``tool_choice`` ``auto`` (OpenAI's default when tools are given) and ``none``: unconstrained.
  The tools reach the model's chat template either way (``ChatMessages.tools_json``, the
  template's ``tools``). With ``auto`` the reply is read for calls in the syntax the template
  teaches (auto_tools.py picks the parser: hermes ``<tool_call>``, llama3_json, mistral
  ``[TOOL_CALLS]``; services/gateway/tool_calls), and answers ``tool_calls`` with
  ``finish_reason`` "tool_calls" when it made any; a template with no format we know (SmolLM2's)
  and ``none`` leave the reply text.

Streaming a call: the first chunk names it (``index``, ``id``, ``type``, ``function.name``,
empty ``arguments``); later chunks carry ``function.arguments`` in pieces, as the text comes.
The call is read by one more tool-call parser (services/gateway/tool_calls/constrained.py), so
chat.py reads a constrained reply as it reads one with ``tool_choice`` auto.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.json_layout import JSON_LAYOUT
from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway.http.errors import bad_request
from services.gateway.http.protocol import ChatCompletionRequest, NamedToolChoice
from services.gateway.tool_calls.constrained import ConstrainedCallParser, ToolCallShape
from services.gateway.tool_calls.reader import ReplyReader


@dataclass(frozen=True, slots=True)
class OutputPlan:
    structured: generation_pb2.StructuredOutput | None = None
    field: str = ""
    """The request field the constraint came from, for an engine's refusal."""
    tool: ToolCallShape | None = None


def plan_output(body: ChatCompletionRequest) -> OutputPlan:
    """The constraint a chat request asks for; a bad combination is a 400 naming the field."""
    choice = body.tool_choice
    wants_tool = body.tools and (isinstance(choice, NamedToolChoice) or choice == "required")
    if choice is not None and not body.tools and choice != "none":
        raise bad_request("tool_choice", "tool_choice needs tools")
    if wants_tool and body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format", "response_format cannot be combined with a required or named tool_choice")
    if wants_tool:
        return _tool_plan(body)
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return OutputPlan()
    if fmt.type == "json_object":
        return OutputPlan(generation_pb2.StructuredOutput(json_object=generation_pb2.JsonObject()),
                          "response_format")
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema", "response_format type json_schema needs json_schema")
    schema = fmt.json_schema.schema_
    text = json.dumps(schema if schema is not None else {})
    return OutputPlan(generation_pb2.StructuredOutput(json_schema=text), "response_format.json_schema.schema")


def _tool_plan(body: ChatCompletionRequest) -> OutputPlan:
    tools = {t.function.name: t.function for t in body.tools}
    if len(tools) != len(body.tools):
        raise bad_request("tools", "tools has two functions of one name")
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        function = tools.get(choice.function.name)
        if function is None:
            raise bad_request("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                                             f"among tools ({', '.join(tools)})")
        schema = function.parameters if function.parameters is not None else {"type": "object"}
        return OutputPlan(generation_pb2.StructuredOutput(json_schema=json.dumps(schema)), "tools.function.parameters",
                          ToolCallShape(function.name))
    shape = ToolCallShape(None, tuple(tools))
    rules = []
    for index, (name, function) in enumerate(tools.items()):
        schema = dict(function.parameters) if function.parameters is not None else {"type": "object"}
        schema["x-guidance"] = JSON_LAYOUT  # the layout the engine gives a JSON schema
        rules.append(f"call_{index}: {json.dumps(shape.prefix_of(name))} args_{index} \"}}\"\n"
                     f"args_{index}: %json {json.dumps(schema)}")
    grammar = "start: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(rules)
    return OutputPlan(generation_pb2.StructuredOutput(grammar=grammar), "tools.function.parameters", shape)


def call_readers(shape: ToolCallShape, request_id: str, count: int) -> list[ReplyReader | None]:
    """One reader per choice of a reply constrained to a tool call, its call named
    ``call_<request id>_<choice>``."""
    return [ReplyReader(ConstrainedCallParser(shape), f"call_{request_id}_{i}", numbered=False)
            for i in range(count)]
