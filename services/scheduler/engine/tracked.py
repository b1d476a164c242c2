"""What the engine core keeps of each request it serves, beside the scheduler core's Request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.output import RequestOutput

DeltaSink = Callable[[GenerationDelta], None]
"""Where a request's deltas go: the services' per-request queue, the in-process engine's
outbox. Called on the engine's event loop, once per delta, the last one finished."""


@dataclass(slots=True)
class TrackedRequest:
    output: RequestOutput
    sink: DeltaSink
    detokenizer: int
    """Index of the detokenizer its text stream lives on (its state is there)."""
    stream_id: int
    """Its text stream's id: fixed for the request's life, while its seq id changes when it
    moves to another executor."""
    stream_opened: bool = False
