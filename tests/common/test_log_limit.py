"""RateLimitedLog: a burst of lines per key per interval, and a count of those left out."""

from __future__ import annotations

from services.common.log_limit import RateLimitedLog


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def test_a_burst_per_key_per_interval_then_the_count_left_out():
    now = [0.0]
    lines = Lines()
    log = RateLimitedLog(lines, interval_s=10.0, burst=2, clock=lambda: now[0])
    written = [log.log("info", "refused", "a", n=i) for i in range(5)]
    assert written == [True, True, False, False, False]
    assert log.log("info", "refused", "b", n=0)  # another key has its own burst
    now[0] = 10.0
    assert log.log("info", "refused", "a", n=5)
    assert lines.lines == [("refused", {"n": 0}), ("refused", {"n": 1}), ("refused", {"n": 0}),
                           ("refused", {"n": 5, "suppressed": 3})]
