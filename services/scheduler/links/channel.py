"""What every backend link shares: channel options, waiting for a backend, reading how a call ended."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import structlog

from services.common.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from services.common.server import channel_options

_log = structlog.get_logger("tokenmill.scheduler")

BACKEND_CHANNEL_OPTIONS = channel_options() + [
    # gRPC's default back-off after a lost connection starts at 1 s and grows to 120 s; a
    # backend the launcher restarts within a second must be found again within a few.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


async def run_to_end(call: grpc.aio.UnaryUnaryCall):
    """The reply of a unary call that is not cancelled with its caller.

    A Generate handler awaiting its prompt's Encode is cancelled when its client goes away (a
    cancel, a passing deadline). Cancelling the call with it would leak C memory in grpcio's
    asyncio layer (1.85): ``execute_batch`` frees a batch's ``grpc_op`` array and the request's
    byte buffer only when its awaiting coroutine resumes, so a batch whose awaiter is cancelled
    keeps ~0.6 KB of the C heap for good. Under the stress suite's load one Encode in 170 was
    cut so, the largest part of the scheduler's slow C-heap growth (heaptrack; docs/design.md,
    Hardening). The caller here gets its CancelledError at once; the call, already sent and
    bounded by its own deadline, finishes in the background and its batch is freed."""
    return await asyncio.shield(call)


async def wait_ready(channel: grpc.aio.Channel, address: str, timeout: float) -> None:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except asyncio.TimeoutError:
        raise UnavailableError(f"{address} did not become reachable within {timeout:.0f}s") from None


async def ended(call, exc: BaseException | None) -> str:
    """How a stream call ended, as its status (never an asyncio state error's text)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    try:
        code = await asyncio.wait_for(call.code(), 1.0)
        return f"{code.name}: {await call.details()}"
    except (asyncio.TimeoutError, grpc.RpcError):
        return "the stream broke"


def map_rpc_error(exc: grpc.RpcError, backend: str, address: str) -> Exception:
    """The error a request's caller hears when its call to a backend failed: the backend's own
    words when it judged the request (INVALID_ARGUMENT, FAILED_PRECONDITION, DEADLINE_EXCEEDED),
    else that the backend is unavailable, without its address or its details (logged here)."""
    code = exc.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return InvalidArgumentError(exc.details())
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"the {backend} did not answer in time: {exc.details()}")
    _log.warning("backend_call_failed", backend=backend, address=address, code=code.name, details=exc.details())
    return UnavailableError(f"the {backend} is unavailable ({code.name}); retry shortly")
