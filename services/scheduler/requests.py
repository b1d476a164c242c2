"""One request path: the intake and output steps around the scheduler core.

The scheduler service's loop and the in-process engine drive the same core and differ only
in where prompt ids and text come from (the tokenizer service's streams, or a local
tokenizer and detokenizer). Everything between those edges is here, so both take one path,
as vLLM's engines share their input and output processors:

    state = admit(core, request_id, prompt_ids, sampling, stop, eos_token_ids, priority, now)
        the core Request (stop rules + the model's EOS ids) goes into the core, which
        validates it once (ValueError naming the field) or refuses it (QueueFullError);
        its OutputState starts the clock of its timings
    delta, stop_string = state.on_update(update, text, now)
        a core RequestUpdate + its detokenized text → the client's GenerationDelta; a
        stop_string means a stop string ended the request, and the caller must tell the
        core: core.finish_request(request_id, FinishReason.STOP, stop_string)
    delta = state.abort(now)
        the final delta of a request the caller aborted (after core.abort_request)

No I/O, no clock (callers pass ``now``), no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.generation import GenerationDelta
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo
from services.common.stop import StopConditions
from services.scheduler.core.outputs import RequestUpdate
from services.scheduler.core.request import FinishReason, Request
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.output import OutputState


def model_eos_token_ids(tokenizer_eos_token_ids: Sequence[int], info: ExecutorInfo) -> tuple[int, ...]:
    """The EOS ids every request stops at: the tokenizer's when it names any, else the
    model config's (as the executor reports them)."""
    return tuple(tokenizer_eos_token_ids) or tuple(info.eos_token_ids)


@dataclass(slots=True)
class RequestState:
    """One admitted request on the caller's side of the core."""

    request: Request
    """The core's request. Kept after the core forgets it: its first schedule time and
    prefix-cache hits feed the final delta's timings and usage."""
    output: OutputState

    def on_update(self, update: RequestUpdate, text: str, now: float) -> tuple[GenerationDelta, str | None]:
        """Turn one step's update and its text into the client's delta.

        ``text`` is the detokenized text of ``update.new_token_ids``, including the
        detokenizer's final flush when the update finishes the request. Returns (delta, stop
        string the core must hear of): the second is set when a stop string in the text ended
        a request the core still runs; the delta is then final (finish reason stop).
        """
        request = self.request
        delta, matched = self.output.on_update(
            update.new_token_ids, text, update.new_logprobs, update.finish_reason, update.stop_reason,
            now, request.first_scheduled_time, request.num_cached_tokens,
        )
        if delta.timings is not None:
            delta.timings.accepted_draft_tokens = request.num_accepted_draft_tokens
        return delta, matched if update.finish_reason is None else None

    def abort(self, now: float, reason: FinishReason = FinishReason.ABORT) -> GenerationDelta:
        """The final delta of a request ended from outside (the caller ends it in the core)."""
        request = self.request
        delta = self.output.abort(now, request.first_scheduled_time, request.num_cached_tokens, reason)
        if delta.timings is not None:
            delta.timings.accepted_draft_tokens = request.num_accepted_draft_tokens
        return delta


def admit(
    core: Scheduler,
    request_id: str,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    stop: StopConditions,
    eos_token_ids: Sequence[int],
    priority: int,
    now: float,
    tenant: str = "",
) -> RequestState:
    """Add one request to the core; return its state.

    Raises ValueError (naming the field and the limit) when the core refuses the request, or
    QueueFullError when max_waiting_requests are already waiting; nothing is kept then.
    ``tenant`` ("" without authentication) is whom admission is fair between.
    """
    request = Request(request_id, prompt_ids, sampling, stop, eos_token_ids, priority=priority, arrival_time=now,
                      tenant=tenant)
    core.add_request(request)
    output = OutputState(request_id, len(request.prompt_token_ids), tuple(stop.stop),
                         stop.include_stop_str_in_output, now)
    return RequestState(request, output)
