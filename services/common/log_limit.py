"""Log lines that a caller can provoke, at a bounded rate.

Every refused call (a bad token, a full queue, a malformed request) used to write one line, so a
client sending refusals by the thousand filled the logs and spent the server's CPU on them. Such
lines go through a ``RateLimitedLog``: per key (a method and a status, say), at most ``burst``
lines every ``interval_s``; the first line after a quiet spell says how many were left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_INTERVAL_S = 10.0
DEFAULT_BURST = 5
MAX_KEYS = 1024
"""Keys tracked at once; beyond it the oldest are forgotten (their counts were logged or lost)."""


class RateLimitedLog:
    def __init__(self, logger: Any, interval_s: float = DEFAULT_INTERVAL_S, burst: int = DEFAULT_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._windows: dict[Hashable, list] = {}
        """key -> [window start, lines written in it, lines left out since the last written]"""

    def log(self, level: str, event: str, key: Hashable, **fields: Any) -> bool:
        """Write the line unless ``key`` used its burst in this interval; True when written."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.interval_s:
            suppressed = window[2] if window is not None else 0
            if window is None and len(self._windows) >= MAX_KEYS:
                self._windows.pop(next(iter(self._windows)))
            window = self._windows[key] = [now, 0, suppressed]
        if window[1] >= self.burst:
            window[2] += 1
            return False
        window[1] += 1
        if window[2]:
            fields["suppressed"] = window[2]
            window[2] = 0
        getattr(self._logger, level)(event, **fields)
        return True
