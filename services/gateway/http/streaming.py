"""Server-sent events as OpenAI streams them: ``data: {json}`` lines, then ``data: [DONE]``."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering by a reverse proxy in front (nginx reads X-Accel-Buffering)."""

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload).encode("utf-8") + b"\n\n"


def dumps(payload: Any) -> bytes:
    return _encode(payload).encode("utf-8")


class ChunkFrames:
    """The SSE frame of a text-only chunk, from bytes rendered once per stream.

    Nearly every chunk of a stream differs from the others only in its choice index and text;
    rendering the rest once and the text with the C string encoder keeps a token's cost at the
    gateway to the socket write and little more. ``head`` holds the chunk's fields before
    ``choices``; ``delta_key`` is ``"text"`` (completions) or ``"delta"`` (chat, whose text sits in
    ``{"content": ...}``); ``usage_null`` adds ``"usage": null`` (with include_usage).
    """

    def __init__(self, head: dict[str, Any], chat: bool, usage_null: bool) -> None:
        self._open = b'data: ' + dumps(head)[:-1] + b',"choices":[{"index":'
        self._chat = chat
        self._close = (b',"logprobs":null,"finish_reason":null}]' + (b',"usage":null' if usage_null else b"")
                       + b"}\n\n")

    def text(self, index: int, text: str) -> bytes:
        body = encode_basestring(text)
        if self._chat:
            middle = f'{index},"delta":{{"content":{body}}}'
        else:
            middle = f'{index},"text":{body}'
        return self._open + middle.encode("utf-8") + self._close
