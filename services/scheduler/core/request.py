"""One generation request as the scheduler sees it: token ids, progress, stop rules, status.

A request's progress is a single number, ``num_computed_tokens``: how many of its known tokens
(prompt + outputs) already have K/V in the cache. The scheduler's only job is to let it catch
up with ``num_tokens``; a prompt, a prefill chunk, a decode token and speculative tokens are
all "compute the next n tokens". No clock is read here: ``arrival_time`` comes from the caller.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.sampling_params import SamplingParams
from services.common.step import TokenLogprobs


class FinishReason(enum.Enum):
    LENGTH = "length"
    """max_tokens generated, or the sequence filled max_model_len."""
    STOP = "stop"
    """One of stop_token_ids was generated, or the caller found a stop string."""
    EOS = "eos"
    """The model generated one of its EOS tokens (and ignore_eos was off)."""
    ABORT = "abort"
    """The client cancelled."""
    ERROR = "error"
    """Serving the request failed."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Never scheduled yet; holds no blocks."""
    RUNNING = "running"
    """Known to the executor; holds blocks."""
    PREEMPTED = "preempted"
    """Was running, lost its blocks (recompute mode); waits to be scheduled again in full."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_STATUSES

    @staticmethod
    def for_finish_reason(reason: FinishReason) -> RequestStatus:
        return _STATUS_BY_FINISH_REASON[reason]


_FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_STATUS_BY_FINISH_REASON = {
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.EOS: RequestStatus.FINISHED_STOPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, frozen=True)
class StopParams:
    """When the scheduler ends a request (token-level rules; stop strings are the caller's)."""

    max_tokens: int | None = None
    """Most output tokens; None = until the sequence fills max_model_len."""
    stop_token_ids: tuple[int, ...] = ()
    """Generating one of these ends the request with FinishReason.STOP."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids; generating one ends the request with FinishReason.EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    min_tokens: int = 0
    """Stop and EOS tokens do not end the request while fewer than this many tokens were
    generated before them (the sampler also bans them; this is the scheduler's side)."""

    @property
    def banned_before_min_tokens(self) -> tuple[int, ...]:
        """The ids the sampler must ban while fewer than min_tokens were generated
        (what SamplingParams.stop_token_ids should carry)."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids + tuple(t for t in self.eos_token_ids if t not in self.stop_token_ids)

    def validate(self, vocab_size: int | None) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None for no limit), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"
            )
        for field_name in ("stop_token_ids", "eos_token_ids"):
            for token_id in getattr(self, field_name):
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    raise ValueError(
                        f"{field_name} entry {token_id} is outside [0, {vocab_size})"
                    )


def sampling_with_stop_rules(sampling: SamplingParams, stop: StopParams) -> SamplingParams:
    """SamplingParams whose min_tokens / stop_token_ids (the sampler's ban) agree with ``stop``.

    StopParams is the one source of truth: when the caller left the sampler's fields at their
    defaults they are filled from it; when the caller set them differently it is an error.
    """
    if stop.min_tokens == 0 and sampling.min_tokens == 0:
        return sampling  # nothing is banned either way
    banned = stop.banned_before_min_tokens
    if sampling.min_tokens == stop.min_tokens and set(sampling.stop_token_ids) == set(banned):
        return sampling
    if sampling.min_tokens == 0 and not sampling.stop_token_ids:
        return dataclasses.replace(sampling, min_tokens=stop.min_tokens, stop_token_ids=banned)
    raise ValueError(
        f"sampling.min_tokens={sampling.min_tokens} / sampling.stop_token_ids="
        f"{list(sampling.stop_token_ids)} disagree with stop.min_tokens={stop.min_tokens} / "
        f"stop ids {list(banned)}; leave the sampling fields at their defaults to derive them"
    )


class Request:
    """Mutable state of one request. Owned by the Scheduler; others read it.

    ``block_ids`` is maintained by the BlockManager (it is the request's block table).
    """

    __slots__ = (
        "request_id",
        "seq_id",
        "prompt_token_ids",
        "output_token_ids",
        "sampling",
        "stop",
        "priority",
        "arrival_time",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "status",
        "finish_reason",
        "stop_reason",
        "output_logprobs",
        "spec_token_ids",
        "num_preemptions",
        "first_scheduled_time",
        "_all_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop: StopParams | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.seq_id = -1
        """Assigned by Scheduler.add_request; the id the executor knows the sequence by."""
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.stop = stop if stop is not None else StopParams()
        self.priority = priority
        """Lower is served first; equal priorities go by arrival_time."""
        self.arrival_time = arrival_time
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the first schedule (for usage)."""
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that matched (FinishReason.STOP only)."""
        self.output_logprobs: list[TokenLogprobs] = []
        self.spec_token_ids: list[int] = []
        """Draft tokens set by the caller before schedule(); consumed by the next plan."""
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # prompt + outputs, kept as one list so hashing and NewSequence need no concatenation.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list: do not mutate, copy to keep."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then arrival, then admission order (seq_id)."""
        return (self.priority, self.arrival_time, self.seq_id)

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def validate(self, max_model_len: int, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and the limit when the request cannot be served."""
        prompt_len = len(self.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
        if prompt_len >= max_model_len:
            raise ValueError(
                f"prompt length {prompt_len} (prompt_token_ids) must be below "
                f"max_model_len={max_model_len} to leave room for one output token"
            )
        max_tokens = self.stop.max_tokens
        if max_tokens is not None and prompt_len + max_tokens > max_model_len:
            raise ValueError(
                f"prompt length {prompt_len} + max_tokens={max_tokens} = {prompt_len + max_tokens} "
                f"exceeds max_model_len={max_model_len}"
            )
        # min/max run in C; the per-token loop only runs to name the offending id.
        upper = vocab_size if vocab_size is not None else float("inf")
        if min(self.prompt_token_ids) < 0 or max(self.prompt_token_ids) >= upper:
            for index, token_id in enumerate(self.prompt_token_ids):
                if not (0 <= token_id < upper):
                    raise ValueError(
                        f"prompt_token_ids[{index}] = {token_id} is outside [0, {vocab_size})"
                    )
        self.stop.validate(vocab_size)
        if vocab_size is not None:
            self.sampling.validate(vocab_size)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, seq_id={self.seq_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"outputs={self.num_output_tokens}, blocks={self.block_ids})"
        )
