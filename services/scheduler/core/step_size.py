"""How much of a running request one plan computes: tokens, drafts and back-to-back decode
steps. Pure functions of the request's counts and the limits (see core/scheduler.py for the
rules of overlap, speculation and multi-step they follow)."""

from __future__ import annotations

from services.common.step import NewSequence
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request.request import Request


def last_token_in_flight(request: Request, max_model_len: int) -> bool:
    """The token a step in flight samples is the request's last (max_tokens or
    max_model_len): planning another step would only compute a surplus token."""
    num_coming = request.num_output_placeholders
    if not num_coming:
        return False
    max_tokens = request.stop.max_tokens
    return (
        max_tokens is not None and request.num_output_tokens + num_coming >= max_tokens
    ) or request.num_tokens + num_coming >= max_model_len


def running_tokens(request: Request, budget: int, limits: SchedulerLimits,
                   max_model_len: int) -> tuple[int, list[int]]:
    """(tokens to compute, drafts to verify) for a running request within ``budget``."""
    # Tokens known or being sampled by a step in flight, minus those computed or planned.
    num_new = request.num_tokens + request.num_output_placeholders - request.num_planned_tokens
    threshold = limits.long_prefill_token_threshold
    if threshold > 0:
        num_new = min(num_new, threshold)
    draft_token_ids: list[int] = []
    # Drafts continue the last known token: only for a request with nothing in flight.
    if num_new == 1 and request.spec_token_ids and not request.num_in_flight_tokens:
        # k drafts + 1 bonus token may all be accepted: keep the total within both limits.
        room = max_model_len - request.num_tokens
        if request.stop.max_tokens is not None:
            room = min(room, request.stop.max_tokens - request.num_output_tokens)
        draft_token_ids = request.spec_token_ids[: max(0, min(room - 1, budget - 1))]
        num_new += len(draft_token_ids)
    return min(num_new, budget), draft_token_ids


def decode_steps(request: Request, num_new: int, draft_token_ids: list[int], max_steps: int,
                 max_model_len: int) -> int:
    """How many decode steps a request runs back to back in this plan: up to ``max_steps``
    for a plain decode (one token that samples, no speculation, no stop strings), never past
    max_tokens or max_model_len (counting the tokens steps in flight sample). A request with
    stop strings runs one step at a time: its text is checked after every token, and a stop
    string inside a burst would be found only after the burst's later tokens."""
    if num_new != 1 or draft_token_ids or request.draft_length is not None or request.stop.stop:
        return 1
    if not request.num_output_tokens:
        # Its first token is still in flight (planned behind its prefill, with overlap): a
        # burst now would keep the executor computing while that token travels to the
        # client, on the same cores. One step, and the burst follows in the next plan.
        return 1
    num_known = request.num_tokens + request.num_output_placeholders
    if request.num_planned_tokens + 1 < num_known:
        return 1  # a one-token prefill chunk short of the end: it samples nothing
    room = max_model_len - num_known
    if request.stop.max_tokens is not None:
        room = min(room, request.stop.max_tokens - request.num_output_tokens - request.num_output_placeholders)
    return max(1, min(max_steps, room))


def starting_tokens(num_uncomputed: int, budget: int, limits: SchedulerLimits) -> int | None:
    """Tokens a waiting request computes in the plan that starts it, its ``num_uncomputed``
    (after a prefix hit) cut at long_prefill_token_threshold and, with chunked prefill, at the
    ``budget``; None when it must wait for a step with room for its whole prompt."""
    num_new = num_uncomputed
    if limits.long_prefill_token_threshold > 0:
        num_new = min(num_new, limits.long_prefill_token_threshold)
    if num_new > budget:
        if not limits.enable_chunked_prefill:
            return None
        num_new = budget
    return num_new


def new_sequence(request: Request, num_new: int) -> NewSequence:
    """The plan's entry of a request it starts: in full, from its computed tokens on."""
    return NewSequence(
        seq_id=request.seq_id,
        token_ids=list(request.all_token_ids),
        prompt_len=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_scheduled_tokens=num_new,
        block_ids=list(request.block_ids),
        sampling=request.sampling,
        min_tokens_ban=request.min_tokens_ban,
        adapter=request.adapter,
    )
