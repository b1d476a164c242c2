"""What one step changed for one request: the core's update, before any text is made."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.step import TokenLogprobs
from services.scheduler.request.finish_reason import FinishReason


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed for one request the caller must hear about."""

    request_id: str
    seq_id: int
    new_token_ids: list[int]
    """Tokens appended this step, cut after a stop. Never empty: a step that only advanced a
    prefill chunk produces no update."""
    new_logprobs: list[TokenLogprobs] | None
    """Parallel to new_token_ids when the request asked for logprobs, else None."""
    finish_reason: FinishReason | None
    """Set when the request finished this step; its blocks are already free."""
    stop_reason: int | str | None = None
    """The stop token id that matched (FinishReason.STOP only)."""
    prompt_logprobs: list[tuple[int, TokenLogprobs]] | None = None
    """On the request's first update, when it asked for prompt logprobs: (prompt token id, its
    logprobs) for every prompt token; the first, which nothing predicts, has logprob 0 and no
    alternatives."""
