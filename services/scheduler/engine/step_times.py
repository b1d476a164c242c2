"""Where the engine loop's time goes, summed over the steps it sent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTimeTotals:
    """Read by the metrics collector and the benchmark's services-vs-in-process breakdown
    (seconds)."""

    steps: int = 0
    sequences: int = 0
    """Sequences scheduled, summed over steps (steps / sequences = mean batch size)."""
    schedule_s: float = 0.0
    executor_s: float = 0.0
    """Awaiting the executor (sending the plan, then reading its result): plan encoding, the
    round trip, the executor's compute, result decoding, and whatever else the event loop
    runs meanwhile (publisher, RPC handlers). With overlapped scheduling only the part of
    the step not hidden behind the loop's own work."""
    execute_s: float = 0.0
    """The executor's own compute, as it reports it (StepResult.execute_seconds)."""
    update_s: float = 0.0
    overlapped: int = 0
    """Steps sent while the previous step was still in flight (overlapped scheduling)."""
    detokenize_rounds: int = 0
    """Detokenize round trips of the publisher: fewer than steps when it caught up on several
    steps at once (see engine/publisher.py)."""

    def add_step(self, sequences: int, schedule_s: float, executor_s: float, execute_s: float,
                 update_s: float) -> None:
        self.steps += 1
        self.sequences += sequences
        self.schedule_s += schedule_s
        self.executor_s += executor_s
        self.execute_s += execute_s
        self.update_s += update_s
