"""Leak detector: is this process's memory growing the way a leak grows?

Input is History's per-minute tier (bucket medians and minima). The verdict is a sequential
test of the trend (trend_test.py): every minute, for every window length ending now, the
least-squares slope of a free line, and of a joined line (flat, then growing from the window's
start: the level before the onset read from the points before it), its z against the series'
own noise with the noise's correlations measured at several block sizes; the first minute some
window reaches the threshold and no model of a non-leak explains it better, the leak is
suspected. The threshold comes from a false-alarm budget per series and day (a Bonferroni
bound over every test of a day), so a fast leak is found in minutes and a slow one once a window
long enough for its rate has passed, close to what the noise allows (bench/leak_quality.py).

What is not a leak is modelled explicitly rather than waited out:
  * start-up: nothing is judged until `settle_seconds` after the last large up-step (weights,
    KV cache preallocation, a second model, a wake from sleep); then, while the series is
    young, a higher bar and a warm-up's shrinking steps as a model (both kept afterwards for
    growth that began then), and while no sawtooth is measured no rise shorter than its first
    tooth (timed from where it begins, not from the window's start); not that after a wake
    with no cycles before the sleep, where none comes;
  * level shifts: a jump that stands out from the jumps on either side is taken out, each
    segment between them fitted with its own intercept, so the slope is read within segments
    only; within a window the line must fit clearly better than one step (or, over a leak's
    first few minutes, where one step straddling a bucket fits its buckets as well, its 5 s
    samples must climb rather than jump; growth of up to a quarter hour whose samples clearly
    jump is a step straddling a bucket), and two steps must not fit clearly better than it
    (small steps below the shift size);
  * warm-up: growth that slows down (a significantly concave window) is an allocator warming
    up to a plateau; a staircase that shrinks or slows is one too (the step before its run
    included); under a sawtooth, troughs that climb in two or three shrinking steps, and so
    does growth begun while young (judged against the noise read blind to steps; no step more
    than 1.25x the one before, for growth begun while young beyond what the noise of the
    levels they part allows);
  * sawtooth allocator cycles: when drops recur, the test reads the troughs (one point per
    tooth; the newest tooth's once the cache has grown off its floor) instead of the medians, so
    a tooth's ramp is never taken for growth while growth under the teeth lifts the troughs;
    cycles of a few minutes are read through the minima of blocks of a few minutes;
  * a cache emptied and filling up again, the next tooth of a sawtooth: growth that does not
    take the level clearly above every level of the half hour before it, nor above the level
    before a drop inside its window, is no leak (unless that level is too far above for the
    growth to climb back to within the hour); an isolated large
    drop and the climb back after it are left out of the noise measurement (its kinks would pass
    for noise that wanders);
  * noise that wanders: besides the block estimates, the window's own residuals (their lag-1
    correlation) bound the slope's error; where a model of it is fitted, its inflation of the
    slope's error allows for the few stretches of a window's length it was measured on, and
    where it accounts for the blocks measured, it says how the inflation grows beyond them.
One view of each series is tested: the per-minute medians, or where cycles faster than a
minute make them jitter, the minima (over the block length that makes them quietest; a newest
bucket an up-step fell in left out, its minimum read over part of it only; where the 5 s samples
show teeth of up to a few minutes that the buckets alias and the blocks show no quieter length,
over blocks that hold a trough of every tooth), or the troughs under a sawtooth. The budget is
shared among the series tested for one process (the allocator probe's parts, leak_detector.py).

Growth the medians or the minima show must show at another phase of the buckets too: the same
view is read again with the buckets the raw samples cover (the newest hour) cut half a bucket
later, and must pass there at `other_phase_bar` of the bar. A step or a tooth's edge straddling a
bucket puts that bucket's median or minimum between two levels, which with the noise on either
side can read as a line at one phase only; a leak shows at every phase.

A staircase whose steps are each a level shift (a leak that grows in chunks) is caught by its
pattern instead: at least `staircase_steps` up-shifts in a row at a steady pace, none much
smaller than the others, neither shrinking nor slowing, the last one recent.

The finding says how sure it is: the rate with its 95 % interval (read from the best-fitting
onset within the window that passed), the z reached, the threshold and the budget it comes
from. assess() is pure; LeakLatch adds the hysteresis a caller raising and clearing findings
needs.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from . import leak_samples
from .history import SeriesView, bucket_point
from .trend import MAD_SIGMA, mad, mann_kendall, median, theil_sen, theil_sen_line
from .trend_test import (
    NoiseModel,
    Prefix,
    WindowResult,
    best_hinge,
    best_split,
    kappas,
    refine,
    robust_sigma,
    scan,
    threshold_z,
    wander_fit,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
_T = TypeVar("_T")


class RawSamples(Protocol):
    """A series' raw samples (History's raw view), from the one in effect at `since` on."""

    def __call__(self, since: float | None = None) -> SeriesView: ...

Evidence = tuple[tuple[str, float | int | str], ...]

# Window lengths tested, in minutes, shortest first: about 12 % apart, so the best window for
# any rate is within a few percent of one of them.
WINDOWS_MINUTES = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18, 20, 22, 25, 28, 32, 36, 40, 45, 50, 56, 63,
                   71, 80, 90, 100, 112, 126, 142, 160, 180, 200, 225, 250, 280, 320)
# Block sizes (points) at which the noise's correlations are measured.
KAPPA_SCALES = (2, 4, 8, 16, 32)
# Fewest settled points a signal's noise is measured on before it is tested against its
# threshold. The troughs, one point a tooth (up to 12 minutes apart), are tested from
# FEW_TROUGHS on, against the young bar until there are MIN_NOISE_POINTS: their noise read on so
# few points may be too low, and a warm-up's steps under the teeth fit a line as well
# (mixed#3007: six troughs over a warm-up read as a line at z 6.5).
MIN_NOISE_POINTS = 8
FEW_TROUGHS = 6
# The block size (points) from which the medians' own noise estimates are trusted alone: 64
# minutes after settling, eight blocks of it.
FINER_UNTIL_BLOCK = 8
MINUTES_PER_DAY = 1440


@dataclass(frozen=True)
class LeakConfig:
    # False alarms per process (on each GPU it uses) and day the test may raise on noise alone:
    # sets its threshold (a Bonferroni bound over every window and model tested each minute, and
    # every series tested for the process).
    false_alarms_per_day: float = 0.01
    windows_minutes: tuple[float, ...] = WINDOWS_MINUTES
    # Fewest points a window may have.
    min_points: int = 5
    # An up-step of at least this many bytes *and* this fraction of the level before it starts a
    # new settling period (start-up ramp, KV cache preallocation, model reload, wake).
    large_step_bytes: float = 1 * GiB
    large_step_fraction: float = 0.25
    # How long after a large step the series is left alone (CUDA graph capture, first warm-up).
    settle_seconds: float = 120
    # A jump of at least max(min_shift_bytes, shift_noise_factor x noise) that stands out from
    # the jumps on either side by as much is a level shift: taken out, the fits give each
    # segment between shifts its own intercept.
    min_shift_bytes: float = 16 * MiB
    shift_noise_factor: float = 8.0
    # A leak grows at least this fast (0.25 MiB/min) ...
    min_slope_bytes_per_second: float = 0.25 * MiB / 60
    # ... and has grown at least this much over the window that shows it.
    min_growth_bytes: float = 4 * MiB
    # The line must beat the best one-step model by this many noise variances (4: a small step
    # straddling a bucket, two points after it, fits a ramp within 2), and the best two-step
    # model must not beat the line by this many times log(points) noise variances.
    min_step_margin: float = 4.0
    two_step_penalty: float = 2.0
    # Windows up to this long also try a joined line whose onset falls half way between two
    # points (a fast leak begun inside a minute bucket); each such window counts as a third test.
    half_kink_minutes: float = 6.0
    # Growth up to this long (from its onset), read through the medians, is no leak where its 5 s
    # samples clearly jump rather than climb (read over twice this long at most).
    raw_step_minutes: float = 15.0
    # A window whose quadratic term has z below minus this decelerates: warm-up, not a leak.
    max_concavity_z: float = 2.5
    # A staircase: this many up-shifts in a row, gaps at most staircase_max_gap_seconds and
    # within a factor staircase_gap_ratio of each other, no step under staircase_size_ratio of
    # the largest, the last no longer ago than the longest gap, neither shrinking (the last at least
    # 0.6 x the first) nor slowing (the last gap at most 1.5 x the first).
    staircase_steps: int = 4
    staircase_max_gap_seconds: float = 1200
    staircase_gap_ratio: float = 2.5
    staircase_size_ratio: float = 0.3
    # A fall between consecutive minima of at least max(min_drop_bytes, drop_noise_factor x
    # noise) is a "drop" (a cache being freed). When drops recur (gaps up to max_tooth_seconds),
    # the floor is read once per tooth: its trough.
    min_drop_bytes: float = 16 * MiB
    drop_noise_factor: float = 4.0
    max_tooth_seconds: float = 900
    # For this long after the settling period the series is young: an allocator warms up, and a
    # sawtooth's first tooth comes then. Growth begun then is held to a threshold this factor
    # higher (afterwards too) and to a warm-up's shrinking steps, and no staircase is called (a
    # warm-up's first steps make one); while no sawtooth is measured, rises shorter than
    # first_tooth_seconds are not judged (they may be that first tooth). Under a sawtooth too,
    # since round 21: a warm-up's steps under teeth of a few minutes pass for a line through
    # the troughs (mixed#12005). The cost: the troughs are one point a tooth, so a leak begun
    # soon after the young period is first seen by windows that reach back into it, and those
    # are held to the young bar (bench/README.md, round 21: leak_under_sawtooth_slow 1.37x ->
    # 1.45x its limit, probed_leak_under_sawtooth 1.43x -> 1.44x).
    young_seconds: float = 1800
    young_threshold_factor: float = 1.5
    first_tooth_seconds: float = 900
    # No first tooth is waited for after a wake from sleep where the series showed no cycles
    # before it fell asleep: a large up-step that gives back at least this fraction of a large
    # fall before it. The cache, emptied on wake, warms up again in steps (the young bar and a
    # warm-up's steps judge them); with cycles before the sleep, their first tooth comes again
    # (bench family sleep_wake).
    wake_give_back_ratio: float = 0.75
    # The growth must take the level above every earlier one of this long before it by this
    # fraction of itself.
    earlier_level_seconds: float = 1800
    earlier_level_margin: float = 0.25
    # ... unless that level is further above than the growth, at the upper end of its rate's
    # interval, climbs in this long: a cache refilling climbs back within minutes, a leak after a
    # give-back or during a sleep would take hours.
    refill_seconds: float = 3600
    # Growth the medians or minima show must pass at this fraction of the bar where the raw samples
    # are cut into buckets half a bucket later (_other_phase). Not higher: each phase's z scatters
    # about the other's, and requiring both at the full bar delays white-noise leaks (noisy_leak
    # 1.43x -> 1.55x its limit); not lower: at 0.45 a young warm-up under small teeth (mixed#21
    # at +0 s) passes at both phases.
    other_phase_bar: float = 0.6
    # A raised leak stays raised while its growth passes this fraction of the bar (the latch
    # holds it through quiet minutes besides). The noise is measured again every ten minutes, and
    # read again it can put a leak found at z 9-13 back to z 4: 10 of 96 leaks in the corpus, and
    # 7 of 16 slow ones in noise that wanders, cleared and were raised again while they went on
    # (bench/leak_quality.py: "cleared while leaking").
    hold_bar: float = 0.5
    # The noise (its deviation and correlations) is measured again this often per series.
    noise_refresh_seconds: float = 600
    # Windows whose shape (steps, curvature) is examined per verdict at most, highest z first: a
    # bound on the cost where many windows pass and are explained away. Not lower: the windows
    # of highest z are often the short ones from the onset, each rejected (too short while
    # young, a step, noise that wanders in their few residuals), while a longer window that is a
    # leak ranked below the sixth (6 delayed leak_4#0 and #2, leak_after_shift#3 and
    # late_leak#3 by 1-2 min, leak_under_sawtooth_slow#5 by 24 min; bench/leak_quality.py).
    max_shapes: int = 40
    # The raw samples' test (leak_samples): onsets in the newest this many minutes (0: no such
    # test), after a flat baseline at least this long, over at most this many samples (the newest).
    samples_minutes: float = 15.0
    samples_baseline_minutes: float = 5.0
    samples_max: int = 1024
    # Noise below this is taken as this (NVML reports whole 2 MiB pages).
    min_noise_bytes: float = 2 * MiB
    # Points the noise is measured over (the newest).
    noise_points: int = 240
    # Window of the slope reported when no leak is suspected.
    slope_window_seconds: float = 1800
    # No verdict on a series whose newest point is older than this (process gone or not sampled).
    stale_seconds: float = 300

    def __post_init__(self) -> None:
        if not 0 < self.other_phase_bar <= 1 or not 0 < self.hold_bar <= 1:
            raise ValueError("leak: other_phase_bar and hold_bar must be > 0 and at most 1")
        if not 0 < self.false_alarms_per_day < MINUTES_PER_DAY:
            raise ValueError("leak: false_alarms_per_day must be > 0 and below one a minute")
        if not self.windows_minutes or list(self.windows_minutes) != sorted(self.windows_minutes) \
                or self.windows_minutes[0] <= 0:
            raise ValueError("leak: windows_minutes must be positive and ascending")
        if self.min_points < 3 or self.staircase_steps < 3:
            raise ValueError("leak: min_points and staircase_steps must be at least 3")
        if self.samples_minutes < 0 or self.samples_baseline_minutes <= 0 or self.samples_max < 24:
            raise ValueError("leak: samples_minutes must be >= 0, samples_baseline_minutes > 0, "
                             "samples_max >= 24")

    def threshold(self, signals: int = 1) -> float:
        """The z a window's slope must reach, for `signals` series tested per process: half the
        false-alarm budget (the other half is the samples' test's, samples_threshold)."""
        # Two models (free line, hinge) per window length, every minute, and a third (the hinge
        # with its onset between points) for the shortest windows.
        tests = 2 * len(self.windows_minutes) + sum(1 for w in self.windows_minutes if w <= self.half_kink_minutes)
        return _threshold(self.false_alarms_per_day / 2, MINUTES_PER_DAY * tests * signals)

    def samples_threshold(self, onsets: int, signals: int = 1) -> float:
        """The z the raw samples' joined line must reach, scanning `onsets` onsets every minute:
        the other half of the budget."""
        return _threshold(self.false_alarms_per_day / 2, MINUTES_PER_DAY * onsets * signals)


_THRESHOLDS: dict[tuple[float, float], float] = {}


def _threshold(budget: float, tests: float) -> float:
    key = (budget, tests)
    z = _THRESHOLDS.get(key)
    if z is None:
        if len(_THRESHOLDS) > 64:
            _THRESHOLDS.clear()
        z = _THRESHOLDS[key] = threshold_z(budget, tests)
    return z


@dataclass(frozen=True)
class LeakAssessment:
    suspected: bool
    slope_bytes_per_second: float | None  # the test's slope when suspected, else a robust recent one
    evidence: Evidence = ()
    # When suspected: (low, high) 95 % interval of the slope, bytes per second.
    interval: tuple[float, float] | None = field(default=None, compare=False)

    @property
    def undecided(self) -> bool:
        """Whether the verdict could not judge: the view tested too short to test, or the series
        settling after a large step. No evidence either way."""
        return not self.suspected and dict(self.evidence).get("reason") in ("too_few_points", "settling")


DEFAULT_CONFIG = LeakConfig()


def assess(series: SeriesView, total_bytes: int | None, now: float,
           config: LeakConfig = DEFAULT_CONFIG, signals: int = 1) -> LeakAssessment:
    """Assess one series (History's per-minute tier) for leak-like growth, causally at `now`.

    The verdict depends only on the series and `total_bytes` (for the time-to-full evidence);
    `now` only withholds a verdict on a stale series. `signals` is how many series the caller
    tests for the same process (the budget is shared between them).
    """
    times = series.times
    if times and now - times[-1] > config.stale_seconds:
        return LeakAssessment(False, None, (("reason", "stale"),))
    return verdict(series, total_bytes, config, signals)


class LeakAssessor:
    """assess() that keeps each series' last verdict, for a caller assessing the same series
    every tick: History hands out the same tier view until the series' next bucket closes, so
    all but about one tick a minute reuse it. Keys not assessed between two prune() calls are
    forgotten, so it holds only the series still asked about."""

    def __init__(self) -> None:
        # key -> (view, total_bytes, config, (signals, bar), verdict, the series' noise memo)
        Kept = tuple[SeriesView, int | None, LeakConfig, tuple[int, float], LeakAssessment, NoiseMemo]
        self._kept: dict[Hashable, Kept] = {}
        self._asked: dict[Hashable, Kept] = {}

    def __call__(self, key: Hashable, series: SeriesView, total_bytes: int | None, now: float,
                 config: LeakConfig = DEFAULT_CONFIG, signals: int = 1,
                 raw: RawSamples | None = None, bar: float = 1.0) -> LeakAssessment:
        """The verdict on `series`, its threshold lowered to `bar` of the budget's (a raised
        finding's hold, LeakConfig.hold_bar)."""
        times = series.times
        if times and now - times[-1] > config.stale_seconds:
            return assess(series, total_bytes, now, config)  # no verdict on a stale series
        kept = self._kept.get(key) or self._asked.get(key)
        memo = kept[5] if kept is not None and (kept[2] is config or kept[2] == config) else NoiseMemo()
        if kept is not None and kept[0] is series and kept[1] == total_bytes and kept[3] == (signals, bar) and \
                (kept[2] is config or kept[2] == config):
            result = kept[4]
            # A fast leak's first minute: the samples' test between the medians' minutes, on
            # the newest samples only (a climb the minute's verdict did not see).
            # (Where the test found a climb at the sample before, it looks again, to confirm it.)
            if not result.suspected and raw is not None and memo.samples_since is not None and (
                    _climbed_before(memo, recent := raw(now - leak_samples.RISING_SECONDS))
                    or leak_samples.rising(recent, config.min_noise_bytes / 2)):
                found = _samples_test(raw(), memo.samples_since, config, signals, memo)
                if found is not None:
                    result = _assessment(found, config, None, total_bytes, series.values[-1])
        else:
            result = verdict(series, total_bytes, config, signals, memo, raw, bar=bar)
        self._asked[key] = (series, total_bytes, config, (signals, bar), result, memo)
        return result

    def prune(self) -> None:
        self._kept, self._asked = self._asked, {}


def last_large_step(values: Sequence[float], config: LeakConfig = DEFAULT_CONFIG) -> int:
    """Index of the first point after the last large up-step (0 when there is none)."""
    if len(values) < 2 or max(map(operator.sub, values[1:], values[:-1])) < config.large_step_bytes:
        return 0  # the usual case, found without a loop in Python
    for i in range(len(values) - 1, 0, -1):
        if _large_step(values[i] - values[i - 1], values[i - 1], config):
            return i
    return 0


def _large_step(jump: float, lower: float, config: LeakConfig) -> bool:
    """A jump (up or down, as a positive size) of at least large_step_bytes and
    large_step_fraction of the level below it."""
    return jump >= config.large_step_bytes and jump >= config.large_step_fraction * lower


@dataclass(frozen=True)
class _Found:
    """One signal's positive verdict."""

    signal: str
    model: str  # line | hinge | staircase
    slope: float  # bytes per second
    se: float  # bytes per second
    z: float
    window_seconds: float
    growth: float
    noise: float
    kappa: float
    points: int
    threshold: float = math.inf  # the z the test had to reach (none for a staircase)


class NoiseMemo:
    """What verdict() measures about a series' noise, kept between its calls on the same series
    for up to `noise_refresh_seconds` (the noise changes slowly; measuring it is most of the
    cost). Measured afresh after a large step, and each time a signal has a quarter more points
    than when last measured (a young series' first estimates rest on few)."""

    __slots__ = ("base_time", "climbed_at", "measured_at", "other", "samples_since", "values")

    def __init__(self) -> None:
        self.base_time: float | None = None
        self.measured_at = -math.inf
        self.values: dict[str, tuple[int, object]] = {}  # name -> (points then, value)
        # Where the last verdict found the samples' test applies: the samples it reads from
        # (None: it does not apply).
        self.samples_since: float | None = None
        self.climbed_at: float | None = None  # the newest sample when the samples' test last found a climb
        self.other: NoiseMemo | None = None  # the same series cut at another phase (_other_phase)

    def get(self, name: str, now: float, base_time: float, points: int, config: LeakConfig,
            measure: Callable[[], _T]) -> _T:
        if base_time != self.base_time or now - self.measured_at >= config.noise_refresh_seconds:
            self.base_time, self.measured_at = base_time, now
            self.values = {}
        kept = self.values.get(name)
        if kept is None or points > kept[0] * 1.25:
            kept = self.values[name] = (points, measure())
        return kept[1]  # type: ignore[return-value]


def verdict(series: SeriesView, total_bytes: int | None, config: LeakConfig = DEFAULT_CONFIG,
            signals: int = 1, memo: NoiseMemo | None = None,
            raw: RawSamples | None = None, block: int | None = None, bar: float = 1.0) -> LeakAssessment:
    """assess() without the staleness check: a function of the series' points (and, with a
    memo, of the noise measured on them up to noise_refresh_seconds before; with `raw`, which
    returns the same series' raw samples, of those where a leak's first minutes are in doubt,
    and of the teeth they show, which may choose the view tested, measured with the noise), so
    a caller may keep it for as long as it holds the same SeriesView. `bar` lowers the threshold
    (a raised finding's hold, or the other phase's reading); `block` is the other phase's reading
    of a finding (_other_phase): the view given, not chosen (0 the medians, else the minima over
    blocks of that many points)."""
    memo = memo or NoiseMemo()
    if block is not None:
        memo.climbed_at = None  # the other phase's reading confirms no climb of its own
    times = series.times
    medians = series.values
    lows = series.least
    n = len(times)
    if n < config.min_points:
        memo.samples_since = None
        return LeakAssessment(False, None, (("reason", "too_few_points"), ("points", n)))
    base = last_large_step(medians, config)
    end = times[-1]
    slope = _recent_slope(times, medians, base, config)
    settled_from = times[base] + config.settle_seconds
    # What the noise memo is valid for: the last large step (not the oldest point kept, which
    # moves as the history's retention drops points).
    era = times[base] if base else -math.inf
    if end - 60 * config.windows_minutes[0] < settled_from:
        memo.samples_since = None
        return LeakAssessment(False, slope, (("reason", "settling"), ("settled_at", settled_from)))
    threshold = config.threshold(signals) * bar
    lo = max(base, n - config.noise_points)
    low_noise = memo.get("series", end, era, n - lo, config, lambda: robust_sigma(lows[lo:]))
    drop_bytes = max(config.min_drop_bytes, config.drop_noise_factor * low_noise)
    teeth = memo.get("sample_teeth", end, era, n - lo, config,
                     lambda: _sample_teeth(raw(settled_from), config)) if raw is not None else None
    if teeth is not None and teeth.period >= MINIMA_TEETH_SECONDS:
        # Teeth of a few buckets each: the minima ride their ramps, whose second differences read
        # as noise of the ramp's size, and no tooth's fall stands four such deviations (mixed#9011:
        # falls of 130-220 MiB under teeth of 3 minutes, against a drop size of 360 MiB). The
        # samples' own noise tells a fall (between bucket minima that move only with the ramp,
        # a fall is a tooth's); the series is then read through its troughs, where a young
        # warm-up's steps show as steps, not through minima that passed them for a line.
        drop_bytes = min(drop_bytes, teeth.fall)
    drops = _drops(times, lows, base, drop_bytes, config)
    tooth = _tooth(drops, times[base], config) if block is None else None
    tested: tuple[str, Sequence[float], Sequence[float]]
    chosen = block is None  # else this is the other phase's reading, which confirms nothing itself
    if tooth is None:
        # The quietest view of the level for a slope: the medians (white noise), or the minima
        # where cycles faster than a minute make the medians jitter, read over blocks of the
        # length that makes them quietest (a cycle of two or three minutes has a trough in
        # every such block, where per-minute minima would alternate between trough and ramp);
        # where the blocks show none quieter than the medians but the samples show teeth, blocks
        # that hold a trough of every tooth.
        if block is None:
            block = memo.get("block", end, era, n - lo, config,
                             lambda: _quietest_block(medians, lows, lo) or _teeth_block(teeth))
        if block == 0:
            tested = ("median", times[base:], medians[base:])
        else:
            # A bucket an up-step falls in holds the old level's minimum over part of the bucket
            # only, which misses the cycle's trough: left out of the floor.
            ft, fl = _unstraddled(times, medians, lows, base, block,
                                  max(config.min_shift_bytes, config.shift_noise_factor * low_noise))
            tested = ("floor", ft, fl) if block == 1 else ("floor", *_block_floor(ft, fl, 0, block))
    else:  # the medians ride the teeth: only the troughs say whether the level grows
        # Off its floor by two NVML pages: a cache grows in segments of several MiB, and under
        # noise that lifts a bucket's minimum off the floor by as much, the trough is then read
        # over a bucket or more of it, its bias already smaller.
        # Teeth a little over a minute long, which a bucket now and then misses, show as drops
        # minutes apart: their troughs are minima over many teeth, and the 5 s samples show the
        # teeth themselves several times shorter.
        aliased = teeth is not None and tooth >= ALIASED_TEETH * teeth.period
        tested = ("troughs", *_troughs(times, lows, base, drops, 2 * config.min_noise_bytes, tooth, aliased))
    # Young (soon after the large step): the allocator warms up, under a sawtooth as well (mixed#12005:
    # two 24 MiB warm-up steps under teeth of 3.4 minutes, read through the troughs, passed for a
    # 16-minute hinge at z 6.0, bar 5.35); while no cycle is measured a sawtooth's first tooth may
    # come too, but not after a wake where none came before the sleep.
    young_until = settled_from + config.young_seconds
    first_tooth = tooth is None and not _woke_without_cycles(times, medians, lows, base, drop_bytes, config)
    name, ts, ys = tested
    found: _Found | str = _test_signal(name, ts, ys, settled_from, threshold, config, young_until, first_tooth,
                                       memo, era, raw if name == "median" else None)
    # The samples' own test, where nothing but noise or a leak climbs so: read through the
    # medians (no cycle), past the young period. Between minutes LeakAssessor runs it again.
    memo.samples_since = young_until if config.samples_minutes > 0 and name == "median" and end >= young_until \
        else None
    if isinstance(found, str) and raw is not None and memo.samples_since is not None:
        found = _samples_test(raw(), memo.samples_since, config, signals, memo) or found
    if isinstance(found, str):
        return LeakAssessment(False, slope, (("reason", found),))
    other = _other_phase(series, raw()) if chosen and raw is not None and found.signal in ("median", "floor") \
        else None
    if other is not None:
        memo.other = memo.other or NoiseMemo()
        again = verdict(other, total_bytes, config, signals, memo.other, raw, block=block,
                        bar=config.other_phase_bar * bar)
        # Only a reading that was judged refutes (not one too short to judge).
        if not again.suspected and not again.undecided:
            return LeakAssessment(False, slope, (("reason", "not_at_another_phase"),))
    return _assessment(found, config, tooth, total_bytes, medians[-1])


def _climbed_before(memo: NoiseMemo, raw: SeriesView) -> bool:
    """Whether the samples' test found a climb when the sample before the newest was the newest."""
    return memo.climbed_at is not None and len(raw.times) > 1 and memo.climbed_at == raw.times[-2]


def _other_phase(series: SeriesView, raw: SeriesView) -> SeriesView | None:
    """The series with the buckets its raw samples cover cut again half a bucket later: each from
    one bucket's mean time to the next (the newest up to the newest sample); samples before the
    first such bucket's mean time are left out, older buckets kept as they are. None where the
    raw samples do not reach the newest bucket."""
    times, medians = series.times, series.values
    lows = series.least
    rt, rv = raw.times, raw.values
    if not rt or not times or rt[-1] < times[-1]:
        return None
    first = bisect.bisect_left(times, rt[0])
    ts, vs, ls = list(times[:first]), list(medians[:first]), list(lows[:first])
    edges = [*times[first:], math.inf]
    j = bisect.bisect_left(rt, edges[0])
    for b in edges[1:]:
        k = bisect.bisect_left(rt, b, j)
        if k > j:
            t, value, low = bucket_point(sum(rt[j:k]), rv[j:k])
            ts.append(t)
            vs.append(value)
            ls.append(low)
        j = k
    return SeriesView(tuple(ts), tuple(vs), tuple(ls))


def _samples_test(raw: SeriesView, since: float, config: LeakConfig, signals: int, memo: NoiseMemo) -> _Found | None:
    """leak_samples.climb as a _Found (None where it finds none). A climb of less than a minute
    counts where the test found one at the sample before too: on so few samples, a warm-up's step
    of three noise deviations whose next samples happen to rise passes for one for a tick
    (warmup#9000 at +50 s: 23 MiB in noise of 7 MiB, a 35-second climb at z 8.0); a leak goes on
    climbing."""
    got = leak_samples.climb(raw, since, config, lambda onsets: config.samples_threshold(onsets, signals))
    confirmed = _climbed_before(memo, raw)
    memo.climbed_at = None if isinstance(got, str) or not raw.times else raw.times[-1]
    if isinstance(got, str) or (got.seconds < 60 and not confirmed):
        return None
    fit = got.fit
    return _Found("samples", "hinge", fit.slope / 60.0, fit.se / 60.0, fit.z, got.seconds, got.growth,
                  got.sigma, fit.kappa, fit.end - fit.onset, got.threshold)


def _assessment(found: _Found, config: LeakConfig, tooth: float | None, total_bytes: int | None,
                level: float) -> LeakAssessment:
    """A positive verdict, with the evidence a finding tells."""
    evidence: Evidence = (
        ("signal", found.signal),
        ("model", found.model),
        ("window_seconds", round(found.window_seconds)),
        ("slope_bytes_per_second", round(found.slope, 3)),
        ("slope_low_bytes_per_second", round(found.slope - 1.96 * found.se, 3)),
        ("slope_high_bytes_per_second", round(found.slope + 1.96 * found.se, 3)),
    )
    if found.model == "staircase":
        evidence += (("steps", found.points),)
    else:
        evidence += (("z", round(found.z, 2)), ("threshold_z", round(found.threshold, 2)),
                     ("false_alarms_per_day", config.false_alarms_per_day))
    evidence += (("growth_bytes", int(found.growth)), ("points", found.points))
    if found.model != "staircase":
        evidence += (("noise_bytes", int(found.noise)), ("noise_inflation", round(found.kappa, 2)))
    if tooth is not None:
        evidence += (("sawtooth_period_seconds", round(tooth)),)
    if total_bytes:
        ttf = _seconds_to(total_bytes, level, found.slope)
        if ttf is not None:
            evidence += (("time_to_full_seconds", round(ttf, 1)),)
    interval = (found.slope - 1.96 * found.se, found.slope + 1.96 * found.se)
    return LeakAssessment(True, found.slope, evidence, interval)


def _test_signal(name: str, times: Sequence[float], values: Sequence[float], settled_from: float,
                 threshold: float, config: LeakConfig, young_until: float, first_tooth: bool, memo: NoiseMemo,
                 base_time: float, raw: RawSamples | None = None) -> _Found | str:
    """The sequential test over one signal (points since the last large step): a _Found, or
    why not. Growth begun before `young_until` is held to the young bar and a warm-up's steps;
    with `first_tooth`, a rise shorter than a tooth is not judged while young."""
    n = len(times)
    if n < config.min_points:
        return "too_few_points"
    end = times[-1]
    young = end < young_until
    awaiting_tooth = young and first_tooth  # a rise shorter than a tooth may be its first
    settled = bisect.bisect_left(times, settled_from)
    step_noise = memo.get(name + ".steps", end, base_time, n - settled, config,
                          lambda: _step_sigma(values[max(settled, n - config.noise_points):]))
    shift_size = max(config.min_shift_bytes, config.shift_noise_factor * step_noise)
    steps = _steps(values, shift_size)
    if not young:  # a warm-up's first steps look like a staircase
        stair = _staircase(times, [(i, d) for i, d, _ in steps if times[i] >= settled_from], config)
        if stair is not None:
            return stair
    # The up-steps taken out (and the points that may straddle them): what is left grows only
    # where the series grows between them.
    step_times = [times[i] for i, d, _ in steps if d > 0]
    raw_times, raw_values = times, values
    times, values, cuts = _destep(times, values, steps)
    n = len(times)
    settled = bisect.bisect_left(times, settled_from)
    if n - settled < max(config.min_points, FEW_TROUGHS if name == "troughs" else MIN_NOISE_POINTS):
        return "settling"  # too few points to tell the noise
    # (Only the troughs get here with fewer: young or few, the bar is raised once.)
    few = n - settled < MIN_NOISE_POINTS
    prefix = Prefix(times, values, cuts)

    def noise() -> NoiseModel:
        # The minima (floor, troughs) are read with the tail of their differences: a cache grown in
        # segments puts them a segment up now and then. (Not the medians: their heavy tails are
        # steps and wander, which the shape tests and the inflation tell against the core's noise.)
        sigma = robust_sigma(values[max(settled, n - config.noise_points):], config.min_noise_bytes,
                             heavy_tails=name != "median")
        # Steps down, left in for the test, would pass for wandering noise at the block sizes
        # that span them: the noise is measured with them taken out too.
        # A step down followed by a climb back (a cache emptied and filling up again) is left out
        # whole: its ramp's two kinks would pass for noise that wanders at every block size that
        # spans them, for hours.
        quiet, start = prefix, settled
        if any(d < 0 for _, d, _ in steps):
            spans = _refills(raw_times, raw_values, steps, step_noise, 4 * shift_size, config)
            t3, v3, c3 = _destep(raw_times, raw_values, spans, downs=True)
            quiet, start = Prefix(t3, v3, c3), bisect.bisect_left(t3, settled_from)
        # The block estimates, and a model of noise that wanders (AR(1)) fitted on the same
        # points: the model reaches windows longer than the blocks measured, and a young series.
        # (Not for the troughs: one point a tooth, too few for the lags to show wandering apart
        # from a leak's onset.)
        wander = wander_fit(quiet, start) if name != "troughs" else None
        table = kappas(quiet, start, sigma, KAPPA_SCALES)
        # Until the medians' blocks reach FINER_UNTIL_BLOCK points, the raw samples since the
        # last level shift up say how the noise wanders too.
        finer = None
        if raw is not None and (not table or table[-1][0] < FINER_UNTIL_BLOCK):
            since = max(settled_from, step_times[-1] + 60.0) if step_times else settled_from
            finer = leak_samples.medians_wander(raw(since), config)
        return NoiseModel(sigma, table, wander, len(quiet.u) - start, finer)
    model = memo.get(name, end, base_time, n - settled, config, noise)
    sigma = model.sigma
    if young or few:  # warm-up and first cycles are expected, or the noise is read on few points
        threshold *= config.young_threshold_factor
    # Windows longer than an hour move slowly: each is tested every third minute only (which
    # third, from the clock), a third of the cost for a minute more at most on slow leaks.
    turn = int(end // 60) % 3
    lengths = [w for k, w in enumerate(config.windows_minutes) if w <= 60 or k % 3 == turn]
    windows = scan(prefix, settled, model, lengths, config.min_points, threshold,
                   half_kink_minutes=config.half_kink_minutes)
    if not young:
        # Growth that began while the series was young (a warm-up's steps, a first tooth) keeps
        # the young bar after the young period: the period's end is no evidence against them.
        windows = [w for w in windows if times[w.onset] >= young_until
                   or w.z >= threshold * config.young_threshold_factor]
    if not windows:
        return "trend_not_significant"
    why = "trend_not_significant"
    best: WindowResult | None = None
    # One point a tooth: a warm-up's steps under a sawtooth are adjacent troughs, neither taken
    # out as level shifts nor left out of the noise's second differences (mixed#701, #900:
    # 20-110 MiB steps read as a line in a noise of 13-29 MiB, where the troughs scatter by a
    # few MiB). Their models of several steps are judged against the noise blind to steps.
    trough_steps = max(step_noise, config.min_noise_bytes) if name == "troughs" else None
    for w in windows[:config.max_shapes]:  # highest z first; the first that is a leak
        # Each step taken out leaves an error of about the noise in what is left: growth of that
        # order across the steps in the window is no evidence.
        taken = bisect.bisect_left(step_times, times[w.onset])
        stepped = 3.0 * sigma * math.sqrt(len(step_times) - taken)
        # Growth begun while young is held to the young bar in every test of it, the slope's
        # error read from its own residuals included (correlated#906: noise wandering with a
        # memory of minutes, which a young series' block estimates cannot see, passed that test
        # at z 7.2 against the young bar 7.8).
        bar = threshold if young or times[w.onset] >= young_until else threshold * config.young_threshold_factor
        # Growth begun while young is held to a warm-up's shrinking steps too, judged against
        # the noise blind to steps: a warm-up's steps under a sawtooth of about a minute's teeth,
        # which the buckets alias into noise that hides them (mixed#2, mixed#15 at other bucket
        # phases: 100-150 MiB steps read as a 16-17 minute line in 31-38 MiB of noise).
        warm = max(step_noise, config.min_noise_bytes) if times[w.onset] < young_until else None
        why = _reject(prefix, w, settled, sigma, config, awaiting_tooth, bar, stepped, trough_steps, warm_sigma=warm)
        # A fast leak's first buckets: with three growing, one step straddling the middle one
        # fits them as well as the line. The samples inside those buckets tell one jump from a
        # climb.
        if why == "a_step" and raw is not None and len(prefix.pieces(w.start, w.end)) == 1 and \
                prefix.u[-1] - prefix.u[w.onset] <= config.half_kink_minutes and \
                _climbs(raw(), times[w.start], times[w.onset], config):
            why = _reject(prefix, w, settled, sigma, config, awaiting_tooth, bar, stepped, trough_steps,
                          raw_climb=True, warm_sigma=warm)
        # Short growth's medians can pass for a line where one step straddles a bucket (its
        # median lands between the levels) and the noise on either side leans with it
        # (warmup#3008 at +30 s: a warm-up's last step of 12 MiB read as a 7-minute line at z 7.3,
        # the step model 4 noise variances worse). The samples inside say it jumped. They are
        # read from a minute after the last level shift taken out (a jump the medians' fits skip).
        elif not why and raw is not None and prefix.u[-1] - prefix.u[w.onset] <= config.raw_step_minutes and \
                _jumps(raw(), max(times[prefix.pieces(w.start, w.end)[-1][0]] + 60.0,
                                  times[-1] - 120 * config.raw_step_minutes), times[w.onset], config):
            why = "a_step"
        if not why:
            best = w
            threshold = bar
            break
    if best is None:
        return why
    rate = refine(prefix, best, model, config.min_points)  # the onset to the point
    seconds = times[-1] - times[rate.onset]
    return _Found(name, "hinge" if best.hinge else "line", rate.slope / 60.0, rate.se / 60.0, best.z, seconds,
                  rate.slope * seconds / 60.0, sigma, best.kappa, best.end - rate.onset, threshold)


def _reject(prefix: Prefix, w: WindowResult, settled: int, sigma: float, config: LeakConfig,
            awaiting_tooth: bool, threshold: float, stepped: float = 0.0, step_sigma: float | None = None,
            raw_climb: bool = False, warm_sigma: float | None = None) -> str:
    """Why a window whose slope is significant is still no leak ("" when it is one)."""
    minutes = prefix.u[-1] - prefix.u[w.onset]
    if w.slope < config.min_slope_bytes_per_second * 60:
        return "slope_too_small"
    if w.slope * minutes < config.min_growth_bytes + stepped:
        return "growth_too_small"
    if awaiting_tooth and minutes * 60 < config.first_tooth_seconds:
        # Soon after start-up, before any cycle was seen: a rise shorter than the longest tooth
        # may be the first tooth of an allocator's sawtooth.
        return "maybe_first_tooth"
    if awaiting_tooth and (prefix.u[-1] - _rise_onset(prefix, w, sigma, config)) * 60 < config.first_tooth_seconds:
        # The same, for the rise the window holds rather than the window: a free line over the
        # flat minutes after settling and a first tooth's ramp spans both, and passes as soon as
        # the two together are a tooth long (leak_under_sawtooth#1, #3 at three bucket phases:
        # 4 flat minutes and a 12-minute ramp of 0.95-1.35 GiB, read as a 15-minute line at z 26-33).
        return "maybe_first_tooth"
    # The line's end must stand above every earlier level of the last earlier_level_seconds
    # before the window (since the last large step; levels read as block means a quarter of the
    # window long), by a quarter of the window's growth: a cache filling up again after being
    # emptied climbs back to where it was, a sawtooth's next tooth to where the last one
    # peaked; a leak goes on. A level the growth would take over refill_seconds to climb back
    # to is not one it is climbing back to.
    b = max(1, (w.end - w.start) // 4)
    margin = max(2.0 * sigma * math.sqrt(w.kappa / b), config.earlier_level_margin * w.slope * minutes)
    reach = (w.slope + 2.0 * w.se) * config.refill_seconds / 60
    i = w.start
    since = prefix.u[w.start] - config.earlier_level_seconds / 60
    while i - b >= settled and prefix.u[i - b] >= since:
        gap = prefix.mean(i - b, i) - w.level_end
        if -margin < gap < reach:
            return "not_above_earlier_level"
        i -= b
    # Levels inside the window count as earlier ones where the series fell from them (a cache
    # freed, a first tooth's drop before its cycle is known): growth that climbs back to the
    # level before a drop is the next tooth or a refill, not a leak (mixed#910: a 15-minute
    # line over a young series' first tooth, its drop and the next tooth's ramp).
    y = prefix.y
    fall = max(config.min_drop_bytes, config.drop_noise_factor * sigma)
    # (Not the troughs: one point a tooth, a fall between two is a trough missed before it.)
    for k in range(w.start + 1, w.end) if step_sigma is None else ():
        if y[k - 1] - y[k] >= fall:
            gap = prefix.mean(max(w.start, k - 3), k) - w.level_end
            if -margin < gap < reach:
                return "not_above_earlier_level"
    shape = w.shape(prefix, sigma, step_sigma if step_sigma is not None else warm_sigma,
                    young=warm_sigma is not None)
    if shape.residual_z < threshold:
        return "correlated_noise"
    # No segment of the window (between the shifts taken out) holds the four points a step needs:
    # the growth cannot be told from a step (mixed#9001: troughs -2, -4, -2 then 126 MiB, three
    # points after the last shift, a line at z 8.1).
    if (shape.step_margin < config.min_step_margin or (shape.step_margin == math.inf and prefix.cuts)) \
            and not raw_climb:
        return "a_step"
    penalty = config.two_step_penalty * math.log(w.end - w.start)
    if shape.two_step_margin < -penalty or shape.warm_two_margin < -penalty or shape.warm_three_margin < -2 * penalty:
        return "steps"
    if shape.curvature < -config.max_concavity_z:
        return "decelerating"
    return ""


def _rise_onset(prefix: Prefix, w: WindowResult, sigma: float, config: LeakConfig) -> float:
    """Where the growth in window `w` begins (minutes, as prefix.u): the onset of the best joined
    line (flat, then growing) over the window's points, where it fits them better than `w` by
    two_step_penalty x log(points) noise variances (the price of its change point, as the step
    models pay it); else `w`'s own onset."""
    h = best_hinge(prefix, w.start, range(max(w.onset + 1, w.start + 2), w.end - 2), sigma, lambda points: 1.0, 2)
    noise = sigma * sigma * min(w.kappa, 2.0)
    if h is None or (w.rss - h.rss) / noise < config.two_step_penalty * math.log(w.end - w.start):
        return prefix.u[w.onset] if w.kink is None else w.kink
    return prefix.u[h.onset]


def _raw_margin(raw: SeriesView, start: float, onset: float, config: LeakConfig,
                despike: bool = False) -> tuple[float, float]:
    """How much better the raw samples since `start` (the window's first bucket) are fitted by a
    climb from a level (the joined line, flat then growing from its best onset at or after the
    bucket before `onset`) than by a jump to another (the best single step), in noise variances
    read from the samples' second differences (negative where the jump fits better); and what a
    climb must win by to be told from a jump: min_step_margin and 2 log(points), the price of a
    change point. (0, inf) where too few samples tell. With `despike`, a sample far from its
    neighbours is read as their median (leak_samples.despiked): a step placed to take in a one-sample spike
    at the edge (hundreds of MiB for 5 s) would pass for a jump. (Not where a climb is looked for:
    noise that wanders, clipped, climbs more smoothly; correlated#3 at +0 s.)"""
    times, values = raw.times, raw.values
    a = bisect.bisect_left(times, start - 30.0)
    n = len(times)
    if n - a < 12:
        return 0.0, math.inf
    sigma = robust_sigma(values[a:], config.min_noise_bytes)
    prefix = Prefix(times[a:], leak_samples.despiked(values[a:], 6.0 * sigma) if despike else values[a:])
    one, _ = best_split(prefix, 0, n - a)
    first = max(2, bisect.bisect_left(times, onset - 90.0) - a)
    h = best_hinge(prefix, 0, range(first, n - a - 3), sigma, lambda points: 1.0, 5)
    if h is None:
        return 0.0, math.inf
    return (one - h.rss) / (sigma * sigma), max(config.min_step_margin, 2.0 * math.log(n - a))


def _climbs(raw: SeriesView, start: float, onset: float, config: LeakConfig) -> bool:
    margin, price = _raw_margin(raw, start, onset, config)
    return margin >= price


def _jumps(raw: SeriesView, start: float, onset: float, config: LeakConfig) -> bool:
    margin, price = _raw_margin(raw, start, onset, config, despike=True)
    return margin <= -price


def _step_sigma(values: Sequence[float]) -> float:
    """Noise from first differences read at their 30th percentile of size: steps (a few large
    differences) barely move it, where they would inflate a median of second differences. The
    smaller of that about 0 (blind to steps, not to a steady climb) and about the differences'
    median (blind to a steady climb, not to many steps)."""
    if len(values) < 4:
        return 0.0
    d: list[float] = [b - a for a, b in itertools.pairwise(values)]
    centre = median(d)
    k = int(0.3 * (len(d) - 1))
    # |N(0, 2 sigma^2)| has its 30th percentile at 0.385 * sqrt(2) sigma.
    return min(sorted(abs(x) for x in d)[k], sorted(abs(x - centre) for x in d)[k]) / 0.545


def _steps(values: Sequence[float], size: float) -> list[tuple[int, float, int]]:
    """The level shifts: a jump of at least `size` between two points (or split over two, the
    step fell mid-bucket), standing out by as much from the median of the jumps on either side
    of it (a steady climb is no shift, nor is the onset of one). (index, jump, width): the index
    is the first point wholly at the new level, the width 2 where the step straddled a bucket
    (the point before it holds part of it); the jump is measured between the medians of up to
    three points on either side."""
    out: list[tuple[int, float, int]] = []
    n = len(values)
    d = [0.0, *map(operator.sub, values[1:], values[:-1])]
    quarter = size / 4
    if max(d) < quarter and min(d) > -quarter:
        return out  # the usual case: no jump anywhere near a step's size
    candidates = [i for i, x in enumerate(d) if x >= quarter or x <= -quarter]
    done = 0
    for i in candidates:
        if i < done or i == 0:
            continue
        width = 1
        if i + 1 < n and ((d[i] > quarter and d[i + 1] > quarter) or (d[i] < -quarter and d[i + 1] < -quarter)) \
                and not -size < d[i] + d[i + 1] < size:
            jump, width = d[i] + d[i + 1], 2  # split over two points: one step
        elif not -size < d[i] < size:
            jump = d[i]
        else:
            continue
        # It must stand out from the jumps on each side (the onset of a fast climb stands out
        # only from those before it).
        # (A jump over two points is compared with the jumps over two points beside it.)
        if width == 1:
            before = [d[k] for k in (i - 2, i - 1) if k >= 1]
            after = [d[k] for k in (i + 1, i + 2) if k < n]
        else:
            before = [d[i - 2] + d[i - 1]] if i >= 3 else []
            # At the newest end, one jump after it stands for two (a fast climb's first
            # minutes are not a step because the series ends before its pace shows twice).
            after = [d[i + 2] + d[i + 3]] if i + 3 < n else [2 * d[i + 2]] if i + 2 < n else []
        # A jump beside jumps all of its sign and at least half its size, on either side, is a
        # climb whose pace shows unevenly (a fast leak's first, part-grown bucket and the next),
        # not a step.
        climb = any(side and all(x * jump > 0 and abs(x) >= 0.5 * abs(jump) for x in side)
                    for side in (before, after))
        if not climb and all(abs(jump - median(side)) >= size for side in (before, after) if side):
            first = i + width - 1  # the first point wholly at the new level
            lower = values[max(0, i - 3):i]
            upper = values[first:first + 3]
            out.append((first, median(upper) - median(lower), width))
        done = i + width
    return out


def _refills(times: Sequence[float], values: Sequence[float], steps: list[tuple[int, float, int]],
             step_noise: float, size: float, config: LeakConfig) -> list[tuple[int, float, int]]:
    """`steps` with each isolated step down widened to the climb back that follows it: up to the
    first point back within a few noise deviations of the level before the drop, at most
    earlier_level_seconds after it (a give-back or a sleep never climbs back), never past the
    next step. The jump is then measured from before the drop to after the climb. Drops that
    recur within refill_seconds of each other are a cycle's (a sawtooth not recognised as one),
    and drops under `size` may be the noise's own: both are left in, the noise they make is the
    noise the test must allow for."""
    out: list[tuple[int, float, int]] = []
    n = len(values)
    downs = [times[i] for i, d, _ in steps if d < 0]
    for k, (first, jump, width) in enumerate(steps):
        if jump >= 0:
            out.append((first, jump, width))
            continue
        if -jump < size:
            continue
        at = bisect.bisect_left(downs, times[first])
        if (at > 0 and times[first] - downs[at - 1] < config.refill_seconds) or \
                (at + 1 < len(downs) and downs[at + 1] - times[first] < config.refill_seconds):
            continue
        i0 = first - width + 1  # the step's first point
        before = median(values[max(0, i0 - 3):i0]) if i0 > 0 else values[first]
        limit = steps[k + 1][0] - steps[k + 1][2] + 1 if k + 1 < len(steps) else n
        until = times[first] + config.earlier_level_seconds
        j = first
        tolerance = 3.0 * step_noise
        while j < limit and times[j] < until and values[j] < before - tolerance:
            j += 1
        if j >= n:  # still climbing (or down) at the newest point: nothing after it to keep
            out.append((n, 0.0, n - i0 + 1))
            break
        if j >= limit:  # the next step came first: the drop alone
            out.append((first, jump, width))
            continue
        out.append((j, median(values[j:min(n, j + 3)]) - before, j - i0 + 1))
    return out


def _destep(times: Sequence[float], values: Sequence[float], steps: list[tuple[int, float, int]],
            downs: bool = False) -> tuple[list[float], list[float], list[int]]:
    """The series with its up-steps taken out, the point that straddles a step (holding part
    of it) left out, and where each step's segment now begins (the fits give each segment its
    own intercept: what is left grows only where the series grows between the steps, whatever
    error the step's size was measured with). Down-steps stay unless `downs` (for measuring
    the noise): growth back to a level seen before is then still seen as such."""
    ups = [(i, d, width) for i, d, width in steps if d > 0 or downs]
    if not ups:
        return list(times), list(values), []
    ts: list[float] = []
    vs: list[float] = []
    cuts: list[int] = []
    offset = 0.0
    lo = 0
    for i, d, width in ups:  # keep [lo, i) at the current offset (less a straddling point)
        hi = i - (width - 1)  # the points before i that straddle the step (or a refill) left out
        ts.extend(times[lo:hi])
        vs.extend([v - offset for v in values[lo:hi]] if offset else values[lo:hi])
        offset += d
        lo = i
        cuts.append(len(ts))
    ts.extend(times[lo:])
    vs.extend([v - offset for v in values[lo:]])
    return ts, vs, cuts


def _staircase(times: Sequence[float], steps: list[tuple[int, float]], config: LeakConfig) -> _Found | None:
    """A leak in steps, each a level shift: the newest run of up-steps at a steady pace."""
    k = config.staircase_steps
    run: list[tuple[int, float]] = []
    for i, d in reversed(steps):
        if d <= 0:
            break
        run.append((i, d))
        if len(run) == k + 1:
            break
    if len(run) < k:
        return None
    run.reverse()
    # The up-step just before the run, where it came at the run's pace: a warm-up's steps
    # shrink and slow over the whole sequence, but their times and sizes jitter, so four of
    # them in a row can look steady (warmup#1106: 100, 110, 74, 68 MiB 7-12 min apart, after
    # 329 MiB two minutes before). A leak's step before its run is one of its own.
    before, run = (run[0], run[1:]) if len(run) > k else (None, run)
    at = [times[i] for i, _ in run]
    sizes = [d for _, d in run]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    if max(gaps) > config.staircase_max_gap_seconds or max(gaps) > config.staircase_gap_ratio * min(gaps):
        return None
    if times[-1] - at[-1] > max(gaps) or min(sizes) < config.staircase_size_ratio * max(sizes):
        return None
    # A warm-up's steps shrink and come ever later; a leak's keep their size and pace.
    if sizes[-1] < 0.6 * sizes[0] or gaps[-1] > 1.5 * gaps[0]:
        return None
    if before is not None and at[0] - times[before[0]] <= config.staircase_max_gap_seconds and \
            (sizes[-1] < 0.6 * before[1] or gaps[-1] > 1.5 * (at[0] - times[before[0]])):
        return None
    rate = sum(sizes[1:]) / (at[-1] - at[0])
    if rate < config.min_slope_bytes_per_second:
        return None
    # The rate's spread from the steps' and gaps' spread (no noise model for a staircase).
    low = min(sizes[1:]) / max(gaps)
    high = max(sizes[1:]) / min(gaps)
    return _Found("steps", "staircase", rate, (high - low) / 2 / 1.96, math.inf, at[-1] - at[0] + 60, sum(sizes[1:]),
                  0.0, 1.0, len(run))


FLOOR_BLOCKS = (1, 2, 3, 4, 6)
# Teeth in the 5 s samples (_sample_teeth): a fall more than this many times every rise in the
# minute on either side of it, this many such falls, and blocks this much longer than the
# typical tooth (teeth vary in length) so that each holds a trough.
FALL_OVER_RISE = 2.0
SAMPLE_TEETH = 4
TOOTH_JITTER = 1.25
# Drops between bucket minima this many times further apart than the teeth the samples show are
# buckets that missed a trough (teeth of 0.8-1.2 periods and a 5 s grid), not teeth.
ALIASED_TEETH = 3.0
# Teeth at least this long have their falls told between bucket minima by the samples' noise.
# Shorter ones' troughs, read over two or three buckets, scatter more than blocks of minima do
# (probed_slow_leak#0 and #3, teeth of 2.5 and 2.3 minutes: found 3 and 22 minutes later).
MINIMA_TEETH_SECONDS = 165.0


def _quietest_block(medians: Sequence[float], lows: Sequence[float], lo: int) -> int:
    """The quietest view of the level for a slope, from the points since `lo`: 0 for the
    medians, else the block length (minutes) of the minima; least noise variance per minute of
    series (sigma_b^2 x b), the minima only where clearly quieter, a longer block only where it
    halves that and has 16 blocks to show it (the choice must not flip from minute to minute)."""
    best, best_b = robust_sigma(medians[lo:]) ** 2, 0
    for b in FLOOR_BLOCKS:
        if (len(lows) - lo) // b < 16:
            break
        floors = lows[lo:] if b == 1 else [min(lows[k - b:k]) for k in range(len(lows), lo + b - 1, -b)]
        cost = robust_sigma(floors) ** 2 * b
        if cost < (0.8 if b == 1 else 0.5) * best:  # longer blocks only where far quieter
            best, best_b = cost, b
    return best_b


def _teeth_block(teeth: SampleTeeth | None) -> int:
    """Where the 5 s samples show `teeth` of up to a few minutes, the block length
    (minutes) that holds a trough of every tooth: TOOTH_JITTER periods, in whole minutes, at most
    the longest of FLOOR_BLOCKS (0: no such teeth). Such teeth put a trough in most buckets, so
    the bucket minima show no drop between them, and the medians ride them, aliased into noise
    that hides a warm-up's steps (bench/README.md, round 11: steps under teeth of 1-3 minutes
    read as a line at z 8-10 in 30-45 MiB of that noise). Longer teeth show as drops between
    bucket minima and are read through their troughs. The caller asks only where the blocks
    measured show no length quieter than the medians: blocks a tooth long then hold so few points
    in a young series that a warm-up's steps pass for a line (round 11)."""
    if teeth is None:
        return 0
    return next((b for b in FLOOR_BLOCKS if 60 * b >= TOOTH_JITTER * teeth.period), 0)


class SampleTeeth(NamedTuple):
    """A sawtooth the 5 s samples show (_sample_teeth)."""

    period: float  # the typical seconds between falls
    fall: float  # the size a fall must reach to count (bytes)


def _sample_teeth(samples: SeriesView, config: LeakConfig) -> SampleTeeth | None:
    """The sawtooth in the samples (its typical period, the size a fall must reach), or None: falls
    of at least a drop (min_drop_bytes, or drop_noise_factor x the noise of the samples'
    differences), each more than FALL_OVER_RISE x every rise in the minute on either side of it
    (a cache grows in segments and is freed at once; a one-sample transient, up or down, rises
    as far as it falls), SAMPLE_TEETH of them at gaps of up to max_tooth_seconds."""
    ts, vs = samples.times, samples.values
    if len(vs) < 3:
        return None
    steps = [b - a for a, b in itertools.pairwise(vs)]
    size = max(config.min_drop_bytes, config.drop_noise_factor * MAD_SIGMA * mad(steps))
    falls = []
    for k, d in enumerate(steps):  # steps[k] is the change from sample k to k + 1
        if -d >= size:
            around = steps[bisect.bisect_left(ts, ts[k] - 60):k] + \
                steps[k + 1:bisect.bisect_right(ts, ts[k + 1] + 60) - 1]
            if -d > FALL_OVER_RISE * max(around, default=0.0):
                falls.append(ts[k + 1])
    gaps = [b - a for a, b in itertools.pairwise(falls) if b - a <= config.max_tooth_seconds]
    return SampleTeeth(median(gaps), size) if len(gaps) >= SAMPLE_TEETH - 1 else None


def _block_floor(times: Sequence[float], lows: Sequence[float], base: int,
                 block: int) -> tuple[list[float], list[float]]:
    """The least minimum of each block of `block` points (aligned to the newest), at the time
    it occurred."""
    ts: list[float] = []
    vs: list[float] = []
    hi = len(times)
    while hi - block >= base:
        seg = lows[hi - block:hi]
        m = min(seg)
        ts.append(times[hi - block + seg.index(m)])
        vs.append(m)
        hi -= block
    ts.reverse()
    vs.reverse()
    return ts, vs


def _unstraddled(times: Sequence[float], medians: Sequence[float], lows: Sequence[float], base: int,
                 block: int, size: float) -> tuple[Sequence[float], Sequence[float]]:
    """times[base:] and lows[base:] less a bucket of the newest block that an up-step of at least
    `size` fell in: the median already at the new level, the minimum still at the old one, read
    over the part of the bucket before the step, and no bucket after it in the block yet to show
    the step in the floor (mixed#1114: a 2 GiB step 13 s into a bucket under a 1.5-minute
    sawtooth left a minimum 48 MiB above the floor, the newest point of a 2-minute block floor,
    read as growth). Such a bucket's spread (median less minimum) exceeds the usual one by most
    of the step; a ramp's spreads over its buckets by half of one bucket's rise at most. Older
    blocks have the step's next bucket beside it."""
    ts, ls = times[base:], lows[base:]
    n = len(ts)
    if n < 2 or max(map(operator.sub, medians[-block:], medians[-block - 1:-1])) < size:
        return ts, ls  # the usual case: no up-step in the newest block
    spreads = list(map(operator.sub, medians[base:], ls))
    usual = median(spreads)
    drop = {k for k in range(max(1, n - block), n)
            if (up := medians[base + k] - medians[base + k - 1]) >= size and spreads[k] - usual >= 0.75 * up}
    if not drop:
        return ts, ls
    return [t for k, t in enumerate(ts) if k not in drop], [v for k, v in enumerate(ls) if k not in drop]


def _troughs(times: Sequence[float], lows: Sequence[float], base: int, drops: list[float],
             floor_left: float, tooth: float, aliased: bool = False) -> tuple[list[float], list[float]]:
    """One point per tooth of a sawtooth: the least minimum from the bucket of each drop (the
    cache just freed) to the one before the next drop, at the time it occurred. The newest
    tooth's, while younger than a `tooth` period, only once its newest bucket's minimum stands
    `floor_left` above the tooth's least (the cache has grown off its floor): until then its
    floor is still being sampled, and a minimum read over fewer samples than a whole floor's
    stands higher (sawtooth#2004: the newest trough read over two samples, 8 MiB above the floor
    in 2.6 MiB of noise, ended a 23-minute line at z 6.2). With `aliased` (the drops are buckets
    that missed a trough of faster teeth, and each trough a minimum over many teeth), only once
    the tooth is a period old: a bucket's minimum standing off the floor says nothing there, and
    the newest trough, a minimum over fewer teeth, stands higher (sleep_wake#9008: a third of a
    tooth's buckets read 22 MiB above the floor, ending a 31-minute hinge at z 7.5)."""
    ts: list[float] = []
    vs: list[float] = []
    cuts = [bisect.bisect_left(times, d, base) for d in drops]
    for a, b in zip(cuts, cuts[1:] + [len(times)], strict=True):
        if b > a:
            seg = lows[a:b]
            m = min(seg)
            if b == len(times) and times[-1] - times[a] < tooth and (aliased or seg[-1] - m < floor_left):
                break
            ts.append(times[a + seg.index(m)])
            vs.append(m)
    return ts, vs


def _drops(times: Sequence[float], values: Sequence[float], base: int, threshold: float,
           config: LeakConfig) -> list[float]:
    """Times of sharp falls in the recent past; falls split over adjacent points count once."""
    lo = base + 1
    out: list[float] = []
    for i in range(lo, len(values)):
        if values[i - 1] - values[i] >= threshold:
            if out and times[i] - out[-1] <= 150:
                out[-1] = times[i]
            else:
                out.append(times[i])
    return out


def _woke_without_cycles(times: Sequence[float], medians: Sequence[float], lows: Sequence[float], base: int,
                        drop_bytes: float, config: LeakConfig) -> bool:
    """Whether the large up-step at `base` is a wake (it gives back most of a large fall since the
    large up-step before it: weights and KV cache back from sleep) after a stretch with no cycles
    (drops of at least `drop_bytes` that recur), from that earlier up-step to the fall."""
    if base < 2:
        return False
    before = last_large_step(medians[:base], config)
    fall = next((j for j in range(base - 1, before, -1)
                 if _large_step(medians[j - 1] - medians[j], medians[j], config)), None)
    if fall is None:
        return False
    if medians[base] - medians[base - 1] < config.wake_give_back_ratio * (medians[fall - 1] - medians[fall]):
        return False
    return _tooth(_drops(times, lows[:fall], before, drop_bytes, config), times[before], config) is None


def _tooth(drops: list[float], since: float, config: LeakConfig) -> float | None:
    """Typical sawtooth period from the gaps between recurring drops (None: no sawtooth)."""
    if len(drops) < 2:
        return None
    teeth = [b - a for a, b in itertools.pairwise(drops) if b - a <= config.max_tooth_seconds]
    return median(teeth) if teeth else None


def _recent_slope(times: Sequence[float], values: Sequence[float], base: int, config: LeakConfig) -> float | None:
    """Theil–Sen slope over the last slope_window_seconds, never across a large step.

    Thinned to at most 12 evenly spaced points (66 pairs): this runs for every process on every
    bucket, and the slope of 1-min medians loses little from the thinning.
    """
    j = max(base, bisect.bisect_left(times, times[-1] - config.slope_window_seconds))
    n = len(times) - j
    if n < 3:
        return None
    stride = -(-n // 12)
    idx = range(len(times) - 1, j - 1, -stride)
    return theil_sen([times[i] for i in idx][::-1], [values[i] for i in idx][::-1])


def _seconds_to(total_bytes: float, level: float, slope: float | None) -> float | None:
    if slope is None or slope <= 0:
        return None
    return max(0.0, (total_bytes - level) / slope)


def time_to_full(series: SeriesView, total: int | None, now: float, window_seconds: float = 3600,
                 min_points: int = 5, min_z: float = 2.33,
                 config: LeakConfig = DEFAULT_CONFIG) -> float | None:
    """Seconds from `now` until the series reaches `total` at its robust recent slope.

    None when it is not growing: too few points, no significant upward trend (Mann–Kendall,
    one-sided p ~0.01), or a non-positive Theil–Sen slope. Points before the last large up-step
    are ignored, so a start-up ramp does not project a full GPU.
    """
    times, values = series.times, series.values
    if not total or len(times) < min_points:
        return None
    base = last_large_step(values, config)
    j = max(base, bisect.bisect_left(times, times[-1] - window_seconds))
    if len(times) - j < min_points:
        return None
    if mann_kendall(values[j:]).z < min_z:
        return None
    line = theil_sen_line(times[j:], values[j:])
    if line is None or line[0] <= 0:
        return None
    slope, intercept = line
    return _seconds_to(total, intercept + slope * now, slope)


class LeakLatch:
    """Hysteresis for per-process verdicts, for callers that raise and clear findings.

    assess() is a pure function of the history, so a staircase between steps or a leak under a
    sawtooth can pass and fail on consecutive minutes. The latch raises on the first suspected
    verdict and clears only after `clear_after_seconds` without one; a verdict that could not
    judge (LeakAssessment.undecided) holds a raised finding as a suspected one does (leak_4#3: a
    leak's series read as a sawtooth's two troughs for 35 minutes, too few to test, cleared it
    mid-leak). Keys not updated for that long (their processes are gone) are forgotten, so the
    latch stays bounded.
    """

    def __init__(self, clear_after_seconds: float = 1800) -> None:
        self.clear_after_seconds = clear_after_seconds
        self._last_suspected: dict[Hashable, float] = {}

    def update(self, key: Hashable, suspected: bool, now: float, undecided: bool = False) -> bool:
        """Record this tick's verdict for `key` (`undecided`: it could not judge); return whether
        the leak finding is active."""
        if suspected or (undecided and key in self._last_suspected):
            self._last_suspected[key] = now
            return True
        last = self._last_suspected.get(key)
        if last is None:
            return False
        if now - last >= self.clear_after_seconds:
            del self._last_suspected[key]
            return False
        return True

    def prune(self, now: float) -> None:
        """Forget keys whose last suspected verdict is older than the clear-after period."""
        cutoff = now - self.clear_after_seconds
        for key in [k for k, t in self._last_suspected.items() if t <= cutoff]:
            del self._last_suspected[key]

    def __len__(self) -> int:
        return len(self._last_suspected)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last_suspected
