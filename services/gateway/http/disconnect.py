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
    finished its cleanup) and ClientDisconnected is raised.

    ``work`` runs in the caller's task, with one watcher task beside it that cancels the caller
    when the connection closes: one task per request fewer than running the work as a task of
    its own, on the path to every request's first token."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:  # the handler itself cancelled (server stopping)
            raise
        task.uncancel()
        raise ClientDisconnected() from None
    finally:
        watcher.cancel()
