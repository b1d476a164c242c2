"""A tenant's tokens_per_minute: what its requests may use in any RATE_WINDOW_S seconds.

A request reserves its whole possible use when it is admitted (its prompt plus max_tokens, or
the rest of the context without one), and settles when it ends, however it ends (finished,
stopped, cancelled, aborted, failed): the reservation shrinks to what it used, prompt and
generated tokens, and the rest is given back. Charging the prompt at admission and the output
only on a Finished let many tiny prompts with large max_tokens, or streams cancelled before
their end, pass any budget.

Charges age out of the window by the time they were made: a settled request's tokens count
from its admission. No I/O, no locks: the scheduler's event loop owns it; the clock is injected.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from services.common.errors import ResourceExhaustedError

RATE_WINDOW_S = 60.0


class Reservation:
    """One request's charge on a budget, until it is settled."""

    __slots__ = ("time", "tokens", "settled")

    def __init__(self, at: float, tokens: int) -> None:
        self.time = at
        self.tokens = tokens
        self.settled = False


class TokenBudget:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self._charges: deque[Reservation] = deque()
        self._total = 0

    def _expire(self, now: float) -> None:
        while self._charges and self._charges[0].time <= now - RATE_WINDOW_S:
            self._total -= self._charges.popleft().tokens

    def used(self) -> int:
        self._expire(self.clock())
        return self._total

    def reserve(self, tenant: str, tokens: int) -> Reservation:
        """Charge ``tokens`` now, or raise ResourceExhaustedError (with when to retry) when they
        do not fit the window."""
        now = self.clock()
        self._expire(now)
        if self._total + tokens > self.limit:
            retry_s = (self._charges[0].time + RATE_WINDOW_S - now) if self._charges else RATE_WINDOW_S
            raise ResourceExhaustedError(
                f"tenant {tenant!r} has used {self._total} of its tokens_per_minute={self.limit}; this request needs "
                f"{tokens} more; retry in {max(retry_s, 0.0):.1f} s", retry_after_s=max(retry_s, 0.0))
        return self._charge(now, tokens)

    def settle(self, reservation: Reservation, used: int) -> None:
        """The request ended having used ``used`` tokens: its charge becomes that (once)."""
        if reservation.settled:
            return
        reservation.settled = True
        now = self.clock()
        self._expire(now)
        change = max(used, 0) - reservation.tokens
        if change > 0:
            self._charge(now, change)  # more than reserved (never with max_tokens): charged now
        elif change < 0 and self._charges and reservation.time > now - RATE_WINDOW_S:
            reservation.tokens += change  # still in the window: the unused part is given back
            self._total += change

    def spend(self, tokens: int) -> None:
        """Charge ``tokens`` now, whatever the window holds."""
        if tokens > 0:
            self._charge(self.clock(), tokens)

    def _charge(self, now: float, tokens: int) -> Reservation:
        charge = Reservation(now, tokens)
        if tokens > 0:
            self._charges.append(charge)
            self._total += tokens
        return charge
