"""A non-streamed answer's work, cancelled when its client goes away.

A streamed answer notices a closed connection when it writes to it (Starlette's
StreamingResponse also listens for ``http.disconnect``); a non-streamed one writes only at the
end, so without this its choices (n = 64 x 500 tokens) would all be generated for nobody. The
body is already read when a handler runs, so the next ``receive`` waits for the connection to
close: the work runs as a task beside that wait, and whichever ends first cancels the other.
Cancelling the work closes its ChoiceStreams, whose engine calls are cancelled, and the
engine aborts them at its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")

CLIENT_CLOSED = 499
"""The status the answer is counted with (nginx's "client closed request"); nobody reads it."""


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (and has
    finished its cleanup) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # the handler itself cancelled (server stopping): both go
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled() and watcher.done() and not watcher.cancelled():
        raise ClientDisconnected()
    return task.result()
