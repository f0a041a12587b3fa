"""Robust trend statistics in pure Python (numpy is not a dependency).

Mann–Kendall says *whether* a series trends (rank based, so one spike or one odd sample barely
moves it); Theil–Sen says *how fast* (median of pairwise slopes, robust to up to ~29 % outliers).
Both are O(n log n) / O(n^2) on n points, so callers keep n small (the leak detector works on
at most a few dozen downsampled points per window).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MannKendall:
    s: int  # sum of sign(x_j - x_i) over all i < j
    variance: float  # Var(S) under "no trend", corrected for ties
    z: float  # standardised S with continuity correction
    p_increasing: float  # one-sided p-value for an upward trend


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of an empty sequence")
    mid = n // 2
    if n % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2.0


MAD_SIGMA = 1.4826  # MAD -> sigma for a normal distribution


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation (unscaled); multiply by MAD_SIGMA for a normal sigma."""
    centre = median(values)
    return median([abs(v - centre) for v in values])


def mann_kendall(values: Sequence[float]) -> MannKendall:
    """Mann–Kendall trend test with the standard tie correction.

    S is computed in O(n log n) by walking the series backwards and counting, in a sorted list of
    the later values, how many are larger and smaller than each value.
    """
    n = len(values)
    if n < 2:
        return MannKendall(0, 0.0, 0.0, 0.5)
    s = 0
    later: list[float] = []
    for x in reversed(values):
        larger = len(later) - bisect.bisect_right(later, x)
        smaller = bisect.bisect_left(later, x)
        s += larger - smaller
        bisect.insort(later, x)
    # `later` now holds every value, sorted: count tie groups for the variance correction.
    ties = 0
    run = 1
    for i in range(1, n + 1):
        if i < n and later[i] == later[i - 1]:
            run += 1
            continue
        if run > 1:
            ties += run * (run - 1) * (2 * run + 5)
        run = 1
    variance = (n * (n - 1) * (2 * n + 5) - ties) / 18.0
    if variance <= 0:
        return MannKendall(s, 0.0, 0.0, 0.5)
    if s > 0:
        z = (s - 1) / math.sqrt(variance)
    elif s < 0:
        z = (s + 1) / math.sqrt(variance)
    else:
        z = 0.0
    return MannKendall(s, variance, z, 0.5 * math.erfc(z / math.sqrt(2.0)))


def theil_sen(times: Sequence[float], values: Sequence[float]) -> float | None:
    """Median of the slopes between every pair of points (pairs at the same time are skipped).

    None when fewer than two distinct times exist.
    """
    n = len(times)
    if n != len(values):
        raise ValueError("times and values differ in length")
    slopes = [
        (values[j] - values[i]) / (times[j] - times[i])
        for i in range(n - 1)
        for j in range(i + 1, n)
        if times[j] != times[i]
    ]
    if not slopes:
        return None
    return median(slopes)


def theil_sen_line(times: Sequence[float], values: Sequence[float]) -> tuple[float, float] | None:
    """(slope, intercept) with the intercept as the median of value - slope * time."""
    slope = theil_sen(times, values)
    if slope is None:
        return None
    return slope, median([v - slope * t for t, v in zip(times, values, strict=True)])



def theil_sen_interval(times: Sequence[float], values: Sequence[float],
                       z: float = 1.96) -> tuple[float, float] | None:
    """Sen's (1968) confidence interval of the Theil–Sen slope: the order statistics of the
    pairwise slopes around their median, C = z * sqrt(Var(S)) of them apart, with Var(S) the
    Mann–Kendall variance (tie-corrected). z 1.96: a two-sided 95 % interval. None with too few
    points for one."""
    n = len(times)
    if n != len(values):
        raise ValueError("times and values differ in length")
    slopes = sorted(
        (values[j] - values[i]) / (times[j] - times[i])
        for i in range(n - 1)
        for j in range(i + 1, n)
        if times[j] != times[i]
    )
    count = len(slopes)
    variance = mann_kendall(values).variance
    if count < 2 or variance <= 0:
        return None
    spread = z * math.sqrt(variance)
    lower = round((count - spread) / 2)
    upper = round((count + spread) / 2) + 1
    if lower < 1 or upper > count:
        return None  # the interval reaches past the slopes there are
    return slopes[lower - 1], slopes[upper - 1]
