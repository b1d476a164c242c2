"""Every HTTP error the gateway answers, in OpenAI's envelope, built in one place.

    {"error": {"message": "...", "type": "...", "param": "temperature" | null, "code": "..." | null}}

The status is the one that makes the official clients raise the matching class:

    400 invalid_request_error   BadRequestError        bad or unsupported field (param names it)
    401 authentication_error    AuthenticationError    the engine's tenants do not know the token
    403 permission_error        PermissionDeniedError  the tenant may not use that model or priority
    404 invalid_request_error   NotFoundError          unknown model (code model_not_found) or path
    409 invalid_request_error   ConflictError          an adapter name already loaded (admin endpoint)
    413 invalid_request_error   APIStatusError         body over --max-request-bytes, or a request
                                                       larger than the engine's message limit
    429 rate_limit_error        RateLimitError         queue full or token budget spent; Retry-After
    503 service_unavailable     InternalServerError    no healthy target, an engine went away
    504 timeout                 InternalServerError    over --request-timeout-s

Under /v1/messages (Anthropic's Messages API) the same errors come in Anthropic's envelope,
``{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}``, with the
same status (the ``anthropic`` SDK raises by status as ``openai`` does).

Typed errors (services/common/errors.py) map by their gRPC code; FastAPI's own validation
errors and Starlette's 404/405 are rewritten into the envelope instead of ``{"detail": ...}``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from services.common.errors import ResourceExhaustedError, TokenmillError
from services.gateway.http.disconnect import CLIENT_CLOSED, ClientDisconnected

_log = structlog.get_logger("tokenmill.gateway.http")


class OpenAIError(Exception):
    """An HTTP error answer: status and the envelope's fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in Anthropic's Messages envelope (its SDK raises by the status)."""
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=self.headers)


ANTHROPIC_PATH = "/v1/messages"
"""Answers under this path are in Anthropic's envelope."""
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 504: "timeout_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "already_exists"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "timeout"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable", "cancelled"),
}
_MESSAGE_LIMIT = "message larger than max"
"""In gRPC's RESOURCE_EXHAUSTED for a message over a channel's or server's limit ("Received
message larger than max (1600512 vs. 1048576)", "Sent message ...")."""
_ENGINE_FIELDS = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "logit_bias", "prompt", "temperature",
                  "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "logprobs", "request_id", "priority")


def _param_of(message: str) -> str | None:
    """The request field an engine's INVALID_ARGUMENT message starts with ("max_tokens 600 must be ...")."""
    first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":=")
    return first if first in _ENGINE_FIELDS else None


def from_error(exc: BaseException) -> OpenAIError:
    """The HTTP answer for a typed error (or a ValueError) from routing or an engine."""
    if isinstance(exc, OpenAIError):
        return exc
    code = exc.code if isinstance(exc, TokenmillError) else (
        grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, ValueError) else grpc.StatusCode.INTERNAL)
    status, type_, error_code = _BY_CODE.get(code, (500, "server_error", None))
    message = str(exc)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_LIMIT in message:
        # gRPC's own size limit (a hop's max message length), not a load the client may retry:
        # a 429 would have it retry forever.
        return OpenAIError(413, f"the request is larger than the engine accepts ({message}); send a smaller "
                                f"prompt or fewer, shorter stop strings", code="request_too_large")
    if status == 404 and "model" in message:
        error_code = "model_not_found"
    headers = {}
    if isinstance(exc, ResourceExhaustedError) and exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["Retry-After-Ms"] = str(max(0, round(exc.retry_after_s * 1000)))
    param = _param_of(message) if status == 400 else None
    if status == 500:
        _log.error("http_internal_error", error=f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, TokenmillError):
            # An unexpected fault of the gateway itself: its text may name paths or addresses of
            # this machine, which are the log's business, not the client's.
            message = "internal server error (the gateway's log has the details)"
    return OpenAIError(status, message, type_, param, error_code, headers)


def _validation_message(error: dict[str, Any]) -> tuple[str | None, str]:
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    # pydantic reports each member of a union; the field's name is what the client needs
    path = ".".join(p for p in loc if not p.startswith(("function-", "list[", "str", "int", "dict[", "Annotated")))
    kind, message = error.get("type", ""), error.get("msg", "invalid value")
    if kind == "json_invalid":
        return None, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', message)}"
    if kind == "extra_forbidden":
        return path, f"Unrecognized request argument supplied: {path}"
    if kind == "missing":
        return path, f"{path} is required"
    shown = json.dumps(error.get("input"), default=str)[:120] if "input" in error else ""
    return path or None, f"{path or 'body'}: {message}" + (f", got {shown}" if shown else "")


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # A union field (stop, prompt) fails once per member; the deepest location is the one that
    # says what is wrong ("stop.0: String should have at least 1 character").
    errors = sorted(exc.errors(), key=lambda e: -len(e.get("loc", ())))
    param, message = _validation_message(errors[0]) if errors else (None, "invalid request")
    if not errors or errors[0].get("loc", ("body",))[0] != "body":
        param = None
    return bad_request(param, message).response(is_anthropic(request.url.path))


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    anthropic = is_anthropic(request.url.path)
    if exc.status_code == 404:
        return OpenAIError(404, f"no route for {request.method} {request.url.path}",
                           code="not_found").response(anthropic)
    if exc.status_code == 405:
        return OpenAIError(405, f"{request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed").response(anthropic)
    if exc.status_code == 413:
        return OpenAIError(413, str(exc.detail), code="request_too_large").response(anthropic)
    return OpenAIError(exc.status_code, str(exc.detail)).response(anthropic)


async def _on_openai(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response(is_anthropic(request.url.path))


async def _on_typed(request: Request, exc: Exception) -> JSONResponse:
    return from_error(exc).response(is_anthropic(request.url.path))


async def _on_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED)  # sent to nobody; counted in the metrics


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ClientDisconnected, _on_disconnected)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(OpenAIError, _on_openai)
    app.add_exception_handler(TokenmillError, _on_typed)
    app.add_exception_handler(ValueError, _on_typed)
    app.add_exception_handler(Exception, _on_typed)
