"""One long-lived streaming call, logged as a session: started, then ended with how and counters.

The executor's Step, the tokenizer's Detokenize and the drafter's Propose are bidirectional
streams that live as long as their scheduler's connection. Each logs one line when it starts
and one when it ends, saying how it ended:

    requests_ended    the client half-closed (or was cancelled and grpc ended the requests)
    cancelled         the call was cancelled while the handler was suspended
    error: Kind       the handler raised (the error interceptor turns it into a status)

with the counters the handler kept and the seconds it lasted. The handler's loop runs inside
``with logged_stream(...) as session:`` and bumps ``session.counters``; values only known at
the end (open streams left, say) come from ``final``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import structlog


@dataclass(slots=True)
class StreamSession:
    counters: dict[str, int] = field(default_factory=dict)
    """Logged with the end line; the handler increments them."""

    def add(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            self.counters[name] = self.counters.get(name, 0) + amount


@contextmanager
def logged_stream(
    log: Any,
    event: str,
    context: grpc.aio.ServicerContext,
    counters: tuple[str, ...] = (),
    final: Callable[[], dict[str, Any]] | None = None,
    **bound: Any,
) -> Iterator[StreamSession]:
    """Log ``{event}_stream_started`` now and ``{event}_stream_ended`` when the block exits.

    ``bound`` (the RPC name, a call number) is bound to every line logged inside the block.
    """
    session = StreamSession(dict.fromkeys(counters, 0))
    outcome = "requests_ended"
    started = time.perf_counter()
    with structlog.contextvars.bound_contextvars(**bound):
        log.info(f"{event}_stream_started", peer=context.peer())
        try:
            yield session
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            log.info(f"{event}_stream_ended", outcome=outcome, **session.counters, **(final() if final else {}),
                     seconds=round(time.perf_counter() - started, 3))
