"""Structured outputs the gateway will not send again for a while: those a target died over.

A target that was serving, took the request and went away (UNAVAILABLE) before its Started
message was still admitting the request: checking and compiling its structured output, which is
attacker-chosen input to a native library. (A target that refused the connection, answered busy
or was already out of the pool is simply down: the request moves on to the next target.) Retrying such a request on the next target could kill every replica in turn (one
request took down three schedulers in 0.10 s), so the dispatcher does not retry it, and
refuses identical ones (same structured output, by content hash) for ``QUARANTINE_S`` at once.
The quarantine expires because a target may also die of something else while a fair request
was in admission; the scheduler keeps its own, lasting quarantine of grammars that crashed a
compile worker (services/scheduler/structured/grammar_compiler.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from services.common.pb.tokenmill.v1 import generation_pb2

QUARANTINE_S = 600.0

MAX_ENTRIES = 4096


def structured_digest(message: generation_pb2.GenerateRequest) -> str | None:
    """The content hash of the request's structured output; None when it has none."""
    if not message.HasField("structured_output") or message.structured_output.WhichOneof("kind") is None:
        return None
    return hashlib.sha256(message.structured_output.SerializeToString(deterministic=True)).hexdigest()


class GrammarQuarantine:
    def __init__(self, clock: Callable[[], float] = time.monotonic, hold_s: float = QUARANTINE_S) -> None:
        self.clock = clock
        self.hold_s = hold_s
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, digest: str) -> None:
        self._until[digest] = self.clock() + self.hold_s
        self._until.move_to_end(digest)
        while len(self._until) > MAX_ENTRIES:
            self._until.popitem(last=False)

    def holds(self, digest: str) -> bool:
        until = self._until.get(digest)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[digest]
            return False
        return True
