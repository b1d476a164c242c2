"""GenerateRequest <-> Anthropic's Messages API (``POST {url}/v1/messages``, streamed).

A conversation's system turns become ``system``; an assistant turn's calls become ``tool_use``
blocks and tool turns ``tool_result`` blocks of a user turn (consecutive turns of one role are
merged, as the API wants them alternating); tools become Anthropic's ``{name, description,
input_schema}``. A text prompt is sent as one user turn. ``max_tokens`` is required by the API:
absent, ``DEFAULT_MAX_TOKENS`` is sent. ``tool_choice`` auto and none travel as themselves,
``required`` as ``any`` and a named function as ``tool`` (the structured output the front end set
beside them stays here: the call obeys its tool's schema), the first ``tool_use`` block read back
as the reply an engine constrains to that choice (dialect.ConstrainedCall). What the API cannot be
asked (token-id prompts, logprobs, penalties, seeds, logit bias, other structured outputs, stop
token ids) is refused naming it.

Replies: ``end_turn`` and ``tool_use`` are EOS, ``max_tokens`` LENGTH, ``stop_sequence`` STOP with
the sequence; ``tool_use`` blocks are written as ``hermes`` text, which the front ends read back
into calls. ``message_start`` carries the prompt's tokens, ``message_delta`` the output's.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.upstreams.dialect import ConstrainedCall, StreamReader, call_choice, hermes_call
from services.gateway.upstreams.errors import refused, rpc_error
from services.gateway.upstreams.sampling import sampling_body

KIND = "anthropic"
API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
"""Sent when the request sets no max_tokens (the Messages API requires one)."""

STOP_REASONS = {"end_turn": common_pb2.FINISH_REASON_EOS, "tool_use": common_pb2.FINISH_REASON_EOS,
                "max_tokens": common_pb2.FINISH_REASON_LENGTH, "stop_sequence": common_pb2.FINISH_REASON_STOP,
                "pause_turn": common_pb2.FINISH_REASON_EOS, "refusal": common_pb2.FINISH_REASON_EOS}


SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_tokens",
            "stop": "stop_sequences"}
"""What the Messages API takes of the shared fields (sampling.py); the rest are refused."""


def _blocks(turn: generation_pb2.ChatMessage) -> list[dict[str, Any]]:
    if turn.role == "tool":
        return [{"type": "tool_result", "tool_use_id": turn.tool_call_id, "content": turn.content}]
    blocks: list[dict[str, Any]] = [{"type": "text", "text": turn.content}] if turn.content else []
    for call in turn.tool_calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:
            raise refused(KIND, f"tool call {call.name!r} whose arguments are not a JSON object") from None
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return blocks


def conversation(chat: generation_pb2.ChatMessages) -> tuple[str, list[dict[str, Any]]]:
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for turn in chat.messages:
        if turn.role == "system":
            system.append(turn.content)
            continue
        role = "assistant" if turn.role == "assistant" else "user"
        blocks = _blocks(turn)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(system), turns


def _tools(tools_json: str) -> list[dict[str, Any]]:
    out = []
    for tool in json.loads(tools_json):
        function = tool.get("function") or {}
        item = {"name": function.get("name", ""), "input_schema": function.get("parameters") or {"type": "object"}}
        if function.get("description"):
            item["description"] = function["description"]
        out.append(item)
    return out


class AnthropicDialect:
    kind = KIND
    health_path = "/v1/models"

    def __init__(self, model: str) -> None:
        self.model = model

    def headers(self, token: str) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if token:
            headers["x-api-key"] = token
        return headers

    def build(self, message: generation_pb2.GenerateRequest) -> tuple[str, dict[str, Any]]:
        if message.HasField("structured_output") and not call_choice(message):
            raise refused(KIND, "structured output")
        body: dict[str, Any] = {"model": self.model, "stream": True, "max_tokens": DEFAULT_MAX_TOKENS,
                                **sampling_body(KIND, message, SAMPLING)}
        prompt = message.WhichOneof("prompt")
        if prompt == "chat":
            if message.chat.HasField("add_generation_prompt") and not message.chat.add_generation_prompt:
                raise refused(KIND, "add_generation_prompt false (the Messages API always answers as the assistant)")
            system, turns = conversation(message.chat)
            if system:
                body["system"] = system
            body["messages"] = turns
            if message.chat.tools_json:
                body["tools"] = _tools(message.chat.tools_json)
            if message.chat.tool_choice:
                body["tool_choice"] = _tool_choice(message.chat)
        elif prompt == "text":
            body["messages"] = [{"role": "user", "content": message.text}]
        else:
            raise refused(KIND, "a token-id prompt" if prompt == "token_ids" else "a request without a prompt")
        return "/v1/messages", body

    def reader(self, message: generation_pb2.GenerateRequest) -> StreamReader:
        return AnthropicReader(call_choice(message), self.model)


def _tool_choice(chat: generation_pb2.ChatMessages) -> dict[str, Any]:
    if chat.tool_choice == "function":
        return {"type": "tool", "name": chat.tool_function}
    return {"type": "any" if chat.tool_choice == "required" else chat.tool_choice}  # auto, none: the same words


class AnthropicReader(StreamReader):
    def __init__(self, choice: str = "", model: str = "") -> None:
        super().__init__()
        self._call: list[str] | None = None
        """The tool_use block being streamed: [name, input JSON so far]."""
        self._constrained = ConstrainedCall(self, choice, model) if choice else None
        """A named or required tool_choice: the reply is the first tool_use block, as it streams."""

    def feed(self, event: str, payload: dict[str, Any]) -> None:
        kind = payload.get("type", event)
        if kind == "message_start":
            usage = (payload.get("message") or {}).get("usage") or {}
            self.usage(usage.get("input_tokens"), None, usage.get("cache_read_input_tokens"))
        elif kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("type") == "tool_use":
                self._call = [block.get("name", ""), ""]
                if self._constrained is not None:
                    self._constrained.open(block.get("name", ""))
            elif block.get("type") == "text":
                self._text(block.get("text") or "")
        elif kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                self._text(delta.get("text") or "")
            elif delta.get("type") == "input_json_delta" and self._call is not None:
                self._call[1] += delta.get("partial_json") or ""
                if self._constrained is not None:
                    self._constrained.arguments(delta.get("partial_json") or "")
        elif kind == "content_block_stop" and self._call is not None and self._constrained is not None:
            self._call = None
        elif kind == "content_block_stop" and self._call is not None:
            name, arguments = self._call
            self._call = None
            self.text(hermes_call(name, arguments))
        elif kind == "message_delta":
            delta = payload.get("delta") or {}
            reason = delta.get("stop_reason")
            if reason:
                self.finish = STOP_REASONS.get(reason, common_pb2.FINISH_REASON_EOS)
                if self._constrained is not None:
                    self._constrained.close(reason == "max_tokens")
                if reason == "stop_sequence" and delta.get("stop_sequence") is not None:
                    self.stop_reason = delta["stop_sequence"]
            usage = payload.get("usage") or {}
            self.usage(None, usage.get("output_tokens"))
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            error = payload.get("error") or {}
            code = grpc.StatusCode.UNAVAILABLE if error.get("type") == "overloaded_error" else grpc.StatusCode.INTERNAL
            raise rpc_error(code, f"the upstream failed: {error.get('type')}: {error.get('message', '')}"[:500])

    def _text(self, piece: str) -> None:
        if self._constrained is None:
            self.text(piece)
        else:
            self._constrained.text(piece)
