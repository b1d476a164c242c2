"""Requests and tokens per minute: the budgets of an API key (api_keys.py) and of a target
(routes_file.py), kept as token buckets.

A budget of N per minute holds at most N and refills at N/60 a second: a client may spend a
minute's worth at once, then keeps to the rate (as OpenAI's and Anthropic's limits behave).
Tokens are the prompt's plus the completion's. At admission a request takes the most it can
write (its ``max_tokens``, or the route's ``expected_output_tokens`` when it sets none): its
prompt's length is known only once an engine has read it. When it ends, the bucket is settled
to what it used (the engine's usage; on a broken stream, Started's prompt tokens and the tokens
streamed), so a short reply gives the rest back and the prompt is charged. Settling may take a
bucket below zero (a long prompt): the next request then waits until it has refilled.

Over its budget a request is refused with ResourceExhaustedError carrying the seconds until it
would fit (HTTP's ``retry-after``, gRPC's ``grpc-retry-pushback-ms``). A request that asks more
tokens than a whole minute's budget could never fit: InvalidArgumentError names ``max_tokens``
and the limit. Everything runs on the gateway's one event loop: no locks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgumentError, ResourceExhaustedError

FIELDS = ("requests_per_minute", "tokens_per_minute")
"""The two limits, as an API keys file entry and a routes file target spell them."""


@dataclass(frozen=True, slots=True)
class RateLimits:
    requests_per_minute: int | None = None
    """Requests admitted per minute; None = no limit."""
    tokens_per_minute: int | None = None
    """Prompt + completion tokens per minute; None = no limit."""

    def __bool__(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def parse_limits(item: dict[str, Any], where: str) -> RateLimits:
    """The two limits of a file's entry; ValueError names the entry and the field."""
    values = []
    for name in FIELDS:
        value = item.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        values.append(value)
    return RateLimits(*values)


class RateLimited(ResourceExhaustedError):
    """Over a budget: ``limit`` names which (requests_per_minute, tokens_per_minute)."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit


class Bucket:
    """Up to ``per_minute`` units, refilled continuously at ``per_minute / 60`` a second."""

    __slots__ = ("capacity", "rate", "level", "at")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0: now; inf: never, it is more than the capacity)."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` (negative: give it back, never above the capacity)."""
        self._refill(now)
        self.level = min(self.capacity, self.level - amount)


class RateLimiter:
    """One owner's budgets (an API key's, a target's)."""

    def __init__(self, limits: RateLimits, owner: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.owner = owner
        """How refusals name it: "this API key", "target fast"."""
        self.clock = clock
        now = clock()
        self.requests = None if limits.requests_per_minute is None else Bucket(limits.requests_per_minute, now)
        self.tokens = None if limits.tokens_per_minute is None else Bucket(limits.tokens_per_minute, now)

    def wait_s(self, tokens: int) -> tuple[float, str]:
        """(seconds until a request reserving ``tokens`` fits, the limit it waits on)."""
        now = self.clock()
        waits = [(0.0, "")]
        if self.requests is not None:
            waits.append((self.requests.wait_s(1, now), "requests_per_minute"))
        if self.tokens is not None:
            waits.append((self.tokens.wait_s(tokens, now), "tokens_per_minute"))
        return max(waits)

    def admit(self, tokens: int) -> Grant:
        """Take one request and ``tokens`` now, or raise (see the module's docstring)."""
        wait, limit = self.wait_s(tokens)
        if wait == math.inf:
            raise InvalidArgumentError(f"max_tokens {tokens} is more than {self.owner}'s tokens_per_minute "
                                       f"{self.limits.tokens_per_minute}: ask for fewer tokens")
        if wait > 0:
            raise RateLimited(f"{self.owner} is over its {limit} {getattr(self.limits, limit)}: "
                              f"retry in {wait:.1f} s", limit, wait)
        return self.take(tokens)

    def take(self, tokens: int) -> Grant:
        now = self.clock()
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        return Grant(self, tokens)


class Grant:
    """One request's draw on one budget (or on none: it still counts the usage), settled once
    when the request ends."""

    __slots__ = ("limiter", "reserved", "used", "on_use", "settled")

    def __init__(self, limiter: RateLimiter | None, reserved: int,
                 on_use: Callable[[int, int], None] | None = None) -> None:
        self.limiter = limiter
        self.reserved = reserved
        self.used = 0
        self.on_use = on_use
        """Called with (prompt, completion) tokens as they are counted (the per-key metrics)."""
        self.settled = False

    def use(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.used += prompt_tokens + completion_tokens
        if self.on_use is not None:
            self.on_use(prompt_tokens, completion_tokens)

    def settle(self) -> None:
        """Give back what was reserved and not used (or take what was used beyond it)."""
        if self.settled:
            return
        self.settled = True
        if self.limiter is not None and self.limiter.tokens is not None:
            self.limiter.tokens.take(self.used - self.reserved, self.limiter.clock())
