"""A slow leak in noise that wanders (#22, round 16), on a bench/leak_corpus.py trace replayed
through History and LeakDetector.detect tick by tick, as the daemon and the bench run it.

wandering_leak#10: 1 MiB/min from minute 50 in AR(1) noise of a few minutes' memory; its limit
(a test that knew the onset and the noise) is 65 minutes. Read on a series one to three hours
old, the noise's blocks are measured up to 8 or 16 points, between which such noise grows as a
random walk's would; the detector of 3a46a8c carried that growth on to windows of 100 points and
more, read the slope's inflation several times too high, and found the leak after 149 minutes.
A Wander model that accounts for what the blocks measured now says how the inflation grows
beyond them (trend_test.kappa_for).
"""
import sys
from pathlib import Path

from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, limit_seconds, make_trace


def test_a_slow_leak_in_noise_that_wanders_is_found_within_one_and_a_half_times_its_limit():
    trace = make_trace("wandering_leak", 10)
    assert trace.leak_rate == 1.0 and trace.noise_sigma > 0
    onset = (trace.leak_start - T0) / 60
    limit = limit_seconds(trace) / 60
    end = int((onset + 1.5 * limit + 5) * 12)  # samples, 5 s each
    found = episodes(trace.times[:end], trace.values[:end])
    assert found, f"not found within {1.5 * limit:.0f} min of its onset (limit {limit:.0f} min)"
    assert onset <= found[0] <= onset + 1.5 * limit, (onset, limit, found)
