"""The HTTP port's limits per connection, against clients that hold connections instead of using
them (slowloris: headers sent a byte at a time, or never; thousands of idle sockets).

uvicorn bounds a connection only once it has answered on it (``timeout_keep_alive``) and counts
connections only to answer 503 to a request (``limit_concurrency``): a connection that never
finishes its headers is held forever, and every one holds a file descriptor, so enough of them
starve the process (``/health`` included). This protocol, uvicorn's httptools one with three
more rules, closes:

- a connection whose request headers are not complete ``header_timeout_s`` after it opened, or
  after the first byte of its next request (408);
- request headers (the request line and header lines) over ``max_header_bytes`` (431);
- a connection beyond ``max_connections`` open ones, as it arrives (aborted: its descriptor is
  freed at once).

It also writes through a CoalescingTransport (coalescing.py): one socket write per turn of the
event loop.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway.http.coalescing import CoalescingTransport

_log = structlog.get_logger("tokenmill.gateway.http")

FD_RESERVE = 256
"""Descriptors kept for everything else (gRPC channels to the targets, the listeners, logs)."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int


def fitted_to_descriptors(limits: ConnectionLimits) -> ConnectionLimits:
    """``limits`` with ``max_connections`` within the process's open-file limit: the soft limit is
    raised toward the hard one when it is short, and the connections lowered when that is not
    enough (with a warning)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        fitted = max(1, soft - FD_RESERVE)
        _log.warning("http_max_connections_lowered", configured=limits.max_connections, fitted=fitted,
                     open_file_limit=soft, reason="the open-file limit (ulimit -n) is too low for that many "
                                                  "connections; raise it to serve more")
        return ConnectionLimits(limits.header_timeout_s, limits.max_header_bytes, fitted)
    return limits


def limited_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's ``http`` setting: the httptools protocol class under ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def _status(code: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._headers_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
        if len(self.connections) > self.limits.max_connections:
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._header_timer is None:  # the next request on a kept-alive connection
            self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._headers_too_large:
            super().send_400_response(msg)
            return
        self.transport.write(_status(431, "Request Header Fields Too Large",
                                     f"the request headers are larger than {self.limits.max_header_bytes} bytes"))
        self.transport.close()

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large = True
            raise ValueError("request headers too large")  # the parser's callback error: send_400_response

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_status(408, "Request Timeout", f"the request headers did not arrive within "
                                                                 f"{self.limits.header_timeout_s:g} s"))
            self.transport.close()
