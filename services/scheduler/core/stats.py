"""A snapshot of the scheduler core's gauges and counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core.speculation import SpecDecodeStats


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's gauges and counters."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    """Preemptions since start (counter)."""
    kv_cache_usage: float
    """Fraction of KV blocks held by requests, in [0, 1]."""
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache since start (counter)."""
    prefix_cache_hits: int
    """Tokens of those served from the cache (counter)."""
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    """Speculative decoding counters since start (a copy)."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
