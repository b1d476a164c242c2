"""The requests an engine serves: who they are, where their deltas go, how they end.

One owner (the engine's event loop) reads and changes it; the loop, the output stage and
request handlers all end requests through it, so each request gets exactly one final delta.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from services.common.errors import InvalidArgumentError, UnavailableError
from services.scheduler.engine.ports import DetokenizerPort
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request
from services.scheduler.request.stream import DeltaSink, RequestStream

FinishedObserver = Callable[[GenerationDelta, RequestStream], None]
FinishInCore = Callable[[str, FinishReason, "str | None"], None]
"""Ends a request in the scheduler core (request id, reason, stop string): blocks freed, the
executor told at the next plan."""


class TextStreams:
    """The requests' text streams over the detokenizers: which one a new stream goes to
    (accepting, round-robin), its id, and the streams to close with the next batch."""

    def __init__(self, detokenizers: Sequence[DetokenizerPort]) -> None:
        self._detokenizers = detokenizers
        self._turn = itertools.cycle(range(len(detokenizers)))
        self._ids = itertools.count()
        self.pending_close: list[tuple[int, int]] = []
        """(stream id, detokenizer index) of text streams to close with the next batch."""

    def choose(self) -> int:
        for _ in range(len(self._detokenizers)):
            index = next(self._turn)
            if self._detokenizers[index].accepting:
                return index
        raise UnavailableError("every tokenizer is unavailable; retry shortly")

    def new_id(self) -> int:
        return next(self._ids)

    def take_closed(self) -> list[tuple[int, int]]:
        closed, self.pending_close = self.pending_close, []
        return closed

    def forget(self, detokenizer: int) -> None:
        """That detokenizer's text state is gone: nothing of it to close."""
        self.pending_close = [(seq, i) for seq, i in self.pending_close if i != detokenizer]


class RequestTable(dict[str, RequestStream]):
    """Request id -> its RequestStream, for every request from admission to its final delta.
    Changed only through ``add``, ``deliver`` and the ends below."""

    def __init__(self, detokenizers: Sequence[DetokenizerPort], clock: Callable[[], float],
                 finish_in_core: FinishInCore, on_finished: FinishedObserver | None = None,
                 wake: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.text = TextStreams(detokenizers)
        """Where each request's text stream lives."""
        self._clock = clock
        self._finish_in_core = finish_in_core
        self._on_finished = on_finished or (lambda delta, output: None)
        self._wake = wake

    def check_new(self, request_id: str) -> int:
        """The detokenizer a new request would be pinned to. Raises InvalidArgumentError for a
        request_id in use, UnavailableError when every detokenizer is away."""
        if request_id in self:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use by a running request")
        return self.text.choose()

    def add(self, request: Request, arrival_time: float, sink: DeltaSink, detokenizer: int) -> RequestStream:
        stream = RequestStream(request, arrival_time, sink, detokenizer, self.text.new_id())
        self[request.request_id] = stream
        return stream

    def deliver(self, stream: RequestStream, delta: GenerationDelta) -> None:
        """Send a delta to its request's sink; a final one ends the request here."""
        stream.sink(delta)
        if delta.finished:
            del self[delta.request_id]
            self._on_finished(delta, stream)

    def end(self, stream: RequestStream, reason: FinishReason, error: str | None = None,
            close_stream: bool = True) -> GenerationDelta:
        """End a live request now: in the scheduler core (blocks freed), its text stream closed
        with the next batch, its final delta delivered."""
        self._finish_in_core(stream.request_id, reason, None)
        if stream.stream_opened and close_stream:
            self.text.pending_close.append((stream.stream_id, stream.detokenizer))
        delta = stream.end(self._clock(), reason, error)
        self.deliver(stream, delta)
        self._wake()
        return delta

    def end_all(self, error: str, detokenizer: int | None = None) -> None:
        """End every request (or those on one detokenizer, whose text state is gone) with a
        final Finished (error): one per stream, whatever it had already received."""
        for stream in list(self.values()):
            if detokenizer is None or stream.detokenizer == detokenizer:
                self.end(stream, FinishReason.ERROR, error, close_stream=detokenizer is None)
        if detokenizer is not None:
            self.text.forget(detokenizer)

    def stopped_by_string(self, stream: RequestStream, stop_string: str) -> None:
        """Its text reached a stop string (the detokenizer closed the stream): end it in the
        scheduler core at the next step boundary; its final delta is the caller's."""
        self._finish_in_core(stream.request_id, FinishReason.STOP, stop_string)
        self._wake()
