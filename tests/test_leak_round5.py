"""Leaks a round of #22 found sooner, on bench/leak_corpus.py traces replayed through History and
LeakDetector.detect tick by tick, as the daemon and the bench run them. Each names what the
detector of 234b0a5 did with the same trace.

  * the windows of highest z soon after an onset are often short ones, each explained away (a
    step, wandering residuals, too short while young); only the six highest were examined, so a
    longer window that was a leak waited until it ranked among them (leak_under_sawtooth_slow#5);
  * a fast leak's first minute bucket holds part of a minute's growth: the pair of jumps over it
    and the next stood apart from the pairs beside them by more than a shift's size and was taken
    out as a level shift (fast_leak#7), and so were the troughs of a leak's teeth under a sawtooth
    (leak_under_sawtooth#1, #3, #7);
  * with three growing buckets (the first part-grown), one step straddling the middle bucket fit
    them as well as the line, so a leak waited a bucket more; the 5 s samples inside them tell a
    climb from one jump (fast_leak#4, late_leak#7, leak_after_shift#1).
And what must not change with it: a small step among troughs beside a far larger one is still a
step (mixed#311 raised a false alert when a jump had to stand out in its own direction only).
"""
import sys
from pathlib import Path

import pytest

from exporter.analysis.leak import _steps
from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, MiB, make_trace


def found_after(trace):
    """Minutes from the leak's onset to the first finding after it (None: not found); no
    finding may come before the onset."""
    found = episodes(trace.times, trace.values)
    onset = (trace.leak_start - T0) / 60
    assert all(m >= onset for m in found), f"{trace.name}: a finding before the leak began: {found}"
    return found[0] - onset if found else None


def test_a_slow_leak_under_a_sawtooth_is_not_held_back_by_short_windows_explained_away():
    trace = make_trace("leak_under_sawtooth_slow", 5)  # 1 MiB/min under 8-minute teeth
    delay = found_after(trace)
    assert delay is not None and delay <= 60, (delay, "234b0a5: 75 min")


def test_a_fast_leak_begun_inside_a_bucket_is_no_level_shift():
    trace = make_trace("fast_leak", 7)  # 50 MiB/min, begun 4 s into a minute bucket
    delay = found_after(trace)
    assert delay is not None and delay <= 4.5, (delay, "234b0a5: 5.2 min")


@pytest.mark.parametrize("seed,within,before", [(1, 45, 58.5), (3, 55, 79.9), (7, 50, 65.0)])
def test_a_leak_lifting_a_sawtooths_troughs_is_no_level_shift(seed, within, before):
    trace = make_trace("leak_under_sawtooth", seed)
    delay = found_after(trace)
    assert delay is not None and delay <= within, (trace.name, delay, f"234b0a5: {before} min")


def test_a_climb_with_a_part_grown_first_bucket_has_no_step():
    # Per-minute medians of a 50 MiB/min leak begun a third into a bucket, ending at the newest.
    climb = [x * MiB for x in (0, -2, 0, -2, 31, 79, 129, 181)]
    assert _steps(climb, 16 * MiB) == []


def test_a_small_step_beside_a_far_larger_one_is_still_a_step():
    # mixed#311's troughs: a 2.3 GiB step, a trough at the new level, then a 20 MiB step.
    troughs = [x * MiB for x in (-2368, -2366, -2364, -2320, -20, -20, 0)]
    found = _steps(troughs, 16 * MiB)
    assert [(i, round(d / MiB)) for i, d, _ in found][-1] == (6, 20), found


def test_the_mixed_trace_whose_small_trough_step_must_stay_a_step_raises_nothing():
    trace = make_trace("mixed", 311)
    assert trace.leak_rate is None
    assert episodes(trace.times, trace.values) == []


@pytest.mark.parametrize("family,seed,within,before", [("fast_leak", 4, 3.5, 3.9), ("late_leak", 7, 6.0, 7.7),
                                                       ("leak_after_shift", 1, 3.5, 4.9)])
def test_a_leaks_first_buckets_are_read_from_their_samples(family, seed, within, before):
    trace = make_trace(family, seed)
    delay = found_after(trace)
    assert delay is not None and delay <= within, (trace.name, delay, f"234b0a5: {before} min")

