"""Routing policies of other systems, reimplemented from their published behaviour, as gateway
route nodes (services/gateway/routing/node.py) so every policy runs through the same dispatcher.

- ``RoundRobin``: each request to the next healthy target.
- ``PortkeyLeastLatency``: Portkey's ``least_latency`` mode: epsilon-greedy over the mean observed
  latency of each target (epsilon = 0.1; a target without samples is tried first).
- ``LiteLLMLatency``: LiteLLM's ``latency-based-routing``: the lowest mean latency per completion
  token over each deployment's last 10 requests (no samples = 0, tried first).
- ``SGLangCacheAware``: SGLang's cache-aware router: an approximate per-worker tree of the prefixes
  it was sent (here the set of whole-block prefix hashes, LRU-bounded); when the load is balanced
  (max - min in-flight <= 32 or max <= 1.0001 x min) the worker with the longest match if it covers
  more than half the prompt, else the worker caching least; when imbalanced, the least loaded.

Outcomes come from the dispatcher's observers (``observe``), as each system learns from its calls.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from collections.abc import Iterator

from services.gateway.dispatch import Outcome
from services.gateway.routing.node import Ranking
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class _Base:
    def __init__(self, targets: list[TargetState]) -> None:
        self.targets = targets

    def leaves(self) -> Iterator[TargetState]:
        return iter(self.targets)

    def observe(self, outcome: Outcome) -> None:
        pass

    def _healthy(self) -> list[TargetState]:
        return [t for t in self.targets if t.healthy]


class RoundRobin(_Base):
    def __init__(self, targets: list[TargetState]) -> None:
        super().__init__(targets)
        self._next = 0

    def rank(self, request: RouteRequest) -> Ranking:
        healthy = self._healthy()
        if not healthy:
            return Ranking([], "no_healthy_target")
        start = self._next % len(healthy)
        self._next += 1
        return Ranking(healthy[start:] + healthy[:start], "round_robin")


class PortkeyLeastLatency(_Base):
    WINDOW = 50

    def __init__(self, targets: list[TargetState], epsilon: float = 0.1, seed: int = 0) -> None:
        super().__init__(targets)
        self.epsilon = epsilon
        self.rng = random.Random(seed)
        self.samples: dict[str, deque[float]] = {t.name: deque(maxlen=self.WINDOW) for t in targets}

    def observe(self, outcome: Outcome) -> None:
        self.samples[outcome.target].append(outcome.observed_ms)

    def _mean(self, t: TargetState) -> float:
        s = self.samples[t.name]
        return sum(s) / len(s) if s else 0.0

    def rank(self, request: RouteRequest) -> Ranking:
        healthy = self._healthy()
        if not healthy:
            return Ranking([], "no_healthy_target")
        if self.rng.random() < self.epsilon:
            self.rng.shuffle(healthy)
            return Ranking(healthy, "epsilon")
        return Ranking(sorted(healthy, key=self._mean), "least_latency")


class LiteLLMLatency(_Base):
    WINDOW = 10

    def __init__(self, targets: list[TargetState]) -> None:
        super().__init__(targets)
        self.samples: dict[str, deque[float]] = {t.name: deque(maxlen=self.WINDOW) for t in targets}

    def observe(self, outcome: Outcome) -> None:
        self.samples[outcome.target].append(outcome.observed_ms / max(outcome.completion_tokens, 1))

    def rank(self, request: RouteRequest) -> Ranking:
        healthy = self._healthy()
        if not healthy:
            return Ranking([], "no_healthy_target")

        def per_token(t: TargetState) -> float:
            s = self.samples[t.name]
            return sum(s) / len(s) if s else 0.0

        return Ranking(sorted(healthy, key=per_token), "latency_per_token")


class SGLangCacheAware(_Base):
    BLOCK = 64
    CACHE_THRESHOLD = 0.5
    BALANCE_ABS = 32
    BALANCE_REL = 1.0001
    MAX_BLOCKS = 4096

    def __init__(self, targets: list[TargetState]) -> None:
        super().__init__(targets)
        self.trees: dict[str, OrderedDict[bytes, None]] = {t.name: OrderedDict() for t in targets}

    def _blocks(self, text: str) -> list[bytes]:
        out, h = [], hashlib.blake2b(digest_size=8)
        for start in range(0, len(text) - self.BLOCK + 1, self.BLOCK):
            h.update(text[start:start + self.BLOCK].encode())
            out.append(h.copy().digest())
        return out

    def rank(self, request: RouteRequest) -> Ranking:
        healthy = self._healthy()
        if not healthy:
            return Ranking([], "no_healthy_target")
        loads = [t.inflight for t in healthy]
        blocks = self._blocks(request.prefix)
        imbalanced = max(loads) - min(loads) > self.BALANCE_ABS and max(loads) > self.BALANCE_REL * min(loads)
        if imbalanced or not blocks:
            order = sorted(healthy, key=lambda t: t.inflight)
            reason = "least_loaded"
        else:
            def matched(t: TargetState) -> int:
                tree, n = self.trees[t.name], 0
                for block in blocks:
                    if block not in tree:
                        break
                    n += 1
                return n

            best = max(healthy, key=matched)
            if matched(best) / len(blocks) > self.CACHE_THRESHOLD:
                order, reason = [best] + [t for t in healthy if t is not best], "cache_hit"
            else:
                order = sorted(healthy, key=lambda t: len(self.trees[t.name]))
                reason = "smallest_tree"
        tree = self.trees[order[0].name]
        for block in blocks:
            tree[block] = None
            tree.move_to_end(block)
        while len(tree) > self.MAX_BLOCKS:
            tree.popitem(last=False)
        return Ranking(order, reason)
