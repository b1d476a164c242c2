"""A request's client-side stream: where its deltas go, its text stream, what it has been told.

The one record the engine keeps of a request beside the scheduler core's ``Request`` (which
it wraps), from admission until the request's final delta. The engine hands it each step's
update with the text the tokenizer made of it (already cut at a stop string: the tokenizer
matches them, services/common/detokenize.py), and gets back the client's GenerationDelta.
No I/O, no clock (callers pass ``now``), no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.request.delta import GenerationDelta, Timings, Usage
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request
from services.scheduler.request.update import RequestUpdate


DeltaSink = Callable[[GenerationDelta], None]
"""Where a request's deltas go: the services' per-request queue, the in-process engine's
outbox. Called on the engine's event loop, once per delta, the last one finished."""


class RequestStream:
    __slots__ = ("request", "sink", "detokenizer", "stream_id", "stream_opened", "arrival_time",
                 "first_token_time", "num_output_tokens", "token_times")

    def __init__(self, request: Request, arrival_time: float, sink: DeltaSink, detokenizer: int,
                 stream_id: int) -> None:
        self.request = request
        """The core's request. Kept after the core forgets it: its first schedule time, prefix
        hits and accepted drafts feed the final delta's timings and usage."""
        self.sink = sink
        self.detokenizer = detokenizer
        """Index of the detokenizer its text stream lives on (its state is there)."""
        self.stream_id = stream_id
        """Its text stream's id: fixed for the request's life, while its seq id changes when it
        moves to another executor."""
        self.stream_opened = False
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.num_output_tokens = 0
        self.token_times: list[float] = []
        """When each delta with tokens was produced: the inter-token gaps of the metrics."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def on_update(self, update: RequestUpdate, text: str, now: float,
                  stop_string: str | None = None) -> GenerationDelta:
        """The client's delta for one step's update and its text (the final flush included
        when the update finishes the request). ``stop_string``: the tokenizer found it in this
        text, which ends the request with STOP (the caller ends it in the core)."""
        token_ids = update.new_token_ids
        if token_ids:
            self.token_times.append(now)
            if self.first_token_time is None:
                self.first_token_time = now
        self.num_output_tokens += len(token_ids)
        delta = GenerationDelta(self.request.request_id, text, list(token_ids), update.new_logprobs,
                                update.prompt_logprobs)
        if stop_string is not None:
            self._finish(delta, FinishReason.STOP, stop_string, now)
        elif update.finish_reason is not None:
            self._finish(delta, update.finish_reason, update.stop_reason, now)
        return delta

    def end(self, now: float, reason: FinishReason = FinishReason.ABORT,
            error_message: str | None = None) -> GenerationDelta:
        """The final delta of a request ended from outside (abort, a backend lost, shutdown)."""
        delta = GenerationDelta(self.request.request_id, error_message=error_message)
        self._finish(delta, reason, None, now)
        return delta

    def _finish(self, delta: GenerationDelta, reason: FinishReason, stop_reason, now: float) -> None:
        request = self.request
        delta.finish_reason = reason
        delta.stop_reason = stop_reason
        delta.usage = Usage(request.num_prompt_tokens, self.num_output_tokens, request.num_cached_tokens)
        delta.timings = _timings(request, self.arrival_time, self.first_token_time, now)


def _timings(request: Request, arrival_time: float, first_token_time: float | None, now: float) -> Timings:
    """A request's timings as it ends at ``now`` (a first schedule or a first token that never
    came counts as ``now``)."""
    scheduled = request.first_scheduled_time if request.first_scheduled_time is not None else now
    first = first_token_time if first_token_time is not None else now
    ms = 1000.0
    return Timings(
        queue_time_ms=(scheduled - arrival_time) * ms,
        time_to_first_token_ms=(first - arrival_time) * ms,
        decode_time_ms=(now - first) * ms,
        e2e_ms=(now - arrival_time) * ms,
        accepted_draft_tokens=request.num_accepted_draft_tokens,
    )
