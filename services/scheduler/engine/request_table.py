"""The requests an engine serves: who they are, where their deltas go, how they end.

One owner (the engine's event loop) reads and changes it; the loop, the output stage and
request handlers all end requests through it, so each request gets exactly one final delta.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from services.common.errors import InvalidArgumentError, UnavailableError
from services.scheduler.engine.ports import DetokenizerPort
from services.scheduler.engine.tracked import DeltaSink, TrackedRequest
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.output import RequestOutput

FinishedObserver = Callable[[GenerationDelta, RequestOutput], None]
FinishInCore = Callable[[str, FinishReason, "str | None"], None]
"""Ends a request in the scheduler core (request id, reason, stop string): blocks freed, the
executor told at the next plan."""


class RequestTable:
    def __init__(self, detokenizers: Sequence[DetokenizerPort], clock: Callable[[], float],
                 finish_in_core: FinishInCore, on_finished: FinishedObserver | None = None,
                 wake: Callable[[], None] = lambda: None) -> None:
        self._detokenizers = detokenizers
        self._clock = clock
        self._finish_in_core = finish_in_core
        self._on_finished = on_finished or (lambda delta, output: None)
        self._wake = wake
        self._tracked: dict[str, TrackedRequest] = {}
        self._pending_close: list[tuple[int, int]] = []
        """(stream id, detokenizer index) of text streams to close with the next batch."""
        self._turn = itertools.cycle(range(len(detokenizers)))
        self._stream_ids = itertools.count()

    def check_new(self, request_id: str) -> int:
        """The detokenizer a new request would be pinned to (accepting, round-robin).

        Raises InvalidArgumentError for a request_id in use, UnavailableError when every
        detokenizer is away."""
        if request_id in self._tracked:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use by a running request")
        for _ in range(len(self._detokenizers)):
            index = next(self._turn)
            if self._detokenizers[index].accepting:
                return index
        raise UnavailableError("every tokenizer is unavailable; retry shortly")

    def add(self, output: RequestOutput, sink: DeltaSink, detokenizer: int) -> None:
        self._tracked[output.request_id] = TrackedRequest(output, sink, detokenizer, next(self._stream_ids))

    def get(self, request_id: str) -> TrackedRequest | None:
        return self._tracked.get(request_id)

    def __len__(self) -> int:
        return len(self._tracked)

    def __iter__(self) -> Iterator[TrackedRequest]:
        return iter(list(self._tracked.values()))

    def deliver(self, tracked: TrackedRequest, delta: GenerationDelta) -> None:
        """Send a delta to its request's sink; a final one ends the request here."""
        tracked.sink(delta)
        if delta.finished:
            del self._tracked[delta.request_id]
            self._on_finished(delta, tracked.output)

    def end(self, tracked: TrackedRequest, reason: FinishReason, error: str | None = None,
            close_stream: bool = True) -> GenerationDelta:
        """End a live request now: in the scheduler core (blocks freed), its text stream closed
        with the next batch, its final delta delivered."""
        request = tracked.output.request
        self._finish_in_core(request.request_id, reason, None)
        if tracked.stream_opened and close_stream:
            self._pending_close.append((tracked.stream_id, tracked.detokenizer))
        delta = tracked.output.end(self._clock(), reason, error)
        self.deliver(tracked, delta)
        self._wake()
        return delta

    def end_all(self, error: str, detokenizer: int | None = None) -> None:
        """End every request (or those on one detokenizer, whose text state is gone) with a
        final Finished (error): one per stream, whatever it had already received."""
        for tracked in self:
            if detokenizer is None or tracked.detokenizer == detokenizer:
                self.end(tracked, FinishReason.ERROR, error, close_stream=detokenizer is None)
        if detokenizer is not None:
            self._pending_close = [(seq, i) for seq, i in self._pending_close if i != detokenizer]

    def stopped_by_string(self, tracked: TrackedRequest, stop_string: str) -> None:
        """Its text reached a stop string (the detokenizer closed the stream): end it in the
        scheduler core at the next step boundary; its final delta is the caller's."""
        self._finish_in_core(tracked.output.request_id, FinishReason.STOP, stop_string)
        self._wake()

    def take_pending_close(self) -> list[tuple[int, int]]:
        closed, self._pending_close = self._pending_close, []
        return closed
