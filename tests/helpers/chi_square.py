"""Chi-square tests for the samplers' distributions, without scipy: the p-value is the
regularized upper incomplete gamma function Q(df / 2, x / 2), which torch provides."""

from __future__ import annotations

from collections import Counter

import torch


def _p_value(statistic: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(observed: Counter, expected_probs: dict, min_expected: float = 5.0) -> float:
    """p-value that ``observed`` counts come from ``expected_probs`` (cells with an expected
    count below ``min_expected`` are pooled into one, as the test's approximation needs)."""
    n = sum(observed.values())
    unexpected = [cell for cell in observed if expected_probs.get(cell, 0.0) == 0.0]
    if unexpected:
        return 0.0  # an impossible outcome happened
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    statistic = 0.0
    for cell, prob in expected_probs.items():
        expected = n * prob
        if expected < min_expected:
            pooled_obs += observed.get(cell, 0)
            pooled_exp += expected
            continue
        cells.append(cell)
        statistic += (observed.get(cell, 0) - expected) ** 2 / expected
    num_cells = len(cells)
    if pooled_exp > 0:
        statistic += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        num_cells += 1
    return _p_value(statistic, num_cells - 1)


def homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value that two samples of counts come from one distribution (two-sample chi-square);
    cells rare in both are pooled."""
    n_a, n_b = sum(a.values()), sum(b.values())
    total = n_a + n_b
    statistic, num_cells = 0.0, 0
    pool = [0, 0]
    for cell in set(a) | set(b):
        row = a.get(cell, 0) + b.get(cell, 0)
        if row * min(n_a, n_b) / total < min_expected:
            pool[0] += a.get(cell, 0)
            pool[1] += b.get(cell, 0)
            continue
        for count, n in ((a.get(cell, 0), n_a), (b.get(cell, 0), n_b)):
            expected = row * n / total
            statistic += (count - expected) ** 2 / expected
        num_cells += 1
    if sum(pool) > 0:
        for count, n in ((pool[0], n_a), (pool[1], n_b)):
            expected = sum(pool) * n / total
            statistic += (count - expected) ** 2 / expected
        num_cells += 1
    return _p_value(statistic, max(num_cells - 1, 1))
