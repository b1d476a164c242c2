"""What each step in flight asked of its requests, kept until that step's update().

With overlapped scheduling up to two plans are in flight; each remembers, per sequence, how
many tokens it computes, whether it samples, its drafts and burst length, and the request's
preemption count at planning time (a later preemption or finish makes the record stale, and
the step's output for it is ignored). ``check_output`` holds the executor to the plan before
anything is applied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.step import SequenceOutput, StepPlan, StepResult
from services.scheduler.request.request import Request


@dataclass(slots=True)
class ScheduledWork:
    """What an in-flight plan asked of one request, kept until its update()."""

    request: Request
    num_scheduled_tokens: int
    samples: bool
    """The step reaches the end of the request's tokens (placeholders included): it samples."""
    num_preemptions: int
    """request.num_preemptions at schedule time: a later preemption makes this record stale."""
    draft_token_ids: list[int] = field(default_factory=list)
    num_steps: int = 1
    """Decode steps run back to back (multi-step): positions computed = num_scheduled_tokens +
    num_steps - 1, tokens sampled = num_steps."""

    @property
    def num_positions(self) -> int:
        return self.num_scheduled_tokens + self.num_steps - 1

    @property
    def is_current(self) -> bool:
        """The request still runs the sequence this step computed (not finished, not preempted)."""
        request = self.request
        return not request.is_finished and request.num_preemptions == self.num_preemptions


@dataclass(slots=True)
class StepInFlight:
    step_id: int
    scheduled: dict[int, ScheduledWork] = field(default_factory=dict)
    """By seq_id."""


def mark_in_flight(step: StepInFlight, request: Request, num_new: int, draft_token_ids: list[int] | None = None,
                   num_steps: int = 1) -> None:
    """Record that ``step`` computes ``num_new`` tokens (and ``num_steps`` decode steps) of
    ``request``, and count them as in flight on the request."""
    samples = request.num_planned_tokens + num_new >= request.num_tokens + request.num_output_placeholders
    step.scheduled[request.seq_id] = ScheduledWork(
        request, num_new, samples, request.num_preemptions, draft_token_ids or [], num_steps
    )
    request.num_in_flight_tokens += num_new + num_steps - 1
    if samples:
        request.num_output_placeholders += num_steps
    if draft_token_ids:
        request.drafts_in_flight = True


def check_output(in_flight: dict[int, ScheduledWork], output: SequenceOutput) -> None:
    """Raise ValueError when an output does not match what its plan asked (the executor is
    held to the plan before anything is applied)."""
    scheduled = in_flight.get(output.seq_id)
    if scheduled is None:
        raise ValueError(f"output for seq id {output.seq_id}, which was not scheduled in this step")
    if not scheduled.is_current:
        return
    request = scheduled.request
    num_tokens = len(output.token_ids)
    # Updates come in step order, so the confirmed state is the state this step started
    # from: the same test as when it was planned (scheduled.samples).
    reaches_end = (
        request.num_computed_tokens + scheduled.num_scheduled_tokens >= request.num_tokens
    )
    drafts = scheduled.draft_token_ids
    if not reaches_end and num_tokens:
        raise ValueError(
            f"seq id {output.seq_id}: {num_tokens} tokens for a prefill chunk that does not "
            f"reach the end of its {request.num_tokens} tokens"
        )
    if reaches_end and scheduled.num_steps > 1 and num_tokens != scheduled.num_steps:
        raise ValueError(
            f"seq id {output.seq_id}: {num_tokens} output tokens, expected {scheduled.num_steps} "
            f"({scheduled.num_steps} decode steps)"
        )
    if reaches_end and not (1 <= num_tokens <= max(1 + len(drafts), scheduled.num_steps)):
        raise ValueError(
            f"seq id {output.seq_id}: {num_tokens} output tokens, expected 1 to "
            f"{1 + len(drafts)} (1 + {len(drafts)} drafts)"
        )
    if num_tokens > 1 and scheduled.num_steps == 1 and output.token_ids[:-1] != drafts[: num_tokens - 1]:
        raise ValueError(
            f"seq id {output.seq_id}: accepted tokens {output.token_ids[:-1]} are not a "
            f"prefix of the drafts {drafts}"
        )
    if request.sampling.prompt_logprobs is None and output.prompt_logprobs:
        raise ValueError(f"seq id {output.seq_id}: prompt logprobs for a request that asked none")
    if request.sampling.prompt_logprobs is not None and output.error is None:
        first = request.num_computed_tokens
        expected = max(0, min(first + scheduled.num_scheduled_tokens, request.num_prompt_tokens - 1) - first)
        got = len(output.prompt_logprobs or ())
        if got != expected or first > len(request.prompt_logprobs) and expected:
            raise ValueError(f"seq id {output.seq_id}: {got} prompt logprobs from position {first}, expected "
                             f"{expected} (with {len(request.prompt_logprobs)} known)")
    if output.logprobs is not None and len(output.logprobs) != num_tokens:
        raise ValueError(
            f"seq id {output.seq_id}: {len(output.logprobs)} logprobs for {num_tokens} tokens"
        )


def checked_in_flight(steps: deque[StepInFlight], plan: StepPlan,
                      result: StepResult) -> dict[int, ScheduledWork]:
    """The scheduled sequences of ``plan``, the oldest step in flight, once ``result`` is
    found to answer each of them that is still current exactly once (else ValueError)."""
    if not steps or plan.step_id != steps[0].step_id:
        oldest = steps[0].step_id if steps else None
        raise ValueError(
            f"plan.step_id={plan.step_id} is not the oldest step in flight ({oldest})"
        )
    in_flight = steps[0].scheduled
    output_seq_ids = [output.seq_id for output in result.outputs]
    if len(set(output_seq_ids)) != len(output_seq_ids):
        raise ValueError(f"step {plan.step_id}: duplicate seq ids in outputs {output_seq_ids}")
    for output in result.outputs:
        check_output(in_flight, output)
    answered = set(output_seq_ids)
    missing = [
        seq_id
        for seq_id, scheduled in in_flight.items()
        if scheduled.is_current and seq_id not in answered
    ]
    if missing:
        raise ValueError(f"step {plan.step_id}: no output for scheduled seq ids {missing}")
    return in_flight
