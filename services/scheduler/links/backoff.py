"""Reconnecting with exponential back-off: the one loop every backend link's reconnect runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def retry_until_connected(connect: Callable[[], Awaitable[object]], *, first_delay_s: float,
                                max_delay_s: float, failed: Callable[[Exception, float], None],
                                stopped: Callable[[], bool] = lambda: False) -> bool:
    """Await ``connect()`` until it returns (True) or ``stopped()`` (False). After each failure
    ``failed(error, delay)`` is told (to log it) and the next try waits ``delay``, which starts
    at ``first_delay_s`` and doubles up to ``max_delay_s``: a backend that is back within a
    second is found within a second, one that stays away is not hammered."""
    delay = first_delay_s
    while not stopped():
        try:
            await connect()
        except Exception as exc:  # noqa: BLE001 - whatever the backend did, the link keeps trying
            failed(exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
            continue
        return True
    return False


class KeepConnected:
    """A session kept open in the background: ``connect`` is retried with back-off until it
    succeeds, and again each time the owner reports the session ``lost``."""

    def __init__(self, connect: Callable[[], Awaitable[object]], *, first_delay_s: float, max_delay_s: float,
                 failed: Callable[[Exception, float], None], name: str) -> None:
        self._connect = connect
        self._delays = (first_delay_s, max_delay_s)
        self._failed = failed
        self._name = name
        self._lost = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    def lost(self) -> None:
        self._lost.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            self._lost.clear()
            await retry_until_connected(self._connect, first_delay_s=self._delays[0], max_delay_s=self._delays[1],
                                        failed=self._failed)
            await self._lost.wait()
