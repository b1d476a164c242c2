"""How many decode steps a multi-step burst runs: as many as fit a delay budget.

A burst of n decode steps pays the plan -> executor -> update round trip once for n tokens,
but holds the burst's first token back by the n - 1 forwards after it (a client sees tokens
in bursts), and a request arriving meanwhile waits for the burst to end. What that costs
depends on the step: where a decode forward takes 0.1 ms (a small model on a CPU, a GPU
whose round trip is most of a step) sixteen of them hold a token back 1.5 ms and multiply
the throughput of a stream; where it takes 30 ms, one extra step is already a visible stall
for almost nothing saved. So the length is not a constant: ``BurstLength`` keeps a running
estimate of one decode forward's time, from the executor's own timing of plans that only
decode, and allows ``1 + floor(max_delay / step time)`` steps, capped at ``max_steps``.

Before the first measurement a burst is one step: the estimate comes from single steps too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class BurstLength:
    """The decode steps a burst may run now (``steps``), learned from ``observe``."""

    max_steps: int
    """The cap (SchedulerLimits.num_scheduler_steps); 1 = no bursts."""
    max_delay_s: float
    """Most a burst may hold its first token back (SchedulerLimits.multi_step_max_delay_ms);
    0 = every burst is max_steps long, whatever a step costs."""
    smoothing: float = 0.25
    """Weight of a new measurement in the running estimate: one slow step (another process
    took the CPU) shortens the next bursts a little, not to a single step."""
    decode_step_s: float | None = None
    """Running estimate of one decode forward (with its sampling) at the current batch."""

    def observe(self, execute_seconds: float, num_forwards: int) -> None:
        """A plan of decodes only ran ``num_forwards`` forwards back to back in
        ``execute_seconds`` (the executor's timing; 0 = not measured, ignored)."""
        if execute_seconds <= 0 or num_forwards < 1 or not math.isfinite(execute_seconds):
            return
        per_step = execute_seconds / num_forwards
        previous = self.decode_step_s
        self.decode_step_s = per_step if previous is None else previous + self.smoothing * (per_step - previous)

    @property
    def steps(self) -> int:
        if self.max_steps <= 1 or self.max_delay_s <= 0:
            return self.max_steps
        if self.decode_step_s is None:
            return 1
        return max(1, min(self.max_steps, 1 + int(self.max_delay_s / self.decode_step_s)))
