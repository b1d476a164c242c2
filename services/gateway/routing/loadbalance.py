"""``loadbalance``: a weighted random child first (weights need not sum to 1), the others after.

The order of the rest is weighted random too (Efraimidis-Spirakis: each child draws
u ** (1 / weight) and the largest go first), so a failed request retries where the weights say.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from services.gateway.routing.node import Node, Ranking, child_ranking, concat, leaves_of
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class LoadBalance:
    def __init__(self, children: list[Node], weights: list[float], rng: random.Random | None = None) -> None:
        if len(children) != len(weights):
            raise ValueError(f"loadbalance has {len(children)} children and {len(weights)} weights")
        self.children = children
        self.weights = weights
        self.rng = rng or random.Random()

    def rank(self, request: RouteRequest) -> Ranking:
        keyed = []
        draw = self.rng.random
        for child, weight in zip(self.children, self.weights):
            if weight <= 0:
                continue
            ranking = child_ranking(child, request)
            if ranking is not None:
                keyed.append((draw() ** (1.0 / weight), ranking))
        if not keyed:
            return Ranking([], "no_healthy_target")
        keyed.sort(key=lambda pair: pair[0], reverse=True)
        first = keyed[0][1]
        return Ranking(concat(r.targets for _, r in keyed), "weighted", first.explore, first.estimate_ms)

    def leaves(self) -> Iterator[TargetState]:
        return leaves_of(self.children)
