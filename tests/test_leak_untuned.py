"""The leak detector on the leak-free traces of bench/leak_corpus.py that fooled it on seeds its
settings were not tuned on (#22): each raises no leak finding over its 6 h, and a leak laid over
the same trace, beginning where the false alert used to come, is still found. Replayed through
History and LeakDetector.detect tick by tick, as the daemon and the bench run it.

The shapes, and what was wrong:
  * warmup#108, mixed#114: a warm-up's steps, most taken out as level shifts and a small one
    left in; the step models ignored the cuts where the shifts were taken out, so every error of
    the shifts' sizes counted against the steps and the joined line always fitted better;
  * warmup#108 read through other minute buckets, warmup#110: a small step (12 MiB) straddling
    a bucket, two points after it, fitted as well by a ramp begun a few minutes before (within
    2 noise variances: the line must now beat the step by 4);
  * correlated#109, correlated#114: noise wandering with a memory of 3-6 minutes, on a series too
    young (or a window too long) for the block estimates of its correlations.

And those the detector of 4920ee8 (round 3) raised, on seeds 700-715, 900-915 and 1100-1115:
  * correlated#906: noise wandering with a memory of 7.5 minutes on a series 35 minutes old; a
    line begun while young passed the young bar by its slope, and the test of the slope's error
    from its own residuals (which sees the wander) against the lower bar only;
  * mixed#701, mixed#900: a warm-up's steps under a sawtooth, read through its troughs (one point
    a tooth): adjacent steps of 20-110 MiB, which inflate the troughs' noise read from second
    differences to 13-29 MiB where they scatter by a few, so no model of steps beat the line;
  * mixed#910: a young series' first tooth, its drop and the next tooth's ramp in one 15-minute
    line (the level before the drop, inside the window, was no earlier level to the test);
  * mixed#1114: a 2 GiB step 13 s into a minute bucket under a 1.5-minute sawtooth: the bucket's
    minimum, read over the 13 s before the step, missed the trough and stood 48 MiB above the
    floor, the newest point of a 2-minute block floor;
  * warmup#1106: four of a warm-up's steps (100, 110, 74, 68 MiB, 7-12 minutes apart) that looked
    steady, after a 329 MiB one two minutes before the first: a staircase.

And one 5d3e341 (round 7) raised at another bucket phase, on seeds 3000-3031 (never looked at before):
  * warmup#3008 under GPU-test (+30 s): a warm-up's last step (12 MiB in 5 MiB of sample noise,
    after an hour flat) falls in the middle of a bucket, whose median lands between the levels,
    and the noise on either side leans with it: the medians read as a 7-minute line at z 7.3
    (bar 5.2), the step model 4 noise variances worse. The 5 s samples inside fit one jump
    better than a climb by 21 variances: growth of up to 15 minutes read through the medians is
    no leak where its samples jump (by more than a change point's price) rather than climb.

And one that a first version of round 10's change raised (the troughs tested from six points, not
eight, at the usual bar), on seeds 3000-3031:
  * mixed#3007 under GPU-b (+50 s): six troughs of a sawtooth over a warm-up's steps read as a
    40-minute line at z 6.5 (bar 5.35), in 12 MiB of noise read on those six. Below eight troughs
    the test is held to the young bar (8.0).

And one that rounds 8-10 left (round 11 fixed it), on seeds 3000-3031:
  * mixed#3003 under GPU-b (+50 s): a young series' warm-up steps under teeth of 1-3 minutes,
    which put a trough in most minute buckets (no drop between bucket minima), read through the
    medians that ride them, in 43 MiB of aliased noise: a line at z 8-10 (young bar 8.0). The 5 s
    samples show the teeth; the series is now read through minima over blocks that hold a trough
    of every tooth.

And two that 7c9fdc6 (round 14) raised on seeds 2000-2015, fixed in round 15:
  * sawtooth#2004 and probed_mixed#2014 under GPU-bench: the newest tooth's trough read a minute
    after its drop, over one or two of its floor's samples, stood 8-14 MiB above the floor (a
    minimum over fewer samples stands higher) and ended a line of troughs (23 minutes, z 6.2) or
    a warm-up's steps under the teeth (32 minutes, z 8.4). The newest tooth's trough is read once
    the cache has grown off its floor.
And one that 7c9fdc6 raised on seeds 4000-4015 (replayed first in round 15), fixed then, with
mixed#2012 (seeds 2000-2015) at +30, +50 and +0 s, a young series' 17-minute line of 369 MiB at z
9.3 (young bar 8.0) whose noise also fits a Wander model:
  * correlated#4001 under GPU-b (+50 s): noise that wanders with a 7-minute memory, measured on
    211 points: a 53-minute line of 62 MiB at z 5.41 (bar 5.35), the slope's inflation read as 68
    where the trace's own AR(1) gives about 240. A few stretches of such noise can be far quieter
    than its long run; the wander's inflation now allows for the few it was measured on
    (trend_test.kappa_for).
And two that 50f9bdb (round 16) raised on seeds 6000-6015, fixed in round 17:
  * sleep_wake#6009 under GPU-bench (+15 s): after a wake with no cycles before the sleep, the
    cache warming up again in steps (65, 53 and 40 MiB within 6 minutes) read as a 6-minute line
    of 114 MiB at z 5.7 (bar 5.35): such a wake started no young period. Every large step now
    starts one (the young bar, a warm-up's steps); only the wait for a first tooth is left out.
  * mixed#6007 under GPU-bench: a warm-up's steps (24, 24 and 16 MiB over 40 minutes) under a
    1.6-minute sawtooth, read through the 2-minute block floor: a 79-minute line of 77 MiB at z
    12.8 (young bar 8.0). Three steps fitted it better by 37 noise variances, but read as 26, 38
    and 27 MiB from levels of 3 to 16 points, the second had "grown". Growth begun while young
    is now a warm-up's where its steps shrink within what their levels' noise allows.
And five that d5f5008 (round 17) raised on seeds 8000-8015 and 9000-9015, fixed in round 18:
  * probed_mixed#8000 under GPU-c (+0 s): the 2-minute block floor under a 1.2-minute sawtooth of
    20 MiB segments: a bucket's minimum stands a segment up where no sample fell in a tooth's first
    segment, a mixture whose core the median of second differences reads (2 MiB): a 6-minute hinge
    at z 22.9. The minima's noise is now read from the tail of their differences where it is far
    heavier than a normal's.
  * mixed#9001 under GPU-bench and GPU-test: after a 2.6 GiB step taken out as a shift, three flat
    troughs and a newest one 126 MiB up (a warm-up's step): a 28-minute hinge at z 8.1 (bar 8.0)
    whose growth lay in a segment too short (three points) for a step model. Growth that no
    segment of the window holds enough points to tell from a step is now taken for one.
  * warmup#9000 under GPU-b (+50 s): a warm-up's 23 MiB step in 7 MiB of noise whose next samples
    happened to rise: a 35-second climb in the samples at z 8.0, beating the best step by 10.6
    noise variances (the price 9.0). A climb of less than a minute now counts only where the next
    tick's samples still climb.
  * correlated#9012 under GPU-b: noise with a 6-minute memory, ten minutes after the young period:
    the samples since then too few for blocks that show such a memory, a climb in the samples at
    z 13.6. Without a jump since, the samples before the young period's end are read for the
    memory too (to refuse the test, not to set its slope's inflation).
And one that 2564f12 raised on seed 9008, fixed in round 19:
  * sleep_wake#9008 under GPU-c (+0 s): a 1.2-minute sawtooth whose teeth a bucket now and then
    misses, so that drops show between bucket minima every 9.5 minutes, each trough a minimum over
    some eight teeth; the newest, read over three minutes of its pseudo-tooth, stood 22 MiB above
    the floor: a 31-minute hinge at z 7.5. Where the samples show teeth three times shorter than
    the drops, the newest trough is now read only once its tooth is a period old. (Reading such
    series through the 2-minute block floor instead raised sawtooth#1 at two phases: teeth of
    2.1 GiB rise 136 MiB a sample, and a block's minimum scatters by as much.)
And two that f6456ce (round 19) raised on seeds 10000-10015, fixed in round 20:
  * correlated#10010 under GPU-bench (and every other phase): noise of 9 MiB with a 4-minute
    memory, 25 minute medians since settling, too few for their blocks and lags to see it: read as
    2 MiB of white noise, its wander passed for a 7-minute line of 44 MiB at z 13.4 (young bar 8.0).
  * correlated#10015 under GPU-bench: the same, a 5-minute memory, at minute 60: a 39-minute line
    of 11 MiB at z 10.6 (young bar 8.0).
  * correlated#11004 under GPU-test (+30 s), on seeds 11000-11015 (first replayed in round 20):
    noise of 5.5 MiB with a 4-minute memory, at minute 23: a 15-minute hinge of 14 MiB at z 8.5
    (young bar 8.0).
  Until the medians' blocks reach 8 points, the raw samples, twelve times as many, now say how
  the noise wanders too (leak_samples.medians_wander), carried to the medians.
And three that rounds 18-20 left, and one round 21's first version raised, fixed in round 21:
  * mixed#9011 under GPU-bench and mixed#11003 under GPU-test (+30 s): a young series' warm-up
    steps under teeth of 3 and 4 minutes, read through the minima: the minima ride the teeth's
    ramps, whose second differences read as 90 MiB of noise, so no tooth's fall (130-220 MiB)
    counted as a drop; a 24-minute line at z 9.1 and a 42-minute line at z 10.7 (young bar 8.0).
    Where the samples show teeth of about three minutes or more, a fall between bucket minima is
    now told by the samples' own noise, and such a series is read through its troughs.
  * sawtooth#10008 under GPU-bench and GPU-c (+0 s): nine troughs whose second differences
    alternate in sign about a median of 14 MiB, read about it as 6.1 MiB of noise where they
    scatter by about 12: a 33-minute line of 39 MiB at z 5.7 (bar 5.35). On fewer than 18 points
    the noise is now also read about zero, the larger taken. (The line began while young: the
    young period under a sawtooth, below, clears it as well, so this trace no longer tells the
    two apart; the reading about zero is held by tests/test_trend_test.py.)
  * mixed#12005 under GPU-bench, GPU-test and GPU-c, on seeds 12000-12015 (first replayed in
    round 21), raised by round 21's first version: two 24 MiB warm-up steps under teeth of 3.4
    minutes, now read through the troughs, passed for a 16-minute hinge at z 6.0 (bar 5.35): the
    troughs had no young period. A series is now young whether a sawtooth is measured or not.
    That also fixed mixed#12001 under GPU-bench and GPU-c, which e3b8657 (round 20) raised too
    (warm-up steps of 41, 31 and 42 MiB under 12-minute teeth, read through the troughs as a
    97-minute line at z 5.36, bar 5.35), and probed_mixed#6001 under GPU-bench, left since round
    16 (a warm-up's steps under the cache's cycles, through the troughs: an 89-minute line of
    198 MiB at z 8.5); each line began while young.
  (probed_mixed#11007 is fixed only with the probe's numbers: test_leak_probed.py. Read without
  them, as here, it still raises its false alert.)
"""
import sys
from pathlib import Path

import pytest

from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import DURATION, PAGE, T0, MiB, make_trace

# (family, seed, GPU UUID, the minute the detector of 01acb4f (the first six), 4920ee8 (the next six),
# 5d3e341 (the next), round 10's first version (the next), 587da91 (the next), 7c9fdc6 (the next three),
# 50f9bdb (the next two), d5f5008 (the next five), 2564f12 (the next), f6456ce (the next three) or
# e3b8657 (the next three), round 21's first version (the next) or e3b8657 again (the last two, found on
# seeds first replayed in rounds 21 and 16) raised its false alert)
FOOLED = [("warmup", 108, "GPU-bench", 68), ("correlated", 109, "GPU-bench", 78),
          ("correlated", 114, "GPU-bench", 28), ("mixed", 114, "GPU-bench", 78),
          ("warmup", 108, "GPU-test", 62), ("warmup", 110, "GPU-b", 101),
          ("correlated", 906, "GPU-bench", 35), ("mixed", 701, "GPU-bench", 81), ("mixed", 900, "GPU-bench", 89),
          ("mixed", 910, "GPU-bench", 22), ("mixed", 1114, "GPU-bench", 107), ("warmup", 1106, "GPU-bench", 36),
          ("warmup", 3008, "GPU-test", 113.5), ("mixed", 3007, "GPU-b", 65.8), ("mixed", 3003, "GPU-b", 58.8),
          ("sawtooth", 2004, "GPU-bench", 95.2), ("probed_mixed", 2014, "GPU-bench", 185.2),
          ("mixed", 2012, "GPU-test", 28.5), ("correlated", 4001, "GPU-b", 210.8),
          ("sleep_wake", 6009, "GPU-bench", 108.2), ("mixed", 6007, "GPU-bench", 99.2),
          ("probed_mixed", 8000, "GPU-c", 54.0), ("mixed", 9001, "GPU-bench", 58.2), ("mixed", 9001, "GPU-test", 52.5),
          ("warmup", 9000, "GPU-b", 41.9), ("correlated", 9012, "GPU-b", 43.6), ("sleep_wake", 9008, "GPU-c", 322.0),
          ("correlated", 10010, "GPU-bench", 36.2), ("correlated", 10015, "GPU-bench", 60.2),
          ("correlated", 11004, "GPU-test", 23.5), ("mixed", 9011, "GPU-bench", 30.2),
          ("mixed", 11003, "GPU-test", 54.5), ("sawtooth", 10008, "GPU-bench", 62.2),
          ("mixed", 12005, "GPU-bench", 43.2), ("mixed", 12001, "GPU-bench", 117.2),
          ("probed_mixed", 6001, "GPU-bench", 106.2)]
IDS = [f"{f}#{s}-{u}" for f, s, u, _ in FOOLED]
SLOWER = {("mixed", 900): 80, ("mixed", 910): 100, ("mixed", 3007): 75, ("mixed", 2012): 100,
          ("correlated", 4001): 50, ("probed_mixed", 8000): 60, ("sleep_wake", 9008): 80,
          ("correlated", 10010): 60, ("mixed", 701): 55}


# Seeds 2000-2015, 4000-4015, 6000-6015, 8000-8015, 9000-9015, 10000-10015, 11000-11015 and 12000-12015
# of every leak-free family, first replayed by 5e0fb52 (round 14), rounds 15, 16, 17, 18, 19, 20 and 21 at
# the four bucket phases: the false alerts raised there, not fixed. Strict xfails, so that fixing one asks for its
# mark to go. (family, seed, GPU UUID, minute, what it read)
FRESH = [("correlated", 2013, "GPU-bench", 104.2, "noise that wanders, read as 2 MiB: a 9-minute hinge of 16 MiB "
                                                  "at z 5.6 (bar 5.35); at +15 s and, since round 16, +50 s"),
         ("probed_mixed", 11007, "GPU-bench", 38.2, "a young series' warm-up under the cache's cycles, read "
                                                    "through the per-minute floor: a 17-minute line of 218 MiB at "
                                                    "z 13.4 (young bar 8.0) in 26 MiB of noise; without the probe's "
                                                    "numbers only (test_leak_probed.py)"),
         ("probed_mixed", 11014, "GPU-test", 99.5, "raised by round 21 (e3b8657 did not): after a 2.2 GiB level "
                                                   "shift, a 26 MiB warm-up step under 3.2-minute teeth, now read "
                                                   "through the troughs: a 15-minute hinge of four troughs at z 7.4 "
                                                   "(bar 5.35) in noise read at the 2 MiB floor; with the probe's "
                                                   "numbers too")]


@pytest.mark.parametrize("family,seed,uuid", [
    pytest.param(f, s, u, marks=pytest.mark.xfail(strict=True, reason=f"false alert at minute {m}: {w}; not fixed"))
    for f, s, u, m, w in FRESH], ids=[f"{f}#{s}-{u}" for f, s, u, _, _ in FRESH])
def test_leak_free_traces_of_fresh_seeds_raise_nothing(family, seed, uuid):
    trace = make_trace(family, seed)
    assert trace.leak_rate is None
    assert episodes(trace.times, trace.values, uuid) == []


@pytest.mark.parametrize("family,seed,uuid,minute", FOOLED, ids=IDS)
def test_leak_free_shapes_that_fooled_the_detector_raise_nothing(family, seed, uuid, minute):
    trace = make_trace(family, seed)
    assert trace.leak_rate is None
    assert episodes(trace.times, trace.values, uuid) == []


@pytest.mark.parametrize("family,seed,uuid,minute", FOOLED, ids=IDS)
def test_a_leak_beginning_where_the_false_alert_came_is_still_found(family, seed, uuid, minute):
    trace = make_trace(family, seed)
    within = SLOWER.get((family, seed), 45)
    onset = min(minute + 5.0, DURATION / 60 - within - 15)  # with the time to find it before the trace ends
    rate = 4 * MiB  # per minute
    values = [int((v + max(0.0, (t - T0) / 60 - onset) * rate) // PAGE) * PAGE
              for t, v in zip(trace.times, trace.values, strict=True)]
    # Under a sawtooth read through its troughs, whose noise a warm-up's steps inflate, a 4 MiB/min
    # leak takes longer: mixed#900 74 min, mixed#910 94 min (4920ee8 the same, once its false
    # alert had cleared), mixed#3007 67 min (cf21d1a the same), mixed#2012 95 min (7c9fdc6 94 at
    # the bench's phase, where it raised no false alert); and in correlated#4001's noise,
    # whose long-run deviation (15 MiB, a 7-minute memory) puts the limit for 4 MiB/min at about
    # 40 min, 47 min; under probed_mixed#8000's 1.2-minute teeth read through the block floor, 59 min
    # (d5f5008 the same, once its false alert had cleared); under sleep_wake#9008's 1.2-minute teeth
    # read through troughs 9.5 minutes apart, from minute 265, 54 min (2564f12: 46, the newest trough
    # read sooner); in correlated#10010's noise (9 MiB, a 4-minute memory: the limit for 4 MiB/min about
    # 23 min), from minute 41, 51 min: past minute 67 the medians' own blocks read the slope's
    # inflation 4-7x above what the trace's AR(1) gives; under mixed#701's teeth, from minute 86, 49 min
    # (e3b8657: 32, by a 100-minute line of troughs that reaches back into the young period, now held to
    # the young bar, as a series is young under a sawtooth too); elsewhere within 45 min.
    found = episodes(trace.times[: int((onset + within + 15) * 12)], values[: int((onset + within + 15) * 12)],
                     uuid)
    assert found, f"{family}#{seed}: a 4 MiB/min leak from minute {onset} not found within {within + 15} min"
    assert onset <= found[0] <= onset + within, found
