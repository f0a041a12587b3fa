"""The leak detector at every phase of History's minute buckets.

History cuts each series into minutes at an offset drawn from the series' key, so each GPU's
process series groups the same 5 s samples into minutes at its own phase. bench/leak_quality.py
replayed every trace under one GPU UUID (`GPU-bench`: the first sample of each minute 15 s after
the trace's start); it now replays the leak-free families under four (+15, +30, +50, +0 s) and
finds false alerts at two of the others that the bench's own phase never showed, on 66fad3c
and before it:

  * warmup#4 under `GPU-test` (+30 s), minute 54.5: the warm-up's last step, 8 MiB in 7 MiB
    sample noise, falls in the middle of a bucket, whose median lands between the two levels; the
    noise after it leans upward. The medians read as a 9-minute line at z 5.36 against the bar
    5.23, and the best single step (its straddling point left out) fits 4.7 noise variances worse
    than the line, past min_step_margin (4). The noise is not underestimated: a floor from the
    raw samples' own noise (2.5 MiB for the medians, where 2 MiB was read) lowers the block
    estimates' inflation as much, and z stays 5.36. (The bar has since become 5.35, the samples'
    test taking half the budget.) Fixed by the other phase's reading, below.
  * mixed#2 under `GPU-test`, minute 26.5: a young series (no tooth seen yet) read through its
    medians, a warm-up's steps under a sawtooth of small teeth: a 17-minute line at z 9.82 against
    the young bar 7.84. Fixed in round 11: the 5 s samples show the teeth (1.1 minutes), which
    put a trough in most buckets, so no drop showed between bucket minima; such a series is now
    read through minima over blocks that hold a trough of every tooth (leak._teeth_block), not
    the medians that ride them.
  * mixed#14 under `GPU-test`, minute 160.5: a sawtooth read through its troughs (one minimum a
    tooth); a warm-up step of 11 MiB, then troughs that rise 2-6 MiB each; the troughs before the
    step tie exactly, so their noise reads under the 2 MiB floor and a 50-minute hinge passes at
    z 10. Fixed in round 15: the newest trough was read a minute after its tooth's drop, over a
    few samples of its floor, and stood above the floor (a minimum over fewer samples stands
    higher); the newest tooth's trough is now read once the cache has grown off its floor
    (sawtooth#2004 and probed_mixed#2014 in test_leak_untuned.py, the same).
  * mixed#15 under `GPU-c` (+0 s), minute 20.0: as mixed#2, young, read through per-minute
    minima (the quietest block is one bucket): a 16-minute line of 519 MiB at z 12 (young bar
    7.8) over a warm-up's steps of 267, 133, 189 and 128 MiB under teeth of 1.6 min. Fixed:
    growth begun while young is also held to a warm-up's two or three shrinking steps judged
    against the noise blind to steps, as the troughs were (the teeth, aliased by the buckets,
    inflate the noise read from second differences to 38 MiB, enough for the steps to hide).

  * warmup#4 above, and mixed#21 and mixed#3011 (seeds never tuned on) at +50 s and +0 s, which
    f5ea522 raised: growth that the medians or the block floor read as a line at one phase only.
    Fixed: such a finding must pass, through the same view at 0.6 of the bar, where the newest
    hour's samples are cut into buckets half a minute later (leak._other_phase). At 0.45 of the
    bar, mixed#21 at +0 s still passed there (minute 28).

What must hold as well: a leak is still found at the phases that fooled the detector.
"""
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

from exporter.analysis.history import SeriesView
from exporter.analysis.leak import _other_phase, _troughs, verdict
from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, GiB, MiB, make_trace

# GPU UUIDs whose series History cuts into minutes at +15, +30, +50 and +0 s.
PHASES = ("GPU-bench", "GPU-test", "GPU-b", "GPU-c")

# (family, seed, GPU UUID, the minute 66fad3c raised its false alert, what fooled it)
FIXED = [("mixed", 15, "GPU-c", 20.0, "a young series' warm-up steps under 1.6-minute teeth read as a 16-minute "
                                      "line through per-minute minima at z 12 (young bar 7.8)"),
         ("mixed", 2, "GPU-test", 26.5, "a young series' warm-up steps under 1.1-minute teeth read as a 17-minute "
                                        "line through the medians at z 9.8 (young bar 7.8)")]
# (family, seed, GPU UUID, the minute f5ea522 raised its false alert there, what it read) Each is
# cleared by cutting the newest hour's samples into buckets half a minute later (leak._other_phase).
ONE_PHASE = [("warmup", 4, "GPU-test", 54.5, "an 8 MiB warm-up step straddling a bucket: a 9-minute line at "
                                             "z 5.36 (bar 5.35), the step model 4.7 noise variances worse"),
             ("mixed", 21, "GPU-b", 22.8, "a young series' warm-up under small teeth: an 11-minute line of "
                                          "189 MiB through the medians at z 9.3 (young bar 8.0)"),
             ("mixed", 21, "GPU-c", 22.0, "the same: a 10-minute line of 165 MiB at z 8.7"),
             ("mixed", 3011, "GPU-b", 102.8, "an 8-minute hinge of 76 MiB through the block floor at z 6.1 (bar 5.35)"),
             ("mixed", 3011, "GPU-c", 41.0, "a 32-minute line of 332 MiB through the block floor at z 10 "
                                            "(young bar 8.0)")]
FIXED_IDS = [f"{f}#{s}-{u}" for f, s, u, _, _ in FIXED]


@pytest.mark.parametrize("family,seed,uuid,minute,why", FIXED, ids=FIXED_IDS)
def test_a_young_warm_up_under_fast_teeth_raises_nothing_at_any_phase(family, seed, uuid, minute, why):
    trace = make_trace(family, seed)
    assert trace.leak_rate is None
    for gpu in (uuid, "GPU-bench", "GPU-test", "GPU-b"):
        assert episodes(trace.times, trace.values, gpu) == [], (gpu, f"66fad3c under {uuid}: minute {minute}")


@pytest.mark.parametrize("family,seed,uuid,minute,why", ONE_PHASE,
                         ids=[f"{f}#{s}-{u}" for f, s, u, _, _ in ONE_PHASE])
def test_growth_read_at_one_bucket_phase_only_raises_nothing_at_any_phase(family, seed, uuid, minute, why):
    trace = make_trace(family, seed)
    assert trace.leak_rate is None
    for gpu in PHASES:
        assert episodes(trace.times, trace.values, gpu) == [], (gpu, f"f5ea522 under {uuid}: minute {minute}")


def test_the_other_phase_cuts_the_raw_samples_from_one_buckets_mean_time_to_the_next():
    # Buckets of a minute, their samples every 5 s (each sample's value is its time); the raw
    # samples kept from t=60 on.
    series = SeriesView((27.5, 87.5, 147.5), (100.0, 200.0, 300.0), (90.0, 190.0, 290.0))
    raw = SeriesView(tuple(float(t) for t in range(60, 180, 5)), tuple(float(t) for t in range(60, 180, 5)))
    other = _other_phase(series, raw)
    assert other is not None
    # The bucket older than the raw samples kept as it was; the samples before the next bucket's
    # mean time (60-85) left out; then [87.5, 147.5) and [147.5, the newest sample].
    assert other.times == (27.5, 117.5, 162.5)
    assert other.values == (100.0, 117.5, 162.5)
    assert other.lows == (90.0, 90.0, 150.0)
    # Raw samples that stop before the newest bucket cannot cut it again: no other phase to read.
    assert _other_phase(series, SeriesView((60.0, 65.0, 70.0), (1.0, 2.0, 3.0))) is None
    assert _other_phase(series, SeriesView((), ())) is None


def test_a_leak_is_not_held_back_where_the_raw_samples_cannot_give_another_phase():
    # A 20 MiB/min leak from minute 90 in 4 MiB of noise, read at minute 140 through buckets
    # of a minute: found with the newest hour's samples (both phases show it), and found where
    # the only raw samples kept are older than every bucket (no other phase to read).
    rng = random.Random(3)
    samples = [(T0 + 5.0 * k, 40 * GiB + max(0.0, 5.0 * k - 5400) / 60 * 20 * MiB + rng.gauss(0, 4 * MiB))
               for k in range(140 * 12)]
    minutes = [samples[12 * m:12 * m + 12] for m in range(140)]
    series = SeriesView(tuple(sum(t for t, _ in b) / 12 for b in minutes),
                        tuple(statistics.median(v for _, v in b) for b in minutes),
                        tuple(min(v for _, v in b) for b in minutes))
    newest_hour = SeriesView(tuple(t for t, _ in samples[-720:]), tuple(v for _, v in samples[-720:]))
    oldest = SeriesView(tuple(t for t, _ in samples[:100]), tuple(v for _, v in samples[:100]))
    for raw in (newest_hour, oldest):
        assert verdict(series, 80 * GiB, raw=lambda since=None, raw=raw: raw).suspected, len(raw)


def test_a_newest_trough_read_on_its_floor_raises_nothing_at_any_phase():
    # mixed#14: 66fad3c raised a 50-minute hinge of troughs under GPU-test at minute 160.5, its
    # newest trough read over the first samples of the tooth's floor.
    trace = make_trace("mixed", 14)
    assert trace.leak_rate is None
    for gpu in PHASES:
        assert episodes(trace.times, trace.values, gpu) == [], gpu


def test_the_newest_tooths_trough_is_read_once_the_cache_has_grown_off_its_floor():
    # Teeth of six buckets (360 s): each bucket's minimum 20 MiB above the one before, the floor
    # 1000 MiB; drops at minutes 0, 6 and 12.
    times = [60.0 * m for m in range(13)]
    lows = [1000.0 + 20 * (m % 6) for m in range(12)] + [1008.0]  # minute 12: the drop's bucket
    drops = [0.0, 360.0, 720.0]

    def troughs(newest):
        return _troughs([*times, *(780.0 + 60 * k for k in range(len(newest)))], [*lows, *newest], 0, drops,
                        floor_left=4.0, tooth=360.0)

    # The newest tooth's floor read over part of one bucket, 8 MiB above the others: left out.
    assert troughs([]) == ([0.0, 360.0], [1000.0, 1000.0])
    # A bucket later the cache has grown 20 MiB off it: the trough is read, at the floor's minimum.
    assert troughs([1023.0]) == ([0.0, 360.0, 720.0], [1000.0, 1000.0, 1008.0])
    # Still on its floor (within 4 MiB of its minimum) a bucket later: still left out ...
    assert troughs([1005.0])[1] == [1000.0, 1000.0]
    # ... but not once the tooth is older than a tooth's period (its drops missed): then it is no
    # floor still being sampled.
    assert troughs([1005.0] * 6)[1] == [1000.0, 1000.0, 1005.0]

    # Where the drops are buckets that missed a trough of faster teeth, a bucket's minimum off
    # the floor says nothing: the newest trough is read once the tooth is a period old.
    def aliased(newest):
        return _troughs([*times, *(780.0 + 60 * k for k in range(len(newest)))], [*lows, *newest], 0, drops,
                        floor_left=4.0, tooth=360.0, aliased=True)[1]

    assert aliased([1023.0]) == [1000.0, 1000.0]
    assert aliased([1023.0] * 6) == [1000.0, 1000.0, 1008.0]


def test_a_small_trough_step_after_a_large_one_raises_nothing_at_another_phase():
    # mixed#311 under GPU-test (+30 s): 7c9fdc6 raised at minute 157.5 (round 15 found it, at minute 158.5),
    # and every round until 21: through the troughs, a 57-minute hinge of five at z 8.0 (bar 5.35), the newest
    # a 20 MiB step above the two after a 2.3 GiB step. The teeth's 60 MiB falls read as 40-60 MiB between
    # bucket minima at this phase, under the drop size the minima's noise set (44 MiB), so the troughs
    # missed teeth. Round 21: the samples show teeth of 8 minutes, and their own noise tells the falls.
    # Its bench phase is test_leak_round5's.
    trace = make_trace("mixed", 311)
    assert episodes(trace.times, trace.values, "GPU-test") == []


@pytest.mark.parametrize("family,seed,within", [("slow_leak", 1, 30), ("fast_leak", 4, 6), ("late_leak", 5, 15)])
def test_a_leak_is_found_at_the_phases_that_fooled_the_detector(family, seed, within):
    trace = make_trace(family, seed)
    onset = (trace.leak_start - T0) / 60
    for gpu in ("GPU-test", "GPU-c"):
        found = episodes(trace.times, trace.values, gpu)
        assert found, f"{trace.name}: not found at {gpu}'s phase"
        assert onset <= found[0] <= onset + within, (trace.name, gpu, onset, found)


# A young series' first sawtooth tooth, after the flat minutes that follow settling: 66fad3c and
# 1a0cac6 raised each 70-90 minutes before its leak began, at minute 19.5-20 (young bar 7.8): a
# free line over 4 flat minutes and a 12-minute ramp of 0.95-1.35 GiB passed at z 26-33 as soon as
# the two together were a first tooth long (15 min). The rise is now timed from its onset.
FIRST_TOOTH = [("leak_under_sawtooth", 1, "GPU-test", 19.5), ("leak_under_sawtooth", 3, "GPU-b", 19.8),
               ("leak_under_sawtooth", 3, "GPU-c", 20.0)]


@pytest.mark.parametrize("family,seed,uuid,minute", FIRST_TOOTH,
                         ids=[f"{f}#{s}-{u}" for f, s, u, _ in FIRST_TOOTH])
def test_a_young_series_first_tooth_after_flat_minutes_is_no_leak(family, seed, uuid, minute):
    trace = make_trace(family, seed)
    onset = (trace.leak_start - T0) / 60
    found = episodes(trace.times, trace.values, uuid)
    assert found, f"{trace.name}: its leak was not found at {uuid}'s phase"
    assert onset <= found[0] <= onset + 60, (trace.name, uuid, onset, found, f"1a0cac6: minute {minute}")


def _first_teeth(tooth_minutes: float, flat_minutes: float = 4, seed: int = 0,
                 minutes: int = 60) -> tuple[list[float], list[int]]:
    """A start-up (a large step at 1 min), `flat_minutes` flat after the settling period, then
    sawtooth teeth of `tooth_minutes` and 1.4 GiB (in 20 MiB segments) in 3 MiB noise, whole 2 MiB
    pages, every 5 s."""
    rng = random.Random(seed)
    times, values = [], []
    traffic, amp = (3 + flat_minutes) * 60.0, 1.4 * GiB
    for k in range(minutes * 12):
        t = 5.0 * k
        v = 512 * MiB if t < 60 else 60 * GiB
        if t >= traffic:
            into = (t - traffic) % (tooth_minutes * 60)
            v += math.floor(amp * into / (tooth_minutes * 60) / (20 * MiB)) * 20 * MiB
        v += round(rng.gauss(0, 3 * MiB) / (2 * MiB)) * 2 * MiB
        times.append(T0 + t)
        values.append(int(v))
    return times, values


@pytest.mark.parametrize("tooth", [13, 14])
def test_first_teeth_shorter_than_the_longest_tooth_raise_nothing_at_any_phase(tooth):
    # 1a0cac6 raised these at every phase, at minute 19-20: 4 flat minutes and the first tooth's
    # 12-13 ramp minutes read as one 15-minute line.
    times, values = _first_teeth(tooth)
    for gpu in PHASES:
        assert episodes(times, values, gpu) == [], gpu


def test_a_second_tooth_just_after_the_young_period_raises_nothing():
    # 7 flat minutes, 13-minute teeth: at +50 s and +0 s a false alert at minute 35.8-36 (the
    # young period ends at minute 33): the second tooth climbs back to the first one's peak, which
    # the earlier levels (block means a quarter of the window long) average down with its ramp,
    # an 11-minute line at z 55. (The levels before falls in the half hour before the window,
    # taken as earlier levels, cleared it, but cost leak_under_sawtooth_slow#2 30 min at +30 s.)
    # Since round 20 the raw samples read for the medians' noise while their blocks are few
    # (leak_samples.medians_wander) show the teeth as noise that wanders by hundreds of MiB.
    times, values = _first_teeth(13, flat_minutes=7, minutes=75)
    for gpu in PHASES:
        assert episodes(times, values, gpu) == [], gpu
