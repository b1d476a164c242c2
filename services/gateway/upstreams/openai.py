"""GenerateRequest <-> an OpenAI-compatible server's chat and completions APIs (vLLM, llama.cpp,
SGLang, Ollama, a hosted API).

A conversation goes to ``POST {url}/chat/completions``, a text or token-id prompt to
``POST {url}/completions``, both streamed with ``stream_options.include_usage``. The sampling
fields OpenAI defines travel under their own names; the engine's extensions that servers commonly
take (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids) only when set. A
structured output travels as ``response_format`` (a JSON schema or any JSON object), but a named
or ``required`` ``tool_choice`` as itself (``required`` over one tool as that tool named: servers
that ignore ``required``, llama-cpp-python's, honour a named one), its call read back as the
reply's text in the shape the front end reads a constrained reply in (the arguments, or
``{"name": ..., "arguments": ...}``); a server that answers ``required`` with text and no call
is an error naming it, not a reply. What an OpenAI server cannot be asked (logprobs returned per
token id, prompt logprobs, a regex, choice or Lark grammar, a conversation without the
assistant's cue) is refused naming it, never dropped.

A target with ``stream_tools: false`` asks for a request with tools and tool_choice auto whole
(``stream: false``; llama-cpp-python's ``chatml-function-calling`` format makes such calls only
so): the reply is read as one streamed chunk (``whole_chunk``).

Replies: ``finish_reason`` "length" is LENGTH, anything else EOS (OpenAI does not say whether a
stop string matched); streamed ``tool_calls`` are gathered and written as ``hermes`` text at the
end, which the front ends read back into calls.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.upstreams.dialect import ConstrainedCall, StreamReader, call_choice, hermes_call
from services.gateway.upstreams.errors import refused, rpc_error
from services.gateway.upstreams.sampling import FIELDS, sampling_body

KIND = "openai"


SAMPLING = {name: name for name, _ in FIELDS if name not in ("logprobs", "prompt_logprobs")}
"""Every field under its own name (the engine's extensions are those vLLM, SGLang and llama.cpp
take) but logprobs: an OpenAI server's come back per token text, not per token id."""


def sampling_fields(message: generation_pb2.GenerateRequest) -> dict[str, Any]:
    body = sampling_body(KIND, message, SAMPLING)
    # A call's constraint (the front end's) travels as the tool_choice itself instead.
    if message.HasField("structured_output") and not call_choice(message):
        body["response_format"] = response_format(message.structured_output)
    return body


def response_format(structured: generation_pb2.StructuredOutput) -> dict[str, Any]:
    kind = structured.WhichOneof("kind")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(structured.json_schema)}}
    if kind == "json_object":
        return {"type": "json_object"}
    raise refused(KIND, f"a structured output of kind {kind}")


def chat_messages(chat: generation_pb2.ChatMessages) -> list[dict[str, Any]]:
    out = []
    for turn in chat.messages:
        # A turn of calls without text: "" rather than OpenAI's null, which llama.cpp's server
        # refuses (a template renders the two alike).
        item: dict[str, Any] = {"role": turn.role, "content": turn.content if turn.HasField("content")
                                else "" if turn.tool_calls else None}
        if turn.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}} for c in turn.tool_calls]
        if turn.tool_call_id:
            item["tool_call_id"] = turn.tool_call_id
        if turn.name:
            item["name"] = turn.name
        out.append(item)
    return out


class OpenAIDialect:
    kind = KIND
    health_path = "/models"

    def __init__(self, model: str, stream_tools: bool = True) -> None:
        self.model = model
        self.stream_tools = stream_tools

    def headers(self, token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"} if token else {}

    def build(self, message: generation_pb2.GenerateRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        prompt = message.WhichOneof("prompt")
        if prompt == "chat":
            chat = message.chat
            if chat.HasField("add_generation_prompt") and not chat.add_generation_prompt:
                raise refused(KIND, "add_generation_prompt false (its chat API always cues the assistant's turn)")
            body["messages"] = chat_messages(chat)
            tools = json.loads(chat.tools_json) if chat.tools_json else []
            if tools:
                body["tools"] = tools
            body.update(tool_choice(chat, tools))
            if tools and chat.tool_choice == "auto" and not self.stream_tools:
                body["stream"] = False
                del body["stream_options"]
            path = "/chat/completions"
        elif prompt == "text":
            body["prompt"] = message.text
            path = "/completions"
        elif prompt == "token_ids":
            body["prompt"] = list(message.token_ids.ids)
            path = "/completions"
        else:
            raise refused(KIND, "a request without a prompt")
        body.update(sampling_fields(message))
        return path, body

    def reader(self, message: generation_pb2.GenerateRequest) -> StreamReader:
        return OpenAIReader(call_choice(message), self.model)

    @staticmethod
    def whole_chunk(payload: dict[str, Any]) -> dict[str, Any]:
        """A whole (``stream: false``) chat reply as the one streamed chunk that says it all."""
        choices = []
        for choice in payload.get("choices") or ():
            message = choice.get("message") or {}
            calls = [{"index": i, "function": call.get("function") or {}}
                     for i, call in enumerate(message.get("tool_calls") or ())]
            choices.append({"index": choice.get("index", 0), "finish_reason": choice.get("finish_reason"),
                            "delta": {"content": message.get("content"), "tool_calls": calls}})
        return {"choices": choices, "usage": payload.get("usage")}


def tool_choice(chat: generation_pb2.ChatMessages, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The upstream's tool_choice: always said, never left to the server's default (llama.cpp's
    is none)."""
    if chat.tool_choice == "function" or (chat.tool_choice == "required" and len(tools) == 1):
        # The upstream's own named call (its arguments read as the constrained reply); the
        # structured output is that function's parameters, which the call obeys.
        name = chat.tool_function or tools[0].get("function", {}).get("name", "")
        return {"tool_choice": {"type": "function", "function": {"name": name}}}
    return {"tool_choice": chat.tool_choice} if chat.tool_choice else {}


class OpenAIReader(StreamReader):
    def __init__(self, choice: str = "", model: str = "") -> None:
        super().__init__()
        self._calls: dict[int, list[str]] = {}
        """Streamed tool calls by index: [name, arguments so far]."""
        self._call = ConstrainedCall(self, choice, model) if choice else None
        """A named or required tool_choice: the reply is the call; None: calls are gathered into text."""

    def feed(self, event: str, payload: dict[str, Any]) -> None:
        if "error" in payload and not payload.get("choices"):
            raise rpc_error(grpc.StatusCode.INTERNAL, f"the upstream failed: {json.dumps(payload['error'])[:500]}")
        usage = payload.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            self.usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
        for choice in payload.get("choices") or ():
            delta = choice.get("delta")
            if delta is not None:  # chat
                if self._call is None:
                    self.text(delta.get("content") or "")
                else:
                    self._call.text(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    if self._call is not None:
                        self._constrained(call, function)
                        continue
                    entry = self._calls.setdefault(call.get("index", 0), ["", ""])
                    # The name comes whole in a call's first delta; llama.cpp's server repeats it
                    # in every one, which must not make it "get_weatherget_weather...".
                    entry[0] = entry[0] or function.get("name") or ""
                    entry[1] += function.get("arguments") or ""
            else:  # completions
                self.text(choice.get("text") or "")
            reason = choice.get("finish_reason")
            if reason:
                self.finish = common_pb2.FINISH_REASON_LENGTH if reason == "length" else common_pb2.FINISH_REASON_EOS
                if self._call is not None:
                    self._call.close(reason == "length")
                for index in sorted(self._calls):
                    name, arguments = self._calls[index]
                    self.text(hermes_call(name, arguments))
                self._calls.clear()

    def _constrained(self, call: dict[str, Any], function: dict[str, Any]) -> None:
        """A delta of a call to a named or required tool_choice: the name comes in a call's first
        delta (llama.cpp's server repeats it in every one)."""
        if call.get("index", 0) != 0:
            return
        if self._call.state == "before" and (function.get("name") or self._call.choice == "function"):
            self._call.open(function.get("name") or "")
        self._call.arguments(function.get("arguments") or "")
