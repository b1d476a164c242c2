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


def combined_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """Several executors' stats as one engine's: counts and counters summed, the KV usage over
    all their blocks."""
    num_blocks = sum(p.num_blocks for p in parts)
    held = sum(p.kv_cache_usage * p.num_blocks for p in parts)
    spec = SpecDecodeStats()
    for part in parts:
        spec.merge(part.spec_decode)
    return SchedulerStats(
        num_running=sum(p.num_running for p in parts), num_waiting=sum(p.num_waiting for p in parts),
        num_preemptions=sum(p.num_preemptions for p in parts), kv_cache_usage=held / num_blocks if num_blocks else 0.0,
        num_free_blocks=sum(p.num_free_blocks for p in parts), num_blocks=num_blocks,
        prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
        prefix_cache_hits=sum(p.prefix_cache_hits for p in parts), spec_decode=spec)
