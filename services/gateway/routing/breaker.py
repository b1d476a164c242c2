"""A target's circuit breaker: out of the pool after ``failures`` failed requests in a row.

Health polls catch a target that is down; they miss one that answers its health check and fails
every request (an upstream whose listing answers while its completions return 500 or time out,
an engine whose model is broken). The dispatcher tells the breaker each request's outcome as far
as the target is concerned: failures are the target's (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL,
UNKNOWN, a Finished with reason ERROR), never the request's own (INVALID_ARGUMENT, NOT_FOUND, ...),
and a rate limit's RESOURCE_EXHAUSTED is neither.

closed --(failures in a row)--> open --(open_s later)--> half-open --(its one request succeeds)--> closed
                                  ^------------------------(it fails)-----------'

While open the target is out of the pool whatever its health says; half-open lets exactly one
request through (the probe), and while that request runs the target stays out for the others.
Pure state: the clock is injected, the pool and the dispatcher apply it.
"""

from __future__ import annotations

from collections.abc import Callable

TARGET_FAILURES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"})

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    __slots__ = ("failures", "open_s", "clock", "state", "consecutive", "open_until", "probing", "opened")

    def __init__(self, failures: int, open_s: float, clock: Callable[[], float]) -> None:
        self.failures = failures
        self.open_s = open_s
        self.clock = clock
        self.state = CLOSED
        self.consecutive = 0
        """Failed requests in a row."""
        self.open_until = 0.0
        self.probing = False
        """Half-open and its one request is in flight."""
        self.opened = 0
        """Times it opened (for tests and logs)."""

    def admits(self) -> bool:
        """May the target be in the pool now (as far as the breaker is concerned)."""
        if self.state == OPEN:
            if self.clock() < self.open_until:
                return False
            self.state = HALF_OPEN
        return not self.probing

    def dispatched(self) -> bool:
        """A request goes to the target; True when it is the half-open probe (the target then
        takes no other until it ends)."""
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def succeeded(self) -> None:
        self.consecutive = 0
        self.probing = False
        self.state = CLOSED

    def failed(self) -> bool:
        """One failure of the target's own; True when the breaker opens with it."""
        self.consecutive += 1
        was_probe, self.probing = self.probing, False
        if was_probe or self.state == HALF_OPEN or self.consecutive >= self.failures:
            self.state = OPEN
            self.open_until = self.clock() + self.open_s
            self.opened += 1
            return True
        return False

    def ended_without_verdict(self) -> None:
        """The request ended in a way that says nothing of the target (the client went away, or
        the request was refused as its own fault): a probe gives its turn to the next request."""
        self.probing = False
