"""Percentiles as the benchmarks print them: nearest rank, no interpolation.

`pct(xs, q)` is the sample at rank min(n - 1, int(q * n)) of the n samples sorted, for q in
[0, 1]: p50 of an even count is the upper of the two middle samples, p99 of fewer than 100 is
the largest. In the samples' own unit; nan when there are none.
"""

from __future__ import annotations


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
