import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.analysis.trend import (
    mad,
    mann_kendall,
    median,
    theil_sen,
    theil_sen_line,
)


def brute_force_s(values):
    return sum((values[j] > values[i]) - (values[j] < values[i])
               for i in range(len(values)) for j in range(i + 1, len(values)))


def test_median_and_mad():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert mad([1, 2, 3, 4, 100]) == 1
    with pytest.raises(ValueError):
        median([])


def test_mann_kendall_strictly_increasing_matches_textbook_values():
    mk = mann_kendall([1, 2, 3, 4, 5])
    assert mk.s == 10
    assert mk.variance == pytest.approx(5 * 4 * 15 / 18)
    assert mk.z == pytest.approx(9 / math.sqrt(5 * 4 * 15 / 18))  # 2.2045
    assert mk.p_increasing == pytest.approx(0.01374, abs=1e-4)


def test_mann_kendall_tie_correction():
    mk = mann_kendall([1, 1, 2, 2])
    assert mk.s == 4
    # two tie groups of size 2: 2*1*9 each
    assert mk.variance == pytest.approx((4 * 3 * 13 - 36) / 18)
    assert mk.z == pytest.approx(3 / math.sqrt(mk.variance))


def test_mann_kendall_decreasing_and_constant():
    down = mann_kendall([5, 4, 3, 2, 1])
    assert down.s == -10 and down.z < 0 and down.p_increasing > 0.98
    flat = mann_kendall([7, 7, 7, 7])
    assert flat.s == 0 and flat.z == 0.0 and flat.p_increasing == 0.5
    assert mann_kendall([1]).s == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=5), min_size=0, max_size=40))
def test_mann_kendall_s_equals_pairwise_definition(values):
    assert mann_kendall(values).s == brute_force_s(values)


def test_theil_sen_ignores_outliers():
    times = list(range(10))
    values = [2 * t + 1 for t in times]
    values[4] = 100
    values[7] = -50
    assert theil_sen(times, values) == pytest.approx(2.0)
    slope, intercept = theil_sen_line(times, values)
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)


def test_theil_sen_uses_times_not_indices():
    # uneven spacing: slope is per unit time
    assert theil_sen([0, 10, 30, 60], [0, 5, 15, 30]) == pytest.approx(0.5)


def test_theil_sen_undefined_cases():
    assert theil_sen([], []) is None
    assert theil_sen([5, 5, 5], [1, 2, 3]) is None  # all at one time
    assert theil_sen_line([1], [1]) is None
    with pytest.raises(ValueError):
        theil_sen([1, 2], [1])


def test_theil_sen_on_noisy_line_with_large_timestamps():
    rng = random.Random(3)
    t0 = 1_700_000_000.0
    times = [t0 + 60 * i for i in range(40)]
    values = [7e10 + 1000.0 * (t - t0) + rng.gauss(0, 2e4) for t in times]
    assert theil_sen(times, values) == pytest.approx(1000.0, rel=0.05)



def test_sen_interval_holds_the_slope_and_narrows_with_more_points():
    from exporter.analysis.trend import theil_sen, theil_sen_interval
    times = [float(t) for t in range(40)]
    line = [3.0 * t + 7 for t in times]
    assert theil_sen_interval(times, line) == (3.0, 3.0)
    noise = random.Random(1)
    wobble = [v + noise.gauss(0, 6) for v in line]
    lo, hi = theil_sen_interval(times, wobble)
    assert lo <= theil_sen(times, wobble) <= hi and lo < hi and lo > 2 and hi < 4
    lo10, hi10 = theil_sen_interval(times[:10], wobble[:10])
    assert hi10 - lo10 > hi - lo
    assert theil_sen_interval(times[:3], line[:3]) is None  # too few points for a 95 % interval
