"""What every routing strategy is: a node that ranks the targets for one request.

A route is a tree of nodes (Portkey's nested strategies): leaves are targets, inner nodes
are strategies over their children. ``rank`` returns the healthy targets in the order they
should be tried: the dispatcher sends the request to the first, and to the next ones only on
the failures its route retries (before anything was streamed). Unhealthy targets are never
ranked; an empty ranking means nothing can serve the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


@dataclass(slots=True)
class Ranking:
    targets: list[TargetState]
    reason: str
    """Why the first target came first (a metrics label): sla_cheapest, lowest_estimate, weighted ..."""
    explore: bool = False
    """The first target was chosen to learn its latency, not on its estimate."""
    estimate_ms: float | None = None
    """The first target's estimated response time, when the strategy computed it."""


class Node(Protocol):
    def rank(self, request: RouteRequest) -> Ranking: ...

    def leaves(self) -> Iterator[TargetState]: ...


class TargetNode:
    """A leaf: one target, ranked when it is healthy."""

    __slots__ = ("target",)

    def __init__(self, target: TargetState) -> None:
        self.target = target

    def rank(self, request: RouteRequest) -> Ranking:
        return Ranking([self.target] if self.target.healthy else [], "target")

    def leaves(self) -> Iterator[TargetState]:
        yield self.target


def concat(rankings: Iterable[list[TargetState]]) -> list[TargetState]:
    """The rankings one after the other, each target kept at its first place."""
    return list(dict.fromkeys(target for ranking in rankings for target in ranking))


def child_ranking(child: Node, request: RouteRequest) -> Ranking | None:
    """``child.rank(request)``, None when it ranks nothing; a leaf is answered without a call (a
    strategy over 64 targets asks 64 leaves per request)."""
    if type(child) is TargetNode:
        target = child.target
        return Ranking([target], "target") if target.healthy else None
    ranking = child.rank(request)
    return ranking if ranking.targets else None


def leaves_of(children: Iterable[Node]) -> Iterator[TargetState]:
    for child in children:
        yield from child.leaves()
