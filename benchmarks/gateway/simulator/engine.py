"""A simulated continuous-batching engine: the latency behaviour of a tokenmill engine, no model.

One asyncio task runs steps while there is work: each step admits waiting requests up to
``max_running`` (first come, first served), then every running request gets one token. A step
lasts

    tpot_ms * (1 + batch_slowdown * (running - 1)) + prefill_ms * (requests admitted this step)

so in-flight batching raises every request's latency as the batch grows, a new request's
prefill delays the batch it joins, and requests beyond ``max_running`` queue (their TTFT then
includes the wait). ``jitter`` scales each step by a seeded random factor in [1 - j, 1 + j].
A request generates exactly its max_tokens (``default_max_tokens`` when it has none): the
simulator has no EOS. Deltas go out every ``stream_interval`` tokens (and for the first token),
so 64 simulated engines fit in one process.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SimSpec:
    name: str
    prefill_ms: float = 20.0
    tpot_ms: float = 10.0
    batch_slowdown: float = 0.05
    max_running: int = 32
    jitter: float = 0.0
    stream_interval: int = 1
    default_max_tokens: int = 128
    seed: int = 0
    profile_delay_ms: float = 0.0
    """GetProfile answers this late (an engine whose event loop is busy), for tests of slow polls."""

    def validate(self) -> None:
        if self.prefill_ms < 0 or self.tpot_ms <= 0 or self.batch_slowdown < 0 or not 0 <= self.jitter < 1:
            raise ValueError(f"engine {self.name}: prefill_ms >= 0, tpot_ms > 0, batch_slowdown >= 0 and "
                             f"jitter in [0, 1) are required, got {self}")
        if self.max_running < 1 or self.stream_interval < 1 or self.default_max_tokens < 1:
            raise ValueError(f"engine {self.name}: max_running, stream_interval and default_max_tokens must be >= 1")


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    max_tokens: int
    prompt_tokens: int
    arrived: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    unsent: int = 0
    first_token_at: float | None = None
    scheduled_at: float | None = None
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class SimFinished:
    """A request's end as the engine reports it."""

    reason: str  # "length" or "abort"
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    decode_ms: float
    e2e_ms: float


class SimEngine:
    """Requests in, ("tokens", n) and ("finished", SimFinished) events out on each request's queue."""

    def __init__(self, spec: SimSpec, on_finished=None, clock=time.monotonic, sleep=asyncio.sleep) -> None:
        spec.validate()
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        """How a step's time passes (a test passes a virtual clock's)."""
        self.on_finished = on_finished
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.live: dict[str, SimRequest] = {}
        self._rng = random.Random(spec.seed)
        self._task: asyncio.Task | None = None
        self.steps = 0

    def submit(self, request_id: str, max_tokens: int | None, prompt_tokens: int) -> SimRequest:
        req = SimRequest(request_id, max_tokens or self.spec.default_max_tokens, prompt_tokens, self.clock())
        self.waiting.append(req)
        self.live[request_id] = req
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"sim-{self.spec.name}")
        return req

    def abort(self, request_id: str) -> bool:
        req = self.live.get(request_id)
        if req is None:
            return False
        req.aborted = True
        return True

    async def _run(self) -> None:
        spec = self.spec
        while self.waiting or self.running:
            admitted = 0
            while self.waiting and len(self.running) < spec.max_running:
                req = self.waiting.popleft()
                if req.aborted:
                    self._finish(req, "abort")
                    continue
                req.scheduled_at = self.clock()
                self.running.append(req)
                admitted += 1
            if not self.running:
                continue
            step_ms = spec.tpot_ms * (1.0 + spec.batch_slowdown * (len(self.running) - 1)) + spec.prefill_ms * admitted
            if spec.jitter:
                step_ms *= 1.0 + self._rng.uniform(-spec.jitter, spec.jitter)
            await self.sleep(step_ms / 1000.0)
            self.steps += 1
            self._advance()

    def _advance(self) -> None:
        now = self.clock()
        interval = self.spec.stream_interval
        still = []
        for req in self.running:
            if req.aborted:
                self._flush(req)
                self._finish(req, "abort")
                continue
            req.generated += 1
            req.unsent += 1
            if req.first_token_at is None:
                req.first_token_at = now
                self._flush(req)
            elif req.unsent >= interval:
                self._flush(req)
            if req.generated >= req.max_tokens:
                self._flush(req)
                self._finish(req, "length")
            else:
                still.append(req)
        self.running = still

    @staticmethod
    def _flush(req: SimRequest) -> None:
        if req.unsent:
            req.queue.put_nowait(("tokens", req.unsent))
            req.unsent = 0

    def _finish(self, req: SimRequest, reason: str) -> None:
        now = self.clock()
        self.live.pop(req.request_id, None)
        first = req.first_token_at
        finished = SimFinished(
            reason, req.generated, ((req.scheduled_at or now) - req.arrived) * 1000.0,
            ((first or now) - req.arrived) * 1000.0, (now - first) * 1000.0 if first is not None else 0.0,
            (now - req.arrived) * 1000.0)
        req.queue.put_nowait(("finished", finished))
        if self.on_finished is not None and reason == "length":
            self.on_finished(finished)
