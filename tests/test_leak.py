"""The leak detector's verdict (exporter.analysis.leak) on generated per-process series, replayed
through History point by point as the daemon does: what it finds, what it leaves alone, the
order of its delays, and what its evidence says. Never how fast it runs (bench/leak_quality.py)."""
import math
import random
from statistics import NormalDist

import pytest

from exporter.analysis.history import History, SeriesView
from exporter.analysis.leak import (
    WINDOWS_MINUTES,
    LeakAssessor,
    LeakConfig,
    LeakLatch,
    assess,
    last_large_step,
    time_to_full,
)
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


def sawtooth(t, period=360, amp=GiB, start=200):
    if t < start:
        return 0.0
    phase = ((t - start) % period) / period
    return math.floor(amp * phase / (20 * MiB)) * 20 * MiB  # grows in 20 MiB segments, then freed


def refill(at, size, seconds):
    """torch.cuda.empty_cache(): `size` freed at `at`, the cache filling up again over `seconds`."""
    return lambda t: -size * (1 - (t - at) / seconds) if at <= t < at + seconds else 0.0


def sleep_wake(asleep, awake):
    """vLLM sleep mode: weights and KV cache released while asleep, back on wake."""
    return lambda t: -68 * GiB if asleep <= t < awake else 0.0


def linear(rate_mib_per_min, start):
    return lambda t: 0.0 if t < start else rate_mib_per_min * MiB / 60 * (t - start)


class AR1:
    """Noise that wanders: AR(1) at 5 s with a memory of `tau` seconds."""

    def __init__(self, sigma, tau, seed):
        self.rng = random.Random(seed)
        self.phi = math.exp(-5 / tau)
        self.sigma = sigma
        self.x = 0.0

    def __call__(self, t):
        self.x = self.phi * self.x + self.rng.gauss(0, self.sigma * math.sqrt(1 - self.phi ** 2))
        return self.x


def replay(parts, hours=4.0, sigma=3 * MiB, spikes=0.0, seed=1, config=None, stop_at_first=False):
    """Feed 5 s samples through History and the daemon's memoising assessor; return the times
    (s from the start) at which a leak was suspected, the first suspected assessment (or None)
    and the last one."""
    rng = random.Random(seed)
    config = config or LeakConfig()
    history = History()
    assessor = LeakAssessor()
    suspected_at, first, result = [], None, None
    for k in range(int(hours * 720)):
        t = 5.0 * k
        v = startup(t) + sum(p(t) for p in parts) + rng.gauss(0, sigma)
        if rng.random() < spikes:
            v += rng.uniform(64 * MiB, GiB)
        v = int(min(max(v, 0), TOTAL) // (2 * MiB)) * 2 * MiB
        p = ProcessSample(pid=IDENTITY[0], used_bytes=v, start_time=IDENTITY[1], name="python3")
        history.update(Snapshot(timestamp=T0 + t, gpus=(
            GpuSample(index="0", uuid=UUID, total_bytes=TOTAL, used_bytes=v, processes=(p,)),)))
        result = assessor("p", history.process_memory(UUID, IDENTITY), TOTAL, T0 + t, config)
        assessor.prune()
        if result.suspected:
            suspected_at.append(t)
            if first is None:
                first = result
                if stop_at_first:
                    break
    return suspected_at, first, result


def delay(parts, onset, **kw):
    suspected_at, _, _ = replay(parts, stop_at_first=True, **kw)
    assert suspected_at, "never suspected"
    assert suspected_at[0] >= onset, f"suspected at {suspected_at[0]} s, before the leak began at {onset} s"
    return suspected_at[0] - onset


# --- normal vLLM behaviour stays silent -------------------------------------------------------
@pytest.mark.parametrize("name,parts,kwargs", [
    ("start-up then flat", [], {}),
    ("allocator warming then plateau", [warming], {}),
    ("caching sawtooth", [sawtooth], {}),
    ("fast large sawtooth", [lambda t: sawtooth(t, period=120, amp=2 * GiB)], {}),
    ("slow sawtooth whose first tooth lasts 12 min", [lambda t: sawtooth(t, period=720, amp=512 * MiB)], {}),
    ("one-off step", [lambda t: 2 * GiB if t > 7200 else 0.0], {}),
    ("a second model loading", [lambda t: 6 * GiB if t > 5400 else 0.0], {}),
    ("step partly given back",
     [lambda t: (2 * GiB if 5400 < t < 9000 else 0.0) + (0.5 * GiB if t >= 9000 else 0.0)], {}),
    ("cache emptied and filling up again", [refill(5400, GiB, 900), refill(9000, 512 * MiB, 1500)], {}),
    ("a sleep and a wake", [sleep_wake(5400, 6600)], {}),
    ("warming, sawtooth and a step",
     [warming, lambda t: sawtooth(t, 420, 300 * MiB), lambda t: GiB if t > 6000 else 0.0], {}),
    ("heavy noise with spikes", [], {"sigma": 24 * MiB, "spikes": 0.01}),
    ("noise that wanders for minutes", [AR1(12 * MiB, 300, seed=3)], {"sigma": 2 * MiB}),
])
def test_normal_patterns_stay_silent(name, parts, kwargs):
    suspected_at, _, last = replay(parts, **kwargs)
    assert suspected_at == [], f"{name}: false alert at {suspected_at[:1]} s"
    assert last.slope_bytes_per_second is not None


# --- leaks are caught, and say how sure the detector is ------------------------------------------
@pytest.mark.parametrize("name,parts,onset,rate,within", [
    ("fast leak 50 MiB/min after warm-up", [warming, linear(50, 3600)], 3600, 50, 10 * 60),
    ("slow creep 1 MiB/min", [linear(1, 1800)], 1800, 1, 30 * 60),
    ("creep under a sawtooth", [sawtooth, linear(3, 3600)], 3600, 3, 60 * 60),
    ("1 MiB/min under a sawtooth", [lambda t: sawtooth(t, 240, 256 * MiB), linear(1, 3600)], 3600, 1, 45 * 60),
    ("late leak after hours flat", [linear(2, 3 * 3600)], 3 * 3600, 2, 20 * 60),
    ("leak after a second model loads", [lambda t: 6 * GiB if t > 3600 else 0.0, linear(4, 4800)], 4800, 4,
     20 * 60),
])
def test_leaks_are_caught_with_the_rate_and_how_sure(name, parts, onset, rate, within):
    suspected_at, first, last = replay(parts, hours=(onset + within) / 3600 + 0.5)
    assert suspected_at, f"{name}: never suspected"
    assert onset <= suspected_at[0] <= onset + within, f"{name}: first suspected at {suspected_at[0]} s"
    for a in (first, last):
        ev = dict(a.evidence)
        assert ev["z"] >= ev["threshold_z"] > 0
        assert ev["false_alarms_per_day"] == LeakConfig().false_alarms_per_day
        low, high = a.interval
        assert ev["slope_low_bytes_per_second"] <= a.slope_bytes_per_second <= ev["slope_high_bytes_per_second"]
        assert low < high
        assert ev["time_to_full_seconds"] >= 0
    # Half an hour on, the rate's interval holds the true rate (at the first finding, near the
    # limit, the rate is still rough).
    assert last.suspected
    low, high = last.interval
    assert low * 0.8 <= rate * MiB / 60 <= high * 1.25, (name, low * 60 / MiB, high * 60 / MiB)


def test_a_staircase_leak_is_caught_by_its_steps():
    onset = 2400
    suspected_at, first, _ = replay([lambda t: 0.0 if t < onset else 40 * MiB * (1 + (t - onset) // 480)],
                                    stop_at_first=True)
    assert suspected_at and onset <= suspected_at[0] <= onset + 60 * 60
    assert first.slope_bytes_per_second == pytest.approx(5 * MiB / 60, rel=0.3)


def test_faster_leaks_are_found_sooner():
    delays = [delay([linear(rate, 3600)], 3600, seed=5) for rate in (0.5, 1, 4, 16)]
    assert delays[0] > delays[1] > delays[2] >= delays[3], delays  # minutes are the grain


def test_a_leak_in_more_noise_is_found_later():
    quiet = delay([linear(2, 3600)], 3600, sigma=2 * MiB, seed=6)
    noisy = delay([linear(2, 3600)], 3600, sigma=16 * MiB, seed=6)
    assert quiet < noisy, (quiet, noisy)


def test_a_larger_false_alarm_budget_finds_a_leak_no_later():
    strict = delay([linear(1, 3600)], 3600, seed=7, config=LeakConfig(false_alarms_per_day=0.001))
    loose = delay([linear(1, 3600)], 3600, seed=7, config=LeakConfig(false_alarms_per_day=1.0))
    assert loose <= strict, (loose, strict)


def test_the_threshold_is_the_budget_spread_over_every_test_of_a_day():
    config = LeakConfig(false_alarms_per_day=0.01)
    # Each minute: two models per window, and a third (the joined line begun inside a bucket)
    # for the windows up to half_kink_minutes; half the budget (the other half is the samples'
    # test's: one test per onset it scans each minute).
    short = sum(1 for w in WINDOWS_MINUTES if w <= config.half_kink_minutes)
    tests_per_day = 1440 * (2 * len(WINDOWS_MINUTES) + short)
    assert config.threshold() == pytest.approx(NormalDist().inv_cdf(1 - 0.005 / tests_per_day))
    assert config.samples_threshold(180) == pytest.approx(NormalDist().inv_cdf(1 - 0.005 / (1440 * 180)))
    budgets = [0.001, 0.01, 0.1, 1.0]
    thresholds = [LeakConfig(false_alarms_per_day=b).threshold() for b in budgets]
    assert thresholds == sorted(thresholds, reverse=True)
    assert config.threshold(signals=3) > config.threshold(signals=1)  # shared with a probe's series
    with pytest.raises(ValueError):
        LeakConfig(false_alarms_per_day=0)


def test_slope_of_a_linear_leak_is_accurate():
    _, _, last = replay([linear(10, 1200)], hours=2)
    assert last.suspected
    assert last.slope_bytes_per_second == pytest.approx(10 * MiB / 60, rel=0.1)
    low, high = last.interval
    assert low <= 10 * MiB / 60 <= high


def test_a_leak_that_stops_is_cleared():
    suspected_at, _, last = replay([lambda t: linear(10, 1200)(min(t, 4800))], hours=4)
    assert suspected_at and suspected_at[0] < 4800
    assert not last.suspected  # flat again for 2 h


# --- edge cases ------------------------------------------------------------------------------
def test_too_few_points_and_settling():
    few = assess(SeriesView((T0, T0 + 60), (1.0, 2.0)), TOTAL, T0 + 60)
    assert not few.suspected and few.slope_bytes_per_second is None
    assert dict(few.evidence)["reason"] == "too_few_points"
    times = tuple(T0 + 60 * i for i in range(12))
    ramp = tuple(float(i * 100 * MiB) if i < 6 else 40 * GiB + i * 10 * MiB for i in range(12))
    young = assess(SeriesView(times, ramp), TOTAL, times[-1])  # a large step 6 minutes ago
    assert not young.suspected and dict(young.evidence)["reason"] in {"settling", "maybe_first_tooth"}


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


def test_a_raised_findings_series_is_judged_at_the_hold_bar():
    # What the detector asks while a finding is raised (LeakConfig.hold_bar): the same view at a
    # lower bar is judged again, not served the full bar's verdict, and its threshold is lowered.
    times = tuple(T0 + 60 * i for i in range(120))
    view = SeriesView(times, tuple(float(GiB + i * 50 * MiB) for i in range(120)))
    assessor, config = LeakAssessor(), LeakConfig()
    full = assessor("p", view, TOTAL, times[-1], config)
    held = assessor("p", view, TOTAL, times[-1], config, bar=config.hold_bar)
    assert full.suspected and held.suspected and held is not full
    assert dict(held.evidence)["threshold_z"] == pytest.approx(config.hold_bar * dict(full.evidence)["threshold_z"],
                                                              abs=0.01)
    with pytest.raises(ValueError, match="hold_bar"):
        LeakConfig(hold_bar=0.0)


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


def test_latch_holds_a_finding_while_its_series_cannot_be_judged():
    latch = LeakLatch(clear_after_seconds=600)
    assert not latch.update("p", False, 0, undecided=True)  # raises nothing
    assert latch.update("p", True, 100)
    assert latch.update("p", False, 1000, undecided=True)  # too short to test: held
    assert latch.update("p", False, 1500)
    assert not latch.update("p", False, 1600)  # 600 s of verdicts that judged it quiet
