"""Each lane's rounds as an asyncio task of its own, while the engine runs.

Before ``run`` (and in tests and benchmarks that drive ``EngineCore.step``) no task exists: a
lane attached then gets its task when ``run`` starts; one attached while running gets it at
once. A lost lane's task is cancelled, unless it is the task reporting the loss (it returns
by itself once the lane is detached).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.engine.lane import ExecutorLane


class LaneTasks:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._running = False

    def start(self, lane: ExecutorLane) -> None:
        """Give ``lane`` its task if the engine runs (else ``run`` will)."""
        if self._running:
            self._tasks[lane.name] = asyncio.create_task(lane.run(), name=f"engine-lane-{lane.name}")

    def stop(self, lane: ExecutorLane) -> None:
        task = self._tasks.pop(lane.name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def run(self, lanes: Iterable[ExecutorLane]) -> None:
        """Every lane's task, until cancelled; then they are cancelled and awaited."""
        self._running = True
        for lane in lanes:
            self.start(lane)
        try:
            await asyncio.Event().wait()
        finally:
            self._running = False
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
