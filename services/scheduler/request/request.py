"""One generation request as the scheduler sees it: token ids, progress, stop rules, status.

Its life: admitted (the engine core's ``submit``) → WAITING → RUNNING (→ PREEMPTED → RUNNING ...) → finished,
with one FinishReason (finish_reason.py). The stop rules are the request's StopConditions
plus the model's EOS ids: the token rules (max_tokens, stop_token_ids, EOS, min_tokens) are
applied to every token a step brings (core/sampled_tokens.py); the stop strings travel with
its text stream to the tokenizer, which matches them where the text is made.

A request's progress is a single number, ``num_computed_tokens``: how many of its known tokens
(prompt + outputs) already have K/V in the cache. The scheduler's only job is to let it catch
up with ``num_tokens``; a prompt, a prefill chunk, a decode token and speculative tokens are
all "compute the next n tokens". With overlapped scheduling a step may be planned before the
previous one's result is seen: ``num_in_flight_tokens`` and ``num_output_placeholders`` count
what the steps in flight compute and will sample, so the next step starts at
``num_planned_tokens`` and may compute a token the scheduler does not know yet (the executor
does). No clock is read here: ``arrival_time`` comes from the caller.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan, TokenLogprobs
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions


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
        "eos_token_ids",
        "min_tokens_ban",
        "priority",
        "tenant",
        "cache_scope",
        "adapter",
        "arrival_time",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_output_placeholders",
        "drafts_in_flight",
        "num_cached_tokens",
        "block_ids",
        "status",
        "finish_reason",
        "stop_reason",
        "output_logprobs",
        "prompt_logprobs",
        "spec_token_ids",
        "draft_length",
        "num_accepted_draft_tokens",
        "num_preemptions",
        "first_scheduled_time",
        "_all_token_ids",
    )

    seq_id: int
    """Assigned by Scheduler.add_request; the id the executor knows the sequence by."""
    tenant: str
    """Who asked ("" without authentication): admission is fair between tenants
    (core/fairness.py)."""
    # What the steps in flight hold (forget_in_flight clears it):
    num_in_flight_tokens: int
    """Tokens scheduled in steps whose update() has not come yet (overlapped scheduling:
    up to two steps). The next step starts at num_planned_tokens."""
    num_output_placeholders: int
    """Tokens the steps in flight will sample: not known yet, but a decode step may already
    be scheduled for them (the executor appends what it samples before the next step)."""
    drafts_in_flight: bool
    """A step in flight verifies draft tokens: how many it accepts, hence where the next
    step starts, is unknown until its update(), so the request waits for it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop: StopConditions | None = None,
        eos_token_ids: Sequence[int] = (),
        priority: int = 0,
        arrival_time: float = 0.0,
        tenant: str = "",
        cache_scope: str = "",
        adapter: str = "",
    ) -> None:
        self.request_id = request_id
        self.seq_id = -1
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.stop = stop if stop is not None else StopConditions()
        self.eos_token_ids = tuple(eos_token_ids)
        """The model's EOS ids: generating one ends the request with EOS (unless ignore_eos)."""
        self.min_tokens_ban: MinTokensBan | None = self.stop.min_tokens_ban(self.eos_token_ids)
        """What the executor's sampler bans before min_tokens; sent with the NewSequence."""
        self.priority = priority
        """Lower is served first; equal priorities go by arrival_time."""
        self.cache_scope = cache_scope
        """Whose cached prefixes it may reuse (block_manager.py): requests of one scope share, two
        scopes never ("" = the unscoped requests, e.g. without authentication)."""
        self.adapter = adapter
        """The LoRA adapter it runs with ("" = the base model); cache_scope already tells its
        adapter apart, so no prefix computed with other weights serves it."""
        self.tenant = tenant
        self.arrival_time = arrival_time
        self.num_computed_tokens = 0
        """Known tokens whose K/V is in the cache, as of the last update() (confirmed)."""
        self.forget_in_flight()
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the first schedule (for usage)."""
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that matched (FinishReason.STOP only)."""
        self.output_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        """With sampling.prompt_logprobs: entry i is prompt token i + 1's, as the chunks computed them."""
        self.spec_token_ids: list[int] = []
        """Draft tokens set by the caller before schedule(); consumed by the next plan."""
        self.draft_length = None
        """How many drafts to ask for (adaptive, a core.speculation.DraftLength, set by the engine
        at admission); None = this request does not speculate."""
        self.num_accepted_draft_tokens = 0
        """Output tokens that came from accepted drafts (reported in the final timings)."""
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
        """Known tokens: prompt + outputs the scheduler has seen (placeholders excluded)."""
        return len(self._all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens computed or being computed by a step in flight: where the next step starts."""
        return self.num_computed_tokens + self.num_in_flight_tokens

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

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet: its prompt must be
        computed in full (a prefix-cache hit would skip positions whose logits it needs)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, first_position: int, entries: Sequence[TokenLogprobs]) -> None:
        """A chunk's prompt logprobs, from position ``first_position`` on (each predicting the
        token after it); the ones already known (a recomputed prompt) are skipped."""
        known = len(self.prompt_logprobs)
        if first_position > known:
            raise ValueError(f"request {self.request_id}: prompt logprobs from position {first_position}, "
                             f"but only {known} are known")
        self.prompt_logprobs.extend(entries[known - first_position:])

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def forget_in_flight(self) -> None:
        """Its steps in flight no longer count: their records are stale (not current)."""
        self.num_in_flight_tokens = 0
        self.num_output_placeholders = 0
        self.drafts_in_flight = False

    def leave_executor(self) -> None:
        """It no longer runs on its executor (that executor was lost, or computed its prompt for
        another): nothing of it is in flight, no block of that pool is its, and it restarts
        from its known tokens wherever it is added next (a new seq id there)."""
        self.forget_in_flight()
        self.num_preemptions += 1  # what its old executor still computes for it is stale
        self.status = RequestStatus.PREEMPTED
        self.seq_id = -1
        self.num_computed_tokens = 0
        self.block_ids = []
        self.spec_token_ids = []

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, seq_id={self.seq_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"in_flight={self.num_in_flight_tokens}+{self.num_output_placeholders}, "
            f"outputs={self.num_output_tokens}, blocks={self.block_ids})"
        )
