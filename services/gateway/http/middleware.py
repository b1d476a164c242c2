"""Around every HTTP request (plain ASGI, cheaper than Starlette's BaseHTTPMiddleware):

- ``X-Request-Id``: the client's (at most MAX_REQUEST_ID_CHARS printable characters, else 400)
  or a new one, on the response and as the engine request's id;
- the body limit: a ``Content-Length`` over ``max_request_bytes``, or a body that grows past
  it, gets 413 before it is parsed; a body not all in within ``body_timeout_s`` of the headers
  gets 408 (a client trickling its body holds no connection for long);
- with the gateway's API keys (api_keys.py), a ``/v1/`` request's key (``Authorization: Bearer``,
  or Anthropic's ``x-api-key`` header): none or an unknown one
  gets 401, a tenant over its ``max_concurrent_requests`` 429; the key is in the scope's state
  for the handlers, and its request counted in flight until the answer is sent, when the
  request's draw on the key's per-minute budgets (http/engine_request.py) is settled;
- the count of answers by endpoint and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.http.context import MAX_REQUEST_ID_CHARS
from services.common.errors import TokenmillError
from services.gateway.api_keys import ApiKeys
from services.gateway.http.errors import ANTHROPIC_PATH, OpenAIError, from_error
from services.gateway.metrics import GatewayMetrics

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages/count_tokens", "/v1/messages",
             "/v1/models", "/health", "/metrics", "/openapi.json")


class GatewayMiddleware:
    def __init__(self, app: Any, max_request_bytes: int, metrics: GatewayMetrics,
                 api_keys: ApiKeys | None = None, body_timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics
        self.api_keys = api_keys
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")
        headers = _Headers.read(scope, self.max_request_bytes)
        rid = headers.request_id
        if headers.too_large:
            await self._refuse(send, endpoint, rid, _too_large(self.max_request_bytes))
            return
        if rid and (len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable() or not rid.isascii()):
            await self._refuse(send, endpoint, "", OpenAIError(
                400, f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters", param=None))
            return
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        held = contextlib.nullcontext()
        if self.api_keys is not None and path.startswith("/v1/"):
            try:
                api_key = self.api_keys.authenticate(headers.bearer())
                held = self.api_keys.in_flight(api_key)
                held.__enter__()
            except TokenmillError as exc:
                await self._refuse(send, endpoint, rid, from_error(exc))
                return
            scope["state"]["api_key"] = api_key
        header = (b"x-request-id", rid.encode())
        status = [500]

        async def tagged_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, _LimitedReceive(receive, self.max_request_bytes, self.body_timeout_s), tagged_send)
        finally:
            held.__exit__(None, None, None)
            if (budget := scope["state"].get("budget")) is not None:
                budget.settle()
        self.metrics.http.labels(endpoint, str(status[0])).inc()

    async def _refuse(self, send: Any, endpoint: str, rid: str, error: OpenAIError) -> None:
        response = error.response(endpoint.startswith(ANTHROPIC_PATH))
        if rid:
            response.headers["x-request-id"] = rid
        await response({"type": "http"}, None, send)
        self.metrics.http.labels(endpoint, str(error.status)).inc()


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than max_request_bytes={limit}", code="request_too_large")


class _Headers:
    """What the middleware reads of a request's headers, in one pass."""

    def __init__(self) -> None:
        self.request_id = ""
        self.authorization: str | None = None
        self.x_api_key: str | None = None
        self.too_large = False

    @classmethod
    def read(cls, scope: dict, max_request_bytes: int) -> _Headers:
        """The headers up to the end, or up to a Content-Length over ``max_request_bytes``."""
        headers = cls()
        for key, value in scope.get("headers", ()):
            if key == b"x-request-id":
                headers.request_id = value.decode("latin-1")
            elif key == b"authorization":
                headers.authorization = value.decode("latin-1")
            elif key == b"x-api-key":  # Anthropic's clients send their key so
                headers.x_api_key = value.decode("latin-1")
            elif key == b"content-length" and value.isdigit() and int(value) > max_request_bytes:
                headers.too_large = True
                break
        return headers

    def bearer(self) -> str | None:
        """The Authorization header, or Anthropic's x-api-key as one when that is all there is."""
        if self.authorization is not None or self.x_api_key is None:
            return self.authorization
        return f"Bearer {self.x_api_key}"


class _LimitedReceive:
    """The ASGI receive with the body limit and the body's deadline (408/413 as HTTPExceptions)."""

    def __init__(self, receive: Any, limit: int, body_timeout_s: float) -> None:
        self.receive = receive
        self.limit = limit
        self.body_timeout_s = body_timeout_s
        self.seen = 0
        self.body_deadline: float | None = asyncio.get_running_loop().time() + body_timeout_s

    async def __call__(self) -> dict:
        if self.body_deadline is None:  # the body is in: what follows is the disconnect
            return await self.receive()
        try:
            # timeout_at, not wait_for: no task per receive (wait_for wraps the call in one)
            async with asyncio.timeout_at(self.body_deadline):
                message = await self.receive()
        except TimeoutError:
            raise StarletteHTTPException(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None
        if message["type"] != "http.request" or not message.get("more_body"):
            self.body_deadline = None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                # An HTTPException: FastAPI lets it through its body parsing to the handler
                # (errors.py), which answers 413 in the envelope.
                raise StarletteHTTPException(413, _too_large(self.limit).message)
        return message
