"""Percentiles and medians of a run's figures.

One percentile for every figure, and the same as the scheduler's latency profile
(GetProfile): linear interpolation between the closest ranks, q in 0..100. Benchmarks
compare their client-side figures with the server's, so both sides use one definition.
An empty sample has no percentile: NaN, which prints as ``nan`` (never a latency of 0).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from services.common.percentile import percentile as _interpolated


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``; NaN when there are none."""
    return _interpolated(values, q) if values else math.nan


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def distribution_ms(values_s: Sequence[float]) -> dict:
    """mean, p50, p90, p99 and max in milliseconds of values in seconds (0 for an empty sample, as JSON)."""
    values = [v * 1000.0 for v in values_s]
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "count": len(values),
    }
