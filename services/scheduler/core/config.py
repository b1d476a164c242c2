"""What the scheduler core works within: the operator's limits and the executor's facts.

``SchedulerLimits`` is everything an operator sets, declared once. The in-process engine's
EngineConfig embeds it, and so does the scheduler service's SchedulerServiceConfig, whose
flags (``--max-num-seqs``), TOKENMILL_* variables and help are generated from these fields
(``services.common.settings.embedded``). A new limit is a field here plus the code that
uses it.

``SchedulerConfig`` is the core's: the limits plus what the executor reports once per
session (its KV pool and the model's limits), built by ``SchedulerConfig.for_executor``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from services.common.settings import setting
from services.common.step import ExecutorInfo


MAX_SCHEDULER_STEPS = 64
"""Beyond a few dozen tokens a burst only delays stops and new arrivals."""


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The operator's limits and switches. Checked by ``validate``, once, when the core starts."""

    max_num_seqs: int = setting(256)
    """Most requests running at once (holding blocks, known to the executor)."""
    max_num_batched_tokens: int = setting(2048)
    """Token budget of one step: sum of num_scheduled_tokens over the plan. ``for_executor``
    raises it to max_num_seqs when below, so every running sequence can decode in a step."""
    max_waiting_requests: int = setting(4096)
    """Most requests waiting to start; beyond it add_request raises QueueFullError."""
    max_grammar_bytes: int = setting(65536)
    """A request's structured output (its JSON schema text, regex, choices or Lark grammar) may
    be this long in UTF-8; a longer one is refused at admission (INVALID_ARGUMENT naming it)."""
    enable_prefix_caching: bool = setting(True)
    """Reuse the K/V of full blocks whose token prefix was computed before."""
    enable_chunked_prefill: bool = setting(True)
    """Split a prompt over several steps when it does not fit the remaining token budget.
    Off: a prompt is scheduled whole or waits for a step with room for all of it."""
    long_prefill_token_threshold: int = setting(0)
    """Most tokens one request may compute in a step (long prompts then share steps with
    decodes instead of taking the whole budget); 0 = no per-request cap."""
    overlap_scheduling: bool = setting(True)
    """Let the scheduler plan step N+1 while the executor runs step N (two steps in flight),
    so the executor does not wait for the scheduler's round trip and bookkeeping. A stop is
    then seen one step late and the extra token dropped. The services and the in-process
    engine (whose model runs on a worker thread) run the same loop. Off: one step at a time."""

    num_scheduler_steps: int = setting(16)
    """Multi-step scheduling: while no request waits to start, a plan of decodes asks the
    executor for up to this many tokens per sequence, each fed back in on the executor's side,
    so the per-step round trip (planning, messages, output processing) is paid once per burst.
    How many of them a burst runs is set by multi_step_max_delay_ms. Tokens then reach clients
    in bursts, a stop is seen at the burst's end (surplus tokens are dropped, never reported),
    and a request arriving meanwhile waits for the burst to end. Requests that speculate or
    have stop strings (whose text is checked after every token) always run one step. 1 = off."""

    multi_step_max_delay_ms: float = setting(4.0)
    """The length of a burst follows the executor's measured time for a decode step: 1 +
    floor(this / step time), at most num_scheduler_steps (services/scheduler/core/burst.py).
    Where a step is cheap next to the round trip (a small model, a fast GPU) bursts are long;
    where a step takes longer than this, there are none. 0 = every burst is
    num_scheduler_steps long."""

    executor_wait_s: float = setting(30.0)
    """When an executor is lost its requests move to the others (recomputing what they lost)
    and their streams go on. When none is left they wait this long for one to come back (a
    restarted executor) before ending with Finished (error); a client's own deadline still
    applies."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field(s) and value(s)."""
        check_limits(self)


def check_limits(limits: SchedulerLimits) -> None:
    """Each limit's range, and the pairs that contradict each other: a ValueError naming the
    field(s) and value(s)."""
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "max_grammar_bytes"):
        value = getattr(limits, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 1 <= limits.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(
            f"num_scheduler_steps must be in [1, {MAX_SCHEDULER_STEPS}], got {limits.num_scheduler_steps}"
        )
    if not math.isfinite(limits.executor_wait_s) or limits.executor_wait_s < 0:
        raise ValueError(f"executor_wait_s must be a finite number >= 0, got {limits.executor_wait_s}")
    if not math.isfinite(limits.multi_step_max_delay_ms) or limits.multi_step_max_delay_ms < 0:
        raise ValueError(
            f"multi_step_max_delay_ms must be a finite number >= 0, got {limits.multi_step_max_delay_ms}"
        )
    if limits.long_prefill_token_threshold < 0:
        raise ValueError(
            f"long_prefill_token_threshold must be >= 0 (0 = no cap), "
            f"got {limits.long_prefill_token_threshold}"
        )
    if limits.max_num_batched_tokens < limits.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={limits.max_num_batched_tokens} is below "
            f"max_num_seqs={limits.max_num_seqs}: not every running sequence could decode in a step"
        )
    if not limits.enable_chunked_prefill and limits.long_prefill_token_threshold > 0:
        raise ValueError(
            f"long_prefill_token_threshold={limits.long_prefill_token_threshold} splits prompts "
            f"over steps and needs enable_chunked_prefill=True (got False)"
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The core's configuration: the operator's limits and the executor's facts."""

    limits: SchedulerLimits
    max_model_len: int
    """Longest sequence (prompt + output) in tokens."""
    num_blocks: int
    """KV-cache blocks the executor holds; valid block ids are [0, num_blocks)."""
    block_size: int
    """Tokens per KV-cache block."""
    vocab_size: int
    """Token ids of new requests are checked against [0, vocab_size)."""
    kv_group_windows: tuple[int, ...] = (0,)
    """Per KV group of the executor's pool, its sliding window (0: full attention); see
    services/common/kv_groups.py."""
    max_loras: int = 0
    """Distinct LoRA adapters the executor holds at once: requests of more adapters than that
    do not run together (a request waits until one of the running adapters' requests ends)."""

    @classmethod
    def for_executor(cls, limits: SchedulerLimits, info: ExecutorInfo) -> SchedulerConfig:
        """The core's config for one executor session (the services' loop and the in-process
        engine both build it here)."""
        budget = max(limits.max_num_batched_tokens, limits.max_num_seqs)
        return cls(
            limits=dataclasses.replace(limits, max_num_batched_tokens=budget),
            max_model_len=info.max_model_len,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            kv_group_windows=info.kv_group_windows,
            max_loras=info.max_loras,
        )

    def validate(self) -> None:
        """Raise ValueError naming the offending field(s) and value(s): the limits alone, the
        executor's facts, then the limits against those facts."""
        self.limits.validate()
        for name in ("max_model_len", "num_blocks", "block_size", "vocab_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one output token), "
                             f"got {self.max_model_len}")
        if not self.kv_group_windows or min(self.kv_group_windows) < 0:
            raise ValueError(f"kv_group_windows must be one window >= 0 per KV group, got {self.kv_group_windows}")
        # A sequence holds a block of each KV group per block_size tokens (until windows pass).
        groups = len(self.kv_group_windows)
        capacity = self.num_blocks // groups * self.block_size
        if capacity < self.max_model_len:
            per_group = f" / {groups} KV groups" if groups > 1 else ""
            raise ValueError(f"num_blocks={self.num_blocks}{per_group} x block_size={self.block_size} = {capacity} "
                             f"tokens cannot hold one sequence of max_model_len={self.max_model_len}")
        limits = self.limits
        if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len, got "
                             f"max_num_batched_tokens={limits.max_num_batched_tokens} < "
                             f"max_model_len={self.max_model_len}: a long prompt could never be scheduled")
