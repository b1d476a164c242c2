"""Typed errors raised inside the services, and the one place they become gRPC status codes.

Code inside a service raises plain Python errors that say what went wrong; it never calls
``context.abort`` itself. ``ErrorMappingInterceptor`` (installed by
services/common/server.py on every server) turns them into status codes:

    InvalidArgumentError, ValueError   -> INVALID_ARGUMENT
    NotFoundError                      -> NOT_FOUND
    ResourceExhaustedError             -> RESOURCE_EXHAUSTED, with a grpc-retry-pushback-ms
                                          trailer when it says when to come back
    UnauthenticatedError               -> UNAUTHENTICATED
    PermissionDeniedError              -> PERMISSION_DENIED
    UnavailableError                   -> UNAVAILABLE
    DeadlineExceededError              -> DEADLINE_EXCEEDED
    NotImplementedError                -> UNIMPLEMENTED
    a request body that does not decode -> INVALID_ARGUMENT (grpc would say UNKNOWN or INTERNAL)
    grpc.aio.AioRpcError (a downstream call failed) -> the downstream code, passed on
    anything else                      -> INTERNAL "internal error", with the traceback logged

What a caller reads is the error's own message (typed errors name the field and the limit) and
never an unexpected exception's text, which can hold paths and addresses; those go to the log.
Refusals are logged at a bounded rate (services/common/log_limit.py): a client sending them by
the thousand cannot fill the logs. Internal errors are always logged.

``error_from_rpc`` goes the other way, for a client that wants the typed error back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import structlog
from google.protobuf.message import DecodeError

from services.common.interceptor import BehaviorInterceptor, StreamBehavior, UnaryBehavior
from services.common.log_limit import RateLimitedLog

_log = structlog.get_logger("tokenmill.errors")
_refusals = RateLimitedLog(_log)

INTERNAL_ERROR = "internal error"


class TokenmillError(Exception):
    """Base of the typed errors; ``code`` is the gRPC status the interceptor sends."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(TokenmillError, ValueError):
    """The request is malformed or out of range; retrying it unchanged will fail again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(TokenmillError):
    """The request is well formed but the server's state refuses it (a KV layout mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFoundError(TokenmillError):
    """The named entity (request id, sequence id, stream id) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(TokenmillError):
    """The name asked for is taken (an adapter loaded under it)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(TokenmillError):
    """A capacity limit was hit (queue full, a tenant's token budget spent).

    ``retry_after_s``, when known, goes to the client as the ``grpc-retry-pushback-ms``
    trailer, which gRPC's retry policy honours.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnauthenticatedError(TokenmillError):
    """The call carries no credentials, or ones the server does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(TokenmillError):
    """The caller is known but may not do what it asked."""

    code = grpc.StatusCode.PERMISSION_DENIED


class UnavailableError(TokenmillError):
    """A dependency is down or the service is shutting down; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(TokenmillError):
    """The work did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_ERROR_BY_CODE: dict[grpc.StatusCode, type[TokenmillError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, ResourceExhaustedError, UnavailableError,
                DeadlineExceededError, UnauthenticatedError, PermissionDeniedError)
}


def status_for_exception(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details a handler's exception is reported with."""
    if isinstance(exc, TokenmillError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    if isinstance(exc, DecodeError):  # a streamed request message that does not decode
        return grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be decoded: {exc}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, INTERNAL_ERROR


def error_from_rpc(err: grpc.RpcError) -> TokenmillError:
    """The typed error matching a failed call's status (TokenmillError for other codes)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _ERROR_BY_CODE.get(code)
    if cls is not None:
        return cls(details)
    error = TokenmillError(f"{code.name}: {details}")
    error.code = code
    return error


async def _abort_with(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    code, details = status_for_exception(exc)
    if code == grpc.StatusCode.INTERNAL:
        _log.exception("rpc_internal_error", method=method, error=f"{type(exc).__name__}: {exc}")
    else:
        _refusals.log("info", "rpc_error", (method, code), method=method, code=code.name, details=details)
    retry_after_s = getattr(exc, "retry_after_s", None)
    trailers = () if retry_after_s is None else (("grpc-retry-pushback-ms", str(max(0, round(retry_after_s * 1000)))),)
    await context.abort(code, details, trailing_metadata=trailers)


class _Undecodable:
    """Stands for a unary request whose body did not decode, so the handler can refuse it."""

    __slots__ = ("error",)

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class ErrorMappingInterceptor(BehaviorInterceptor):
    """Maps exceptions escaping any async handler (unary or streaming) to status codes.

    It also owns the one failure that happens before a handler runs: a unary request body
    that does not decode, which grpc would answer UNKNOWN with its internal exception text.
    The deserializer hands such a body over as ``_Undecodable`` and the handler refuses it
    with INVALID_ARGUMENT. A streamed message that does not decode raises DecodeError inside
    the handler's iteration, which status_for_exception maps the same way.
    """

    def wrap_deserializer(self, deserializer, method: str, request_streaming: bool):
        if deserializer is None or request_streaming:
            return deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return deserializer(data)
            except DecodeError as exc:
                return _Undecodable(exc)

        return deserialize

    def wrap_unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def handler(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request_or_iterator, _Undecodable):
                    raise request_or_iterator.error
                return await behavior(request_or_iterator, context)
            except grpc.aio.AbortError:
                raise  # the handler already chose its status
            except Exception as exc:  # noqa: BLE001 - this is the one place errors are mapped
                await _abort_with(exc, context, method)

        return handler

    def wrap_stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        async def handler(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if isinstance(request_or_iterator, _Undecodable):  # unary request, streamed response
                    raise request_or_iterator.error
                async for response in behavior(request_or_iterator, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort_with(exc, context, method)

        return handler
