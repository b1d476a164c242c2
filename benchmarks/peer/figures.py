"""The arithmetic of the llama.cpp comparison: runs, medians, ratios, greedy agreement.

Pure Python (no torch, no llama.cpp), so the tests check it without building either.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.timed_run import Run  # noqa: F401 - the peer run's unit, shared with benchmarks/moe.py


def median_rate(runs: Sequence[Run]) -> float:
    if not runs:
        raise ValueError("median_rate needs at least one run")
    return statistics.median(r.tokens_per_s for r in runs)


@dataclass(frozen=True, slots=True)
class RatioSpec:
    """numerator / denominator, each a (system, streams) cell of the table, against a target."""

    name: str
    numerator: tuple[str, int]
    denominator: tuple[str, int]
    target: float | None = None


@dataclass(frozen=True, slots=True)
class Ratio:
    name: str
    value: float | None
    """None when either cell was not measured."""
    target: float | None

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        return self.value >= self.target


def ratios(rates: dict[tuple[str, int], float], specs: Sequence[RatioSpec]) -> list[Ratio]:
    """Each spec's ratio from ``rates`` ((system, streams) → median tokens/s)."""
    out = []
    for spec in specs:
        num, den = rates.get(spec.numerator), rates.get(spec.denominator)
        value = num / den if num is not None and den else None
        out.append(Ratio(spec.name, value, spec.target))
    return out


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` differs from ``reference`` (a shorter sequence
    differs where it ends); None when they are identical."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    if len(reference) != len(other):
        return min(len(reference), len(other))
    return None


def format_rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def format_ratio(ratio: Ratio) -> str:
    if ratio.value is None:
        return f"{ratio.name:<58} –"
    text = f"{ratio.name:<58} {ratio.value:7.2f}x"
    if ratio.target is not None:
        text += f"   target ≥ {ratio.target:g}: {'met' if ratio.met else 'NOT met'}"
    return text
