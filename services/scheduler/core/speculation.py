"""How many draft tokens a request asks for, from its own running acceptance rate, and the
speculative-decoding counters.

Drafts are free only when they are right: each one costs a position in the step (compute on
a GPU, real time on a CPU) and, in the services, one drafter round trip and the overlap of
two steps in flight. With a per-draft acceptance rate a, the i-th draft of a step survives
with probability a^i (every earlier one must be right), so a draft is worth sending while
a^i >= min_acceptance. k is therefore the largest i <= cap with a^i >= min_acceptance, and 0
when even the first draft is not worth it. A request at 0 sends one probing draft every
``probe_interval`` steps so that a text that turns repetitive later (or a cold start) is
noticed again.

The rate is estimated per draft position actually judged: a step with k drafts of which m
were accepted judged min(m + 1, k) positions and m of them passed (positions after the first
rejection were never judged). An exponential moving average weights recent steps. A step
where the drafter answered with no draft for the request counts as one rejected position.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """Server defaults; a request may lower the cap or turn speculation off."""

    num_speculative_tokens: int = 4
    """Most draft tokens per sequence per step (the cap); 0 turns speculation off."""
    adaptive: bool = True
    """Adapt each request's k to its acceptance rate; off = always the cap."""
    min_acceptance: float = 0.3
    """A draft position is sent while its survival probability a^i is at least this."""
    probe_interval: int = 16
    """At k = 0, one draft every this many steps to re-measure the rate."""
    initial_acceptance: float = 0.7
    """The rate assumed before a request's first verified drafts."""
    smoothing: float = 0.15
    """Weight of one judged position in the moving average."""

    def validate(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0 = off), got {self.num_speculative_tokens}")
        if not 0.0 < self.min_acceptance < 1.0:
            raise ValueError(f"spec min_acceptance must be in (0, 1), got {self.min_acceptance}")
        if self.probe_interval < 1:
            raise ValueError(f"spec probe_interval must be >= 1, got {self.probe_interval}")
        if not 0.0 <= self.initial_acceptance <= 1.0 or not 0.0 < self.smoothing <= 1.0:
            raise ValueError("spec initial_acceptance must be in [0, 1] and smoothing in (0, 1]")


class DraftLength:
    """One request's k, adapted to its acceptance rate (see the module docstring)."""

    __slots__ = ("config", "cap", "acceptance", "_idle_steps")

    def __init__(self, config: SpeculationConfig, cap: int) -> None:
        self.config = config
        self.cap = min(cap, config.num_speculative_tokens)
        self.acceptance = config.initial_acceptance
        self._idle_steps = 0

    def next_k(self) -> int:
        """Drafts to ask for this step (call once per step the request could draft in)."""
        if self.cap <= 0:
            return 0
        if not self.config.adaptive:
            return self.cap
        k, survival = 0, 1.0
        while k < self.cap:
            survival *= self.acceptance
            if survival < self.config.min_acceptance:
                break
            k += 1
        if k > 0:
            self._idle_steps = 0
            return k
        self._idle_steps += 1
        if self._idle_steps >= self.config.probe_interval:
            self._idle_steps = 0
            return 1
        return 0

    def wants_drafts(self) -> bool:
        """Whether next_k could be above 0 now (a probe due counts); no side effect."""
        if self.cap <= 0:
            return False
        if not self.config.adaptive or self.acceptance >= self.config.min_acceptance:
            return True
        return self._idle_steps + 1 >= self.config.probe_interval

    def observe_no_draft(self) -> None:
        """The drafter answered with nothing for this request (no n-gram match): as good as one
        rejected draft, so a request whose text never matches falls to k = 0 too (and the loop
        overlaps its steps again) instead of asking every step."""
        self.observe(1, 0)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A verified step: ``num_accepted`` of ``num_drafts`` drafts survived."""
        if num_drafts <= 0:
            return
        judged = min(num_accepted + 1, num_drafts)
        weight = 1.0 - (1.0 - self.config.smoothing) ** judged
        self.acceptance += weight * (num_accepted / judged - self.acceptance)


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start, named like vLLM's spec-decode metrics."""

    num_drafts: int = 0
    """Verified steps of a sequence that carried at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[i]: how often the draft at position i (0-based) was accepted."""
    drafted_per_position: list[int] = field(default_factory=list)
    """[i]: how often a draft at position i was sent."""

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_drafts:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add another scheduler's counters to these (an engine over several executors)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafted step: accepted drafts + the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
