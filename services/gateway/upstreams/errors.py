"""An upstream's failure as the status code the dispatcher and the front ends already handle.

The dispatcher retries UNAVAILABLE before the first token (routing/build.py), so only failures
that cannot be the request's own doing map to it: the connection refused or lost, and 502 / 503 /
504 answers (a 503 says the server is there but busy: it stays in the pool, and the retry may come
back to it after a backoff). A 429 is RESOURCE_EXHAUSTED with its retry-after kept; a 4xx other than that is the
request's (INVALID_ARGUMENT, NOT_FOUND); a refused key is the gateway's own misconfiguration, not
the client's, so it is INTERNAL naming the target's token_env.
"""

from __future__ import annotations

import grpc
import grpc.aio


class UpstreamError(grpc.aio.AioRpcError):
    """A failure as a gRPC status; ``alive``: the target answered (a 503: busy, not gone), so the
    dispatcher does not take it out of the pool (its breaker still counts the failure);
    ``reached``: the request got to the target (False when no connection could be made)."""

    def __init__(self, code: grpc.StatusCode, trailing: grpc.aio.Metadata, details: str, alive: bool,
                 reached: bool = True) -> None:
        super().__init__(code, grpc.aio.Metadata(), trailing, details)
        self.alive = alive
        self.reached = reached


def rpc_error(code: grpc.StatusCode, details: str, retry_after_s: float | None = None,
              alive: bool = False, reached: bool = True) -> UpstreamError:
    trailing = grpc.aio.Metadata()
    if retry_after_s is not None:
        trailing.add("grpc-retry-pushback-ms", str(int(retry_after_s * 1000)))
    return UpstreamError(code, trailing, details, alive, reached)


def status_error(target: str, status: int, body: str, retry_after: str | None) -> UpstreamError:
    said = f"upstream {target} answered HTTP {status}: {body[:500]}"
    if status == 429:
        try:
            after = float(retry_after) if retry_after else None
        except ValueError:
            after = None
        return rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, said, after)
    if status == 503:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, said, alive=True)
    if status in (502, 504):
        return rpc_error(grpc.StatusCode.UNAVAILABLE, said)
    if status in (401, 403):
        return rpc_error(grpc.StatusCode.INTERNAL, f"{said} (the key in target {target}'s token_env is refused)")
    if status == 404:
        return rpc_error(grpc.StatusCode.NOT_FOUND, said)
    if 400 <= status < 500:
        return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, said)
    return rpc_error(grpc.StatusCode.INTERNAL, said)


def refused(kind: str, what: str) -> UpstreamError:
    """A request field this kind of upstream cannot carry: refused, never silently dropped."""
    return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"{what} cannot be sent to an {kind} upstream")
