import math
import random

import pytest

from exporter.analysis.history import History, SeriesView
from exporter.analysis.leak import LeakAssessor, LeakConfig, LeakLatch, assess, last_large_step, time_to_full
from exporter.model import GpuSample, ProcessSample, Snapshot

T0 = 1_700_000_000.0
MiB = 1024 * 1024
GiB = 1024 * MiB
TOTAL = 80 * GiB
UUID = "GPU-test"
IDENTITY = (4242, T0 - 1.0)


def startup(t):
    """A vLLM start-up: context, weights in 4 shards, profiling spike, KV cache, CUDA graphs."""
    if t < 30:
        return 500 * MiB
    if t < 90:
        return 500 * MiB + 5 * GiB * (1 + int((t - 30) // 15))
    if t < 100:
        return 20.5 * GiB
    if t < 120:
        return 24.5 * GiB  # profiling run
    if t < 125:
        return 20.5 * GiB
    if t < 130:
        return 70 * GiB  # KV cache preallocated
    return 70 * GiB + GiB * min(1.0, (t - 130) / 40)  # CUDA graph capture


def warming(t):  # allocator caching new shapes: steps at doubling intervals, shrinking
    return sum(300 * MiB * 0.6 ** k for k in range(1, 7) if t >= 200 + 60 * (2 ** k - 1))


def sawtooth(t, period=360, amp=GiB):
    if t < 200:
        return 0.0
    phase = ((t - 200) % period) / period
    return math.floor(amp * phase / (20 * MiB)) * 20 * MiB  # grows in 20 MiB segments, then freed


def replay(parts, hours=4.0, sigma=3 * MiB, spikes=0.0, seed=1):
    """Feed 5 s samples through History and assess() as the daemon does; return the times at
    which a leak was suspected and the last assessment."""
    rng = random.Random(seed)
    history = History()
    suspected_at = []
    result = None
    for k in range(int(hours * 720)):
        t = 5.0 * k
        v = startup(t) + sum(p(t) for p in parts) + rng.gauss(0, sigma)
        if rng.random() < spikes:
            v += rng.uniform(64 * MiB, GiB)
        v = int(min(max(v, 0), TOTAL) // (2 * MiB)) * 2 * MiB
        p = ProcessSample(pid=IDENTITY[0], used_bytes=v, start_time=IDENTITY[1], name="python3")
        history.update(Snapshot(timestamp=T0 + t, gpus=(
            GpuSample(index="0", uuid=UUID, total_bytes=TOTAL, used_bytes=v, processes=(p,)),)))
        result = assess(history.process_memory(UUID, IDENTITY), TOTAL, T0 + t)
        if result.suspected:
            suspected_at.append(t)
    return suspected_at, result


def linear(rate_mib_per_min, start):
    return lambda t: 0.0 if t < start else rate_mib_per_min * MiB / 60 * (t - start)


# --- normal vLLM behaviour stays silent -------------------------------------------------------
@pytest.mark.parametrize("name,parts,kwargs", [
    ("start-up then flat", [], {}),
    ("allocator warming then plateau", [warming], {}),
    ("caching sawtooth", [sawtooth], {}),
    ("fast large sawtooth", [lambda t: sawtooth(t, period=120, amp=2 * GiB)], {}),
    ("one-off step", [lambda t: 2 * GiB if t > 7200 else 0.0], {}),
    ("step partly given back",
     [lambda t: (2 * GiB if 5400 < t < 9000 else 0.0) + (0.5 * GiB if t >= 9000 else 0.0)], {}),
    ("warming, sawtooth and a step",
     [warming, lambda t: sawtooth(t, 420, 300 * MiB), lambda t: GiB if t > 6000 else 0.0], {}),
    ("heavy noise with spikes", [], {"sigma": 24 * MiB, "spikes": 0.01}),
])
def test_normal_patterns_stay_silent(name, parts, kwargs):
    suspected_at, last = replay(parts, **kwargs)
    assert suspected_at == [], f"{name}: false alert at {suspected_at[:1]} s"
    assert last.slope_bytes_per_second is not None


# --- leaks are caught ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,parts,onset,within", [
    ("fast leak 50 MiB/min", [warming, linear(50, 3600)], 3600, 15 * 60),
    ("slow creep 1 MiB/min", [linear(1, 1800)], 1800, 150 * 60),
    ("staircase 40 MiB every 8 min",
     [lambda t: 0.0 if t < 2400 else 40 * MiB * (1 + (t - 2400) // 480)], 2400, 60 * 60),
    ("creep under a sawtooth", [sawtooth, linear(3, 1800)], 1800, 120 * 60),
])
def test_leaks_are_caught(name, parts, onset, within):
    suspected_at, last = replay(parts)
    assert suspected_at, f"{name}: never suspected"
    assert onset <= suspected_at[0] <= onset + within, f"{name}: first suspected at {suspected_at[0]} s"
    assert last.suspected
    evidence = dict(last.evidence)
    assert evidence["window_seconds"] >= 480
    assert evidence["mann_kendall_z"] >= LeakConfig().min_z
    assert evidence["time_to_full_seconds"] >= 0  # 0: the fast leak has filled the card


def test_slope_of_a_linear_leak_is_accurate():
    _, last = replay([linear(10, 1200)], hours=2)
    assert last.suspected
    assert last.slope_bytes_per_second == pytest.approx(10 * MiB / 60, rel=0.1)


def test_a_leak_that_stops_is_cleared():
    suspected_at, last = replay([lambda t: linear(10, 1200)(min(t, 4800))], hours=4)
    assert suspected_at and suspected_at[0] < 4800
    assert not last.suspected  # flat again for 2 h


# --- edge cases ------------------------------------------------------------------------------
def test_too_few_points_and_settling():
    few = assess(SeriesView((T0, T0 + 60), (1.0, 2.0)), TOTAL, T0 + 60)
    assert not few.suspected and few.slope_bytes_per_second is None
    assert dict(few.evidence)["reason"] == "too_few_points"
    times = tuple(T0 + 60 * i for i in range(12))
    ramp = tuple(float(i * 100 * MiB) for i in range(12))  # 12 minutes of steep growth
    young = assess(SeriesView(times, ramp), TOTAL, times[-1])
    assert not young.suspected and dict(young.evidence)["reason"] == "settling"


def test_stale_series_gets_no_verdict():
    times = tuple(T0 + 60 * i for i in range(120))
    values = tuple(float(GiB + i * 50 * MiB) for i in range(120))
    view = SeriesView(times, values)
    assert assess(view, TOTAL, times[-1]).suspected
    stale = assess(view, TOTAL, times[-1] + 3600)
    assert not stale.suspected and dict(stale.evidence)["reason"] == "stale"


def test_verdict_is_memoised_per_view_and_config():
    times = tuple(T0 + 60 * i for i in range(120))
    view = SeriesView(times, tuple(float(GiB + i * 50 * MiB) for i in range(120)))
    assessor = LeakAssessor()
    first = assessor("p", view, TOTAL, times[-1])
    assert assessor("p", view, TOTAL, times[-1] + 5) is first
    strict = assessor("p", view, TOTAL, times[-1], LeakConfig(min_growth_bytes=1024 * GiB))
    assert not strict.suspected and first.suspected


def test_pid_reuse_does_not_inherit_a_leak_verdict():
    history = History()
    old, new = (77, T0 - 10), (77, T0 + 7300)
    for k in range(2 * 720):
        t = T0 + 5 * k
        p = ProcessSample(pid=77, used_bytes=int(GiB + 50 * MiB / 60 * 5 * k), start_time=old[1])
        history.update(Snapshot(timestamp=t, gpus=(GpuSample(index="0", uuid=UUID, processes=(p,)),)))
    assert assess(history.process_memory(UUID, old), TOTAL, t).suspected
    for k in range(2 * 720, 2 * 720 + 360):
        t = T0 + 5 * k
        p = ProcessSample(pid=77, used_bytes=int(GiB), start_time=new[1])
        history.update(Snapshot(timestamp=t, gpus=(GpuSample(index="0", uuid=UUID, processes=(p,)),)))
        verdict = assess(history.process_memory(UUID, new), TOTAL, t)
        assert not verdict.suspected


def test_last_large_step_finds_the_kv_cache_preallocation():
    values = [0.5 * GiB, 20 * GiB, 20 * GiB, 70 * GiB, 70.5 * GiB, 71 * GiB, 73 * GiB]
    assert last_large_step(values) == 3  # +2 GiB at 71 GiB is under 25 % of the level
    assert last_large_step([1.0, 1.0, 1.0]) == 0


def test_time_to_full():
    times = tuple(T0 + 60 * i for i in range(60))
    growing = SeriesView(times, tuple(70 * GiB + i * 100 * MiB for i in range(60)))
    now = times[-1]
    expected = (TOTAL - (70 * GiB + 59 * 100 * MiB)) / (100 * MiB / 60)
    assert time_to_full(growing, TOTAL, now) == pytest.approx(expected, rel=0.01)
    assert time_to_full(growing, TOTAL, now + 600) == pytest.approx(expected - 600, rel=0.01)
    flat = SeriesView(times, tuple(70.0 * GiB for _ in range(60)))
    assert time_to_full(flat, TOTAL, now) is None
    shrinking = SeriesView(times, tuple(70 * GiB - i * MiB for i in range(60)))
    assert time_to_full(shrinking, TOTAL, now) is None
    # a start-up ramp just before now is not a trend
    ramp = SeriesView(times, tuple(GiB if i < 57 else 70 * GiB for i in range(60)))
    assert time_to_full(ramp, TOTAL, now) is None
    assert time_to_full(growing, None, now) is None
    full = SeriesView(times, tuple(TOTAL + i * MiB for i in range(60)))
    assert time_to_full(full, TOTAL, now) == 0.0


def test_latch_holds_a_finding_through_gaps_and_clears_after_quiet_period():
    latch = LeakLatch(clear_after_seconds=600)
    assert not latch.update("p", False, 0)
    assert latch.update("p", True, 100)
    assert latch.update("p", False, 500)  # a gap in the verdicts: still active
    assert latch.update("p", True, 600)
    assert latch.update("p", False, 1100)
    assert not latch.update("p", False, 1200)  # 600 s without a suspected verdict
    assert len(latch) == 0
    latch.update("q", True, 0)
    latch.prune(10_000)
    assert len(latch) == 0
