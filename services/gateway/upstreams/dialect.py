"""What an HTTP upstream's dialect provides: the request it sends, and a reader of its events."""

from __future__ import annotations

import json
from typing import Any, Protocol

import grpc

from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway.tool_calls.constrained import ToolCallShape
from services.gateway.upstreams.errors import rpc_error


class StreamReader:
    """Reads an upstream's streamed events; the call takes the text they carry with take().

    ``completion_tokens`` counts the pieces of text until the upstream's usage says otherwise;
    ``prompt_reported`` / ``completion_reported`` say whether the upstream's usage gave each count
    (where not, the call counts it itself: usage.py)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish: int | None = None
        """A FinishReason once the upstream said why it stopped."""
        self.stop_reason: str | None = None
        self.done = False
        """The upstream's last event arrived."""
        self._texts: list[str] = []
        self.prompt_reported = False
        self.completion_reported = False

    def feed(self, event: str, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def take(self) -> list[str]:
        texts, self._texts = self._texts, []
        return texts

    def text(self, piece: str) -> None:
        if piece:
            self._texts.append(piece)
            if not self.completion_reported:
                self.completion_tokens += 1

    def usage(self, prompt: int | None, completion: int | None, cached: int | None = None) -> None:
        if prompt is not None:
            self.prompt_tokens = prompt
            self.prompt_reported = True
        if completion is not None:
            self.completion_tokens = completion
            self.completion_reported = True
        if cached is not None:
            self.cached_tokens = cached


class Dialect(Protocol):
    kind: str
    health_path: str

    def build(self, message: generation_pb2.GenerateRequest) -> tuple[str, dict[str, Any]]:
        """(path under the target's url, JSON body); an AioRpcError for what it cannot carry."""

    def headers(self, token: str) -> dict[str, str]: ...

    def reader(self, message: generation_pb2.GenerateRequest) -> StreamReader:
        """A reader of the events ``message``'s request streams back."""


def hermes_call(name: str, arguments: Any) -> str:
    """An upstream's structured tool call as the text the gateway's ``hermes`` reader parses (the
    format an HTTP target declares in its model info), so tool_choice works as over an engine."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def call_choice(message: generation_pb2.GenerateRequest) -> str:
    """"function" (a named tool_choice) or "required": the reply must be a call; "" otherwise."""
    if message.WhichOneof("prompt") != "chat" or message.chat.tool_choice not in ("function", "required"):
        return ""
    return message.chat.tool_choice


class ConstrainedCall:
    """An upstream's call to a named or required tool_choice, written as the text of the reply an
    engine constrains to it (the arguments, or ``{"name": ..., "arguments": ...}``: the shape the
    front end reads, tool_calls/constrained.py). The first call only (that reply is one call); the
    upstream's text beside it is no part of it. A reply that wrote text and no call (a server that
    ignores the choice) is an error, not a reply."""

    def __init__(self, reader: StreamReader, choice: str, model: str) -> None:
        self.reader = reader
        self.choice = choice
        self.model = model
        self.state = "before"
        """before the call, in it, or after it (a later call is dropped)."""
        self.wrote = False

    def text(self, piece: str) -> None:
        self.wrote = self.wrote or bool(piece)

    def open(self, name: str) -> None:
        if self.state != "before":
            self.state = "after"
            return
        self.state = "in"
        if self.choice == "required":
            self.reader.text(ToolCallShape(None).prefix_of(name))

    def arguments(self, piece: str) -> None:
        if self.state == "in":
            self.reader.text(piece)

    def close(self, cut: bool) -> None:
        """The reply's end (``cut``: by max_tokens): the wrapper closed, or the missing call said."""
        if self.state != "before":
            if self.choice == "required" and not cut and self.state == "in":
                self.reader.text("}")
            self.state = "after"
            return
        if cut and not self.wrote:
            return  # cut before the call began, as an engine's constrained reply can be
        asked = "required" if self.choice == "required" else "naming a function"
        raise rpc_error(grpc.StatusCode.INTERNAL, f"the upstream's model {self.model!r} answered text, not a tool "
                                                  f"call, to tool_choice {asked}: the server does not enforce it")
