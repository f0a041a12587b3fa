"""The leak detector reads a leak's first minutes from its 5 s samples (#22, round 5): with three
growing minute buckets, the first part-grown, one step straddling the middle bucket fits them
as well as a line, and only the samples inside tell a climb from one jump."""
import random

import pytest

from exporter.analysis.history import SeriesView
from exporter.analysis.leak import LeakConfig, _climbs, _jumps

MiB = 1024 * 1024
T0 = 1_700_000_000


def _samples(shape, sigma=3 * MiB, seconds=300, seed=1):
    """5 s samples of `shape(t)` plus white noise, rounded to 2 MiB pages, from a 10 GiB level."""
    rng = random.Random(seed)
    times = [T0 + 5.0 * k for k in range(seconds // 5)]
    values = [(10240 * MiB + shape(t - T0) + rng.gauss(0, sigma)) // (2 * MiB) * (2 * MiB) for t in times]
    return SeriesView(tuple(times), tuple(values))


@pytest.mark.parametrize("seed", range(5))
def test_samples_that_climb_are_a_climb_and_samples_that_jump_are_not(seed):
    config = LeakConfig()
    climb = _samples(lambda s: max(0.0, s - 120) / 60 * 16 * MiB, seed=seed)  # 16 MiB/min from 2 min
    jump = _samples(lambda s: 40 * MiB if s >= 200 else 0.0, seed=seed)  # 40 MiB at 3 min 20 s
    assert _climbs(climb, T0, T0 + 120, config) and not _jumps(climb, T0, T0 + 120, config)
    assert _jumps(jump, T0, T0 + 180, config) and not _climbs(jump, T0, T0 + 180, config)


@pytest.mark.parametrize("seed", range(5))
def test_a_slow_climb_the_samples_cannot_tell_from_a_jump_is_neither(seed):
    # 1 MiB/min for 5 minutes in 3 MiB of noise: a step placed by chance fits about as well.
    config = LeakConfig()
    slow = _samples(lambda s: s / 60 * MiB, seed=seed)
    assert not _jumps(slow, T0, T0, config) and not _climbs(slow, T0, T0, config)


@pytest.mark.parametrize("seed", range(5))
def test_a_one_sample_spike_at_the_end_of_a_climb_is_no_jump(seed):
    # noisy_leak: a step whose right-hand part is the last two samples takes in a 5 s spike of
    # hundreds of MiB, and would pass for a jump by thousands of noise variances.
    config = LeakConfig()
    climb = _samples(lambda s: max(0.0, s - 120) / 60 * 16 * MiB + (600 * MiB if s == 290 else 0.0), seed=seed)
    assert not _jumps(climb, T0, T0 + 120, config)
