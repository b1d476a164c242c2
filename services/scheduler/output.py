"""Per-request output state on the scheduler side: stop strings, usage and timings.

Part of the one request path (``services/scheduler/requests.py``) that the in-process engine
and the scheduler service share; only where the text deltas come from differs (a local
detokenizer, or the tokenizer service's Detokenize stream). Stop strings are found here,
after detokenization, and the caller then ends the request in the scheduler core
(``Scheduler.finish_request``), one step late at most: tokens generated past the stop are
never shown.
"""

from __future__ import annotations

from services.common.generation import GenerationDelta, Timings, Usage
from services.common.step import TokenLogprobs
from services.scheduler.stop_strings import StopStringMatcher
from services.scheduler.core.request import FinishReason


class OutputState:
    __slots__ = ("request_id", "prompt_tokens", "arrival_time", "first_token_time", "num_output_tokens",
                 "matcher", "finished", "token_times")

    def __init__(self, request_id: str, prompt_tokens: int, stop: tuple[str, ...], include_stop_str: bool,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.num_output_tokens = 0
        self.matcher = StopStringMatcher(stop, include_stop_str) if stop else None
        self.finished = False
        self.token_times: list[float] = []
        """When each delta with tokens was produced: the inter-token gaps of the metrics."""

    def on_update(
        self,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs] | None,
        finish_reason: FinishReason | None,
        stop_reason: str | int | None,
        now: float,
        first_scheduled_time: float | None,
        num_cached_tokens: int,
    ) -> tuple[GenerationDelta, str | None]:
        """Turn one step's tokens and text into a client delta.

        ``text`` must already include the detokenizer's final flush when ``finish_reason`` is
        set. Returns (delta, matched stop string); on a match the delta is final (reason stop)
        and the caller must finish the request in the scheduler.
        """
        if token_ids:
            self.token_times.append(now)
            if self.first_token_time is None:
                self.first_token_time = now
        self.num_output_tokens += len(token_ids)
        matched = None
        if self.matcher is not None:
            text, matched = self.matcher.feed(text)
            if matched is not None:
                finish_reason, stop_reason = FinishReason.STOP, matched
            elif finish_reason is not None:
                text += self.matcher.finish()
        delta = GenerationDelta(self.request_id, text, list(token_ids), logprobs)
        if finish_reason is not None:
            self._finish(delta, finish_reason, stop_reason, now, first_scheduled_time, num_cached_tokens)
        return delta, matched

    def abort(self, now: float, first_scheduled_time: float | None, num_cached_tokens: int,
              reason: FinishReason = FinishReason.ABORT) -> GenerationDelta:
        delta = GenerationDelta(self.request_id)
        self._finish(delta, reason, None, now, first_scheduled_time, num_cached_tokens)
        return delta

    def _finish(self, delta: GenerationDelta, reason: FinishReason, stop_reason, now: float,
                first_scheduled_time: float | None, num_cached_tokens: int) -> None:
        self.finished = True
        delta.finish_reason = reason.value
        delta.stop_reason = stop_reason
        delta.usage = Usage(self.prompt_tokens, self.num_output_tokens, num_cached_tokens)
        scheduled = first_scheduled_time if first_scheduled_time is not None else now
        first = self.first_token_time if self.first_token_time is not None else now
        ms = 1000.0
        delta.timings = Timings(
            queue_time_ms=(scheduled - self.arrival_time) * ms,
            time_to_first_token_ms=(first - self.arrival_time) * ms,
            decode_time_ms=(now - first) * ms,
            e2e_ms=(now - self.arrival_time) * ms,
        )
