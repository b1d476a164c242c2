"""A service's /metrics samples (Prometheus text), and how far counters moved over a run."""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Mapping

from services.common.metrics import parse_samples


def scrape(url: str | None, names: tuple[str, ...] = ()) -> dict[str, float]:
    """The samples at a /metrics URL ({} when there is none); only the named metrics when
    ``names`` is given (the exposition's name[] filter), so sampling during a run costs the
    service little."""
    if url is None:
        return {}
    if names:
        url += "?" + urllib.parse.urlencode([("name[]", name) for name in names])
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_samples(reply.read().decode())


def moved(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    """How far sample ``name`` moved between two scrapes (0 where it is absent)."""
    return after.get(name, 0.0) - before.get(name, 0.0)
