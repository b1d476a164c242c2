"""What an HTTP upstream's dialect provides: the request it sends, and a reader of its events."""

from __future__ import annotations

import json
from typing import Any, Protocol

from services.common.pb.tokenmill.v1 import generation_pb2


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
