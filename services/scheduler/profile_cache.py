"""GetProfile's answers at a bounded cost: cached snapshots, and a cap on fresh ones.

A snapshot sorts every sample of its window (up to the ring's 65,536) on the event loop that
also runs every stream, and GetProfile is open to any authenticated caller (and to gateways
polling it), so a loop of calls, each with another window, could slow every stream. Here a
window's snapshot (windows rounded to a tenth of a second) is reused while no request finished
since and it is younger than ``max_age_s``, and at most ``max_fresh_per_s`` snapshots are
computed in any second: beyond it a window answered before gets its last snapshot, however
old, and a new window RESOURCE_EXHAUSTED with a pushback. A caller polling at an ordinary
rate always reads an exact snapshot.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.latency_profile import LatencyProfileRecorder, LatencySnapshot

MAX_AGE_S = 1.0
MAX_FRESH_PER_S = 10
MAX_WINDOWS = 64
"""Windows whose last snapshot is kept."""


class ProfileCache:
    def __init__(self, recorder: LatencyProfileRecorder, max_age_s: float = MAX_AGE_S,
                 max_fresh_per_s: int = MAX_FRESH_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.recorder = recorder
        self.max_age_s = max_age_s
        self.max_fresh_per_s = max_fresh_per_s
        self.clock = clock
        self._snapshots: OrderedDict[float, tuple[float, int, LatencySnapshot]] = OrderedDict()
        """window -> (when computed, samples recorded by then, the snapshot)"""
        self._fresh: deque[float] = deque()
        self.computed = 0

    def snapshot(self, window_s: float | None = None) -> LatencySnapshot:
        if window_s is not None and (not math.isfinite(window_s) or window_s <= 0):
            raise InvalidArgumentError(f"window_seconds must be a positive number, got {window_s}")
        key = round(window_s if window_s is not None else self.recorder.window_s, 1) or 0.1
        now = self.clock()
        cached = self._snapshots.get(key)
        recorded = self.recorder.recorded
        if cached is not None and cached[1] == recorded and now - cached[0] < self.max_age_s:
            return cached[2]
        while self._fresh and self._fresh[0] <= now - 1.0:
            self._fresh.popleft()
        if len(self._fresh) >= self.max_fresh_per_s:
            if cached is not None:
                return cached[2]
            retry_s = self._fresh[0] + 1.0 - now
            raise ResourceExhaustedError(f"GetProfile computes at most {self.max_fresh_per_s} new windows a second; "
                                         f"retry in {retry_s:.2f} s", retry_after_s=retry_s)
        self._fresh.append(now)
        snapshot = self.recorder.snapshot(key)
        self.computed += 1
        self._snapshots[key] = (now, recorded, snapshot)
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > MAX_WINDOWS:
            self._snapshots.popitem(last=False)
        return snapshot
