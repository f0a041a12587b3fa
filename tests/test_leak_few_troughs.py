"""A slow leak under a sawtooth of long teeth (#22, tenth round), on bench/leak_corpus.py traces
replayed through History and LeakDetector.detect tick by tick, as the daemon and the bench run
them (NVML's figure only: the probe's numbers are not read here).

The troughs, one point a tooth, were tested only once eight had settled: under teeth of 9-12
minutes that is more than an hour, while a 1 MiB/min leak is significant in three or four
teeth. They are now tested from six, against the young bar (1.5x the threshold) until there
are eight (at the usual bar, six troughs over a warm-up's steps read as a line: mixed#3007, in
test_leak_untuned.py).
"""
import sys
from pathlib import Path

import pytest

from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, make_trace


# (seed, the delay asserted, round 9's delay: cf21d1a waited for the eighth trough)
@pytest.mark.parametrize("seed,within,before", [(4, 32, 38), (7, 45, 63)])
def test_a_slow_leak_under_long_teeth_is_tested_from_six_troughs(seed, within, before):
    trace = make_trace("probed_slow_leak", seed)  # 1 MiB/min under teeth of 64-256 MiB
    onset = (trace.leak_start - T0) / 60
    found = episodes(trace.times, trace.values)
    assert all(m >= onset for m in found), f"a finding before the leak began: {found}"
    delay = found[0] - onset if found else None
    assert delay is not None and delay <= within, (trace.name, delay, f"cf21d1a: {before} min")
