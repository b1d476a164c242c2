"""What a service runs around its server's stop, and on SIGHUP.

A service registers callbacks on its RunningServer (``on_stopping``, ``on_stop``,
``on_reload``); the server runs them at their moment (services/common/server.py, "Stopping,
in order"). A failing callback is logged and the others still run: one bad cleanup or file
must not block a stop or the other reloads.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

_log = structlog.get_logger("tokenmill.server")


@dataclass(eq=False)
class ServerHooks:
    stopping: list[Callable[[float], Awaitable[None] | None]] = field(default_factory=list)
    stopped: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)
    reloads: list[Callable[[], None]] = field(default_factory=list)

    def on_stop(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Run callback (sync or async) after the server stopped; newest registered runs first."""
        self.stopped.append(callback)

    def on_stopping(self, callback: Callable[[float], Awaitable[None] | None]) -> None:
        """Run callback(grace) when a stop begins, after health turns NOT_SERVING and before
        the server refuses calls: a service ends its long-lived streams cleanly here."""
        self.stopping.append(callback)

    def on_reload(self, callback: Callable[[], None]) -> None:
        """Run callback on SIGHUP, after the TLS files are re-read (the scheduler re-reads its
        auth tokens file)."""
        self.reloads.append(callback)

    async def run_stopping(self, server: str, deadline: float) -> None:
        """Each ``on_stopping`` callback, given what is left of the stop's grace until ``deadline``."""
        for callback in self.stopping:
            try:
                result = callback(max(0.0, deadline - time.monotonic()))
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - a failing hook must not block the stop
                _log.exception("on_stopping_callback_failed", server=server, callback=repr(callback))

    async def run_stopped(self, server: str) -> None:
        for callback in reversed(self.stopped):
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing cleanup must not skip the others
                _log.exception("on_stop_callback_failed", server=server, callback=repr(callback))

    def run_reloads(self, server: str) -> None:
        for callback in self.reloads:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one bad file must not stop the other reloads
                _log.exception("reload_callback_failed", server=server, callback=repr(callback))
