"""Which clients may call a port that requires client certificates (mTLS): those named by
``--tls-allowed-clients``.

A client certificate signed by the CA proves who a peer is; it does not say the peer may drive
this service. With one CA for a whole deployment, the certificate handed to users of the public
API would open every backend too: a user could hold the executor's only Step session, or plan
steps that read K/V blocks another tenant's prompt filled. So each backend names the identities
it serves (the scheduler's, by default in ``tokenmill up --tls``), matched against the
certificate's subject common name and its DNS subject alternative names, and refuses any other
call with PERMISSION_DENIED before its handler runs. A method may take more identities than its
service does (``method_clients``): an executor's ReadKVBlocks takes the other executors'
certificates (--tls-peer-clients), which open nothing else there, not the Step session nor a
PullKVBlocks that writes into the pool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
import grpc.aio
import structlog

from services.common.interceptor import StreamBehavior, UnaryBehavior, rebuild_handler, refuse
from services.common.log_limit import RateLimitedLog

_log = structlog.get_logger("tokenmill.service")
_refusals = RateLimitedLog(_log)

NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")


def peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    """The names the peer's verified client certificate carries (empty without one)."""
    auth = context.auth_context() or {}
    return {value.decode("utf-8", "replace") for key in NAME_KEYS for value in auth.get(key, ())}


class PeerIdentityInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, allowed: Iterable[str], method_clients: Mapping[str, Iterable[str]] | None = None) -> None:
        self.allowed = frozenset(allowed)
        if not self.allowed:
            raise ValueError("tls_allowed_clients must name at least one identity")
        self._by_method = {method: self.allowed | frozenset(names) for method, names in (method_clients or {}).items()}
        """Full method name -> the identities it takes (its service's and its own)."""
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        return rebuild_handler(handler, lambda behavior: self._unary(behavior, method),
                               lambda behavior: self._stream(behavior, method))

    async def _check(self, request: Any, context: grpc.aio.ServicerContext, method: str) -> None:
        names = peer_names(context)
        if names & self._by_method.get(method, self.allowed):
            return
        self.refused += 1
        _refusals.log("warning", "peer_not_allowed", method, method=method, peer=context.peer(), names=sorted(names))
        await refuse(request, context, grpc.StatusCode.PERMISSION_DENIED,
                     "this client certificate may not call this service (tls_allowed_clients)")

    def _unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(request, context, method)
            return await behavior(request, context)

        return handler

    def _stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        async def handler(request: Any, context: grpc.aio.ServicerContext):
            await self._check(request, context, method)
            async for response in behavior(request, context):
                yield response

        return handler
