"""Teeth the minute buckets cannot show, read from the 5 s samples (leak._sample_teeth).

A sawtooth of about a minute's teeth puts a trough in most minute buckets, so the bucket minima
show no drop between them, and its teeth alias into the medians as noise: a young warm-up's steps
under such teeth read through the medians as a line (mixed#2 under GPU-test at +30 s, mixed#3003
under GPU-b at +50 s, false alerts at minutes 26.5 and 58.8; tests/test_leak_phase.py and
tests/test_leak_untuned.py replay them). The samples show the teeth plainly:
falls of a drop's size, each far larger than every rise in the minute before it."""
import math
import random
import sys
from pathlib import Path

import pytest

from exporter.analysis.history import SeriesView, bucket_point
from exporter.analysis.leak import DEFAULT_CONFIG, _sample_teeth, _teeth_block, verdict
from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import make_trace

MiB = 1 << 20
PAGE = 2 * MiB  # NVML reports whole pages
T0 = 1_700_000_000


def samples(shape, minutes=30, noise=4 * MiB, seed=0, spikes=0.0, sign=1) -> SeriesView:
    """Every 5 s for `minutes`: 60 GiB plus shape(t), white noise, one-sample transients of 64 MiB-1 GiB
    (up, or down with sign -1) with probability `spikes`, whole 2 MiB pages."""
    rng = random.Random(seed)
    times, values = [], []
    for k in range(minutes * 12):
        t = 5.0 * k
        v = 60 * 1024 * MiB + shape(t) + rng.gauss(0, noise)
        if rng.random() < spikes:
            v += sign * rng.uniform(64 * MiB, 1024 * MiB)
        times.append(T0 + t)
        values.append(float(int(v // PAGE) * PAGE))
    return SeriesView(tuple(times), tuple(values))


def teeth(period, height=300 * MiB):
    """A cache growing in 20 MiB segments over `period` seconds, then freed."""
    return lambda t: math.floor(height * (t % period) / period / (20 * MiB)) * 20 * MiB


@pytest.mark.parametrize("period", [66, 150, 400])
def test_a_sawtooth_in_the_samples_is_seen_with_its_period(period):
    found = _sample_teeth(samples(teeth(period)), DEFAULT_CONFIG)
    assert found.period == pytest.approx(period, abs=5)
    # The least fall counted: a drop's size (16 MiB) or four deviations of the samples' differences
    # (4 MiB of noise, 2 MiB pages and the cache's 20 MiB segments), far under a tooth's 300 MiB.
    assert 16 * MiB <= found.fall <= 64 * MiB


@pytest.mark.parametrize("name, view", [
    ("white noise", samples(lambda t: 0.0, noise=24 * MiB)),
    ("noise with one-sample spikes", samples(lambda t: 0.0, minutes=60, noise=16 * MiB, spikes=0.01)),
    ("noise with one-sample dips", samples(lambda t: 0.0, minutes=60, noise=16 * MiB, spikes=0.01, sign=-1)),
    ("a warm-up's steps", samples(lambda t: sum(s for a, s in ((60, 300 * MiB), (300, 150 * MiB), (900, 80 * MiB))
                                                   if t >= a))),
    ("a leak", samples(lambda t: 4 * MiB * t / 60)),
    ("teeth too long for the buckets to miss", samples(teeth(1200), minutes=90)),
])
def test_no_sawtooth_where_the_samples_show_none(name, view):
    assert _sample_teeth(view, DEFAULT_CONFIG) is None, name


@pytest.mark.parametrize("period, block", [(66, 2), (150, 4), (280, 6), (300, 0), (600, 0)])
def test_the_block_holds_a_trough_of_every_tooth_and_longer_teeth_are_left_to_the_troughs(period, block):
    """Teeth vary by a fifth either way: a block of 1.25 teeth, in whole minutes, holds a trough
    of each. Teeth longer than the longest block allows show as drops between bucket minima."""
    view = samples(teeth(period), minutes=60)
    assert _teeth_block(_sample_teeth(view, DEFAULT_CONFIG)) == block
    assert _teeth_block(None) == 0  # no raw samples kept: the medians


def minutes(view: SeriesView) -> SeriesView:
    """The samples cut into minute buckets, as History cuts them: mean time, median, least."""
    points = [bucket_point(sum(view.times[k:k + 12]), view.values[k:k + 12]) for k in range(0, len(view.times), 12)]
    return SeriesView(*(tuple(column) for column in zip(*points, strict=True)))


def test_teeth_of_a_few_minutes_are_read_through_their_troughs():
    """Teeth of 4 minutes and 300 MiB, a leak of 4 MiB/min from minute 60: the bucket minima ride
    the teeth's ramps, and their second differences read as noise of 90 MiB, out of which a tooth's
    fall of 225 MiB between minima does not stand four deviations. The samples show each fall
    plainly: with them, the drops are told by the samples' own noise, and the series is read
    through its troughs, one a tooth (mixed#9011, #11003: a young warm-up's steps under such teeth
    passed for a line through the minima)."""
    leak = samples(lambda t: teeth(240)(t) + 4 * MiB * max(0.0, t - 3600) / 60, minutes=150)
    series = minutes(leak)
    read = verdict(series, None, raw=lambda since=None: leak)
    assert read.suspected
    assert dict(read.evidence)["signal"] == "troughs"
    assert dict(read.evidence)["sawtooth_period_seconds"] == pytest.approx(240, abs=10)
    blind = verdict(series, None)  # no samples kept: no drop stands out of the minima's noise
    assert dict(blind.evidence).get("signal") != "troughs"
    assert "sawtooth_period_seconds" not in dict(blind.evidence)


def test_teeth_under_three_minutes_stay_read_through_blocks_of_minima():
    """Teeth of 2.3 minutes (100 MiB) over a leak of 1 MiB/min: read through their troughs, each
    a minimum over two or three buckets, which scatter more than blocks of minima do, the leak was
    found 62 minutes after it began (teeth told by the samples from 120 s); through the blocks, 40."""
    trace = make_trace("probed_slow_leak", 3)
    onset = (trace.leak_start - T0) / 60
    found = episodes(trace.times, trace.values)  # NVML's figure alone
    assert found and onset <= found[0] <= onset + 45, (onset, found)
