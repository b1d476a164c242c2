"""Server-sent events as OpenAI streams them: ``data: {json}`` lines, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering by a reverse proxy in front (nginx reads X-Accel-Buffering)."""

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload).encode("utf-8") + b"\n\n"


def dumps(payload: Any) -> bytes:
    return _encode(payload).encode("utf-8")
