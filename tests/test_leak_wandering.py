"""A slow leak in noise that wanders (#22, round 16), on a bench/leak_corpus.py trace replayed
through History and LeakDetector.detect tick by tick, as the daemon and the bench run it.

wandering_leak#10: 1 MiB/min from minute 50 in AR(1) noise of a few minutes' memory; its limit
(a test that knew the onset and the noise) is 65 minutes. Read on a series one to three hours
old, the noise's blocks are measured up to 8 or 16 points, between which such noise grows as a
random walk's would; the detector of 3a46a8c carried that growth on to windows of 100 points and
more, read the slope's inflation several times too high, and found the leak after 149 minutes.
A Wander model that accounts for what the blocks measured now says how the inflation grows
beyond them (trend_test.kappa_for).

Found, it must stay found while the leak goes on: the noise is measured again every ten minutes,
and read again it put the leak's z from 9-13 back to 4 for 40 minutes, longer than the latch's
half hour, so the finding cleared at minute 169 and came back at 179. A raised finding is now
judged at half the bar (LeakConfig.hold_bar).

leak_4#3: 4 MiB/min from minute 4 in noise of 13 MiB with a 2-minute memory. Found at minute 38,
it cleared at minute 304 and came back at 308: from minute 274 on, falls of the wandering noise
recurred often enough to read as a sawtooth, and its troughs, two, were too few to test for 35
minutes; each such minute counted as a quiet one. A verdict that cannot judge now holds a raised
finding (LeakLatch).
"""
import sys
from pathlib import Path

from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, limit_seconds, make_trace


def test_a_slow_leak_in_noise_that_wanders_is_found_within_one_and_a_half_times_its_limit_and_stays_found():
    trace = make_trace("wandering_leak", 10)
    assert trace.leak_rate == 1.0 and trace.noise_sigma > 0 and trace.full_at is None
    onset = (trace.leak_start - T0) / 60
    limit = limit_seconds(trace) / 60
    found = episodes(trace.times, trace.values)  # the whole 6 h: the leak goes on to the end
    assert found, "not found"
    assert onset <= found[0] <= onset + 1.5 * limit, (onset, limit, found)
    assert len(found) == 1, f"the finding cleared and came back while the leak went on: {found}"


def test_a_leak_whose_series_is_for_a_while_too_short_to_test_stays_found():
    trace = make_trace("leak_4", 3)
    assert trace.leak_rate == 4.0 and trace.full_at is None
    found = episodes(trace.times, trace.values)
    assert found and found[0] >= (trace.leak_start - T0) / 60, found
    assert len(found) == 1, f"the finding cleared and came back while the leak went on: {found}"
