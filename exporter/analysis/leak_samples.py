"""The leak test on a series' raw samples, where that test's assumptions hold.

The per-minute test (leak.py) reads a series through minute buckets: it needs a bucket for each
of a window's points, and a minute's median is floored at NVML's page size where it scatters by
less. A leak of 4-50 MiB/min is significant in its 5 s samples within one to four minutes (the
bench's statistical limit), well before five minute points show it. This test is the limit's own:
a joined line (flat, then growing from an onset in the last `samples_minutes`) fitted by least
squares to the samples, its slope's z against the samples' noise, that noise's correlations
measured on the same samples (trend_test.kappas and wander_fit at sample scale).

It runs only where nothing but noise and a leak can make such a climb (the caller sees to the
rest: a series past its young period, read through its medians, no sawtooth measured):
- noise that does not wander (its correlations measured on the same samples, and, where no jump
  lies between, on those before them back to the last jump);
- no drop among the samples kept (a cache freed, a sawtooth the minute buckets alias, a step
  given back, a sleep): growth after a drop may be climbing back;
- the baseline flat (growth begun before it is the per-minute test's, young rule and all), and
  it begins after the last jump (a level shift) among the samples;
- the climb beats the best single step and is not beaten by the best two steps (a warm-up's
  steps), each by a change point's price, and does not slow down.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .trend import median
from .trend_test import (
    Prefix,
    Wander,
    WindowResult,
    best_hinge,
    best_split,
    best_two_step_rss,
    curvature_z,
    kappa_for,
    kappas,
    robust_sigma,
    wander_fit,
)

if TYPE_CHECKING:
    from .history import SeriesView


class Settings(Protocol):
    """What the test reads of leak.LeakConfig (which says what each means)."""

    @property
    def samples_minutes(self) -> float: ...
    @property
    def samples_baseline_minutes(self) -> float: ...
    @property
    def samples_max(self) -> int: ...
    @property
    def min_noise_bytes(self) -> float: ...
    @property
    def min_shift_bytes(self) -> float: ...
    @property
    def min_slope_bytes_per_second(self) -> float: ...
    @property
    def min_growth_bytes(self) -> float: ...
    @property
    def min_step_margin(self) -> float: ...
    @property
    def two_step_penalty(self) -> float: ...
    @property
    def max_concavity_z(self) -> float: ...


# Block sizes (samples) at which the samples' correlations are measured.
SAMPLE_SCALES = (2, 4, 8, 16, 32, 64)
# A sample further than this many noise deviations from the median of the 7 around it is a
# transient (a batch's activations for one sample) and read as that median.
SPIKE_SIGMAS = 6.0
# A jump or fall of at least max(min_shift_bytes, this x noise) between the medians of the three
# samples on either side is a level shift (a jump) or a release (a drop), not a climb.
JUMP_SIGMAS = 6.0
# The lags (samples) at which medians_wander reads how the samples wander.
WANDER_LAGS = (1, 2, 4, 8, 16, 32)
# The samples' test is for noise that does not wander: none measured at their lags (wander_fit)
# and the block estimates' kappa at most this (white noise reads up to about 4 at 64 samples;
# the corpus's wandering noise 100 and more).
MAX_KAPPA = 8.0
# A climb is looked for between the medians' minutes only where the newest half minute's median
# stands this many noise deviations above the samples of RISING_SECONDS before it.
RISING_SIGMAS = 3.0
RISING_SECONDS = 330.0
# The baseline's own slope, in z, above which growth began before it.
FLAT_BASELINE_Z = 3.0


@dataclass(frozen=True)
class SampleClimb:
    """A climb the samples show: the joined line's fit (WindowResult over the samples' Prefix,
    in bytes per minute), the noise it was judged against and the z it had to reach."""

    fit: WindowResult
    seconds: float  # from the onset to the newest sample
    growth: float
    sigma: float
    threshold: float


def onsets(config: Settings, interval_seconds: float) -> int:
    """How many onsets a test scans (for its share of the false-alarm budget)."""
    return max(1, round(60 * config.samples_minutes / interval_seconds))


def climb(raw: SeriesView, since: float, config: Settings,
          threshold_of: Callable[[int], float]) -> SampleClimb | str:
    """The climb in the raw samples since `since` (a SampleClimb), or why there is none.
    `threshold_of(onsets)` is the z a test over that many onsets must reach."""
    times, values = raw.times, raw.values
    if not times:
        return "too_few_samples"
    baseline = 60 * config.samples_baseline_minutes
    fit_from = times[-1] - 60 * config.samples_minutes - baseline  # the onsets scanned and their baseline
    if not _grown(values, bisect.bisect_left(times, fit_from)):
        return "not_rising"
    a = max(bisect.bisect_left(times, since), len(times) - config.samples_max)
    n = len(times) - a
    if n < 24 or times[-1] - times[a] < baseline + 60:
        return "too_few_samples"
    interval = (times[-1] - times[a]) / (n - 1)
    times, values = times[a:], values[a:]
    sigma = robust_sigma(values, config.min_noise_bytes / 2)
    shift = max(config.min_shift_bytes, JUMP_SIGMAS * sigma)
    changes = _changes(values)
    if min(changes, default=0.0) <= -shift:
        return "a_drop_in_the_samples"
    # The baseline begins after the last jump (a minute on: the new level settles).
    last = _last_jump(changes, shift)
    settled = bisect.bisect_left(times, times[last] + 60) if last else 0
    if n - settled < 24 or times[-1] - times[min(settled, n - 1)] < baseline + 60:
        return "too_few_samples"
    # The line is fitted to the newest samples (the onsets scanned and their baseline), first
    # as if the noise were white: that z is the highest the noise's correlations allow, and
    # most minutes it is short of the threshold.
    start = max(settled, bisect.bisect_left(times, fit_from))
    times, ys = times[start:], despiked(values[start:], SPIKE_SIGMAS * sigma)
    n = len(times)
    prefix = Prefix(times, ys)
    first = max(bisect.bisect_left(times, times[0] + baseline), n - onsets(config, interval))
    last_onset = n - max(3, round(30 / interval))  # half a minute of growth at least
    if first >= last_onset:
        return "too_few_samples"
    threshold = threshold_of(onsets(config, interval))
    h = best_hinge(prefix, 0, range(first, last_onset), sigma, lambda points: 1.0, 5)
    if h is None or h.z < threshold:
        return "trend_not_significant"
    # The noise's correlations, measured on every sample since the last jump.
    quiet = prefix if settled == start else \
        Prefix(raw.times[a + settled:], despiked(values[settled:], SPIKE_SIGMAS * sigma))
    table = kappas(quiet, 0, sigma, SAMPLE_SCALES)
    if _wanders(quiet, table):
        return "noise_wanders"  # the per-minute test's, whose blocks reach its longer memory
    # Without a jump since `since`, the samples before it since the last jump show the memory
    # too: ten minutes after the young period are too few for blocks of a memory of several
    # (correlated#9012 at +50 s: 6 minutes, a climb at z 13.6). Only to refuse: the slope's
    # inflation stays the one read on the samples fitted.
    if not last and a > 0:
        w = max(0, len(raw.times) - config.samples_max)
        jump = _last_jump(_changes(raw.values[w:]), shift)  # over the boundary at `a` too
        b = bisect.bisect_left(raw.times, raw.times[w + jump] + 60) if jump else w
        if a - b >= 24:
            longer = Prefix(raw.times[b:], despiked(raw.values[b:], SPIKE_SIGMAS * sigma))
            if _wanders(longer, kappas(longer, 0, sigma, SAMPLE_SCALES)):
                return "noise_wanders"
    kappa = kappa_for(n, table, None, sigma)
    h = best_hinge(prefix, 0, range(first, last_onset), sigma, lambda points: kappa, 5)
    if h is None or h.z < threshold:
        return "trend_not_significant"
    minutes = prefix.u[-1] - prefix.u[h.onset]
    growth = h.slope * minutes
    if h.slope < config.min_slope_bytes_per_second * 60 or growth < config.min_growth_bytes:
        return "growth_too_small"
    before = prefix.line(0, h.onset)
    if before[3] > 0 and before[0] / (sigma * math.sqrt(kappa / before[3])) > FLAT_BASELINE_Z:
        return "growing_before"
    noise = sigma * sigma
    price = max(config.min_step_margin, 2.0 * math.log(n))
    one, split = best_split(prefix, 0, n)
    if (one - h.rss) / noise < price:
        return "a_step"
    if (h.rss - best_two_step_rss(prefix, 0, n, split)) / noise > config.two_step_penalty * math.log(n):
        return "steps"
    if curvature_z(prefix, h.onset, n, sigma * math.sqrt(h.kappa)) < -config.max_concavity_z:
        return "decelerating"
    return SampleClimb(h, 60 * minutes, growth, sigma, threshold)


def medians_wander(samples: SeriesView, config: Settings) -> tuple[Wander, int] | None:
    """How the noise of these samples (the newest samples_max) wanders, carried to their minute
    medians: the Wander model and the minutes it rests on; None where it does not wander.

    A series' first hour has too few minute medians for their own blocks and lags to see noise
    with a memory of minutes (correlated#10010: 25 medians since settling, noise of 9 MiB with a
    4-minute memory read as 2 MiB of white noise, and its wander passed for a 7-minute line at
    z 13.4), where the samples, twelve times as many, show it at their lags. Where the fit's
    memory is as long as the lags can show, it may be longer: the samples' spread then says how
    far the noise wanders, and the fit how fast it moves (the variance of its innovations, which
    the short lags read). The spread is read about the better of a line and a joined line (flat,
    then growing from at least a quarter of the samples on): about a line, a leak's own ramp read
    as wander (correlated#114: a 4 MiB/min leak found 25 minutes later)."""
    times, values = samples.times[-config.samples_max:], samples.values[-config.samples_max:]
    n = len(times)
    if n < 48 or times[-1] <= times[0]:
        return None
    prefix = Prefix(times, despiked(values, SPIKE_SIGMAS * robust_sigma(values, config.min_noise_bytes / 2)))
    fit = wander_fit(prefix, 0, WANDER_LAGS)
    if fit is None:
        return None
    var, rho = fit.var, fit.rho
    if fit.bounded:
        rss = prefix.line(0, n)[4]
        joined = best_hinge(prefix, 0, range(n // 4, n - 12, 6), 1.0, lambda points: 1.0, 5)
        spread = min(rss, joined.rss if joined else rss) / (n - 3) - fit.white
        if spread > var:
            var, rho = spread, math.sqrt(max(0.0, 1.0 - var * (1.0 - rho * rho) / spread))
    per_minute = 60.0 * (n - 1) / (times[-1] - times[0])
    return Wander(fit.white, var, rho).medians(per_minute), max(1, round(n / per_minute))


def _changes(values: Sequence[float]) -> list[float]:
    """Level changes between the medians of the three samples on either side (one sample's
    noise, or a spike, is no change): k, the three from k + 3 on less those before."""
    m3 = [x + y + z - max(x, y, z) - min(x, y, z)
          for x, y, z in zip(values[:-2], values[1:-1], values[2:], strict=True)]
    return list(map(operator.sub, m3[3:], m3[:-3]))


def _last_jump(changes: Sequence[float], shift: float) -> int:
    """The sample after the last jump (0: none). A jump stands out from the changes six samples
    before and after it; a climb fast enough to change the level by as much over three samples
    goes on changing it so. (One too new to tell is left to the step models.)"""
    return max((k + 3 for k, c in enumerate(changes[:-6]) if c >= shift and all(
        c - changes[j] >= shift / 2 for j in (k - 6, k + 6) if j >= 0)), default=0)


def _wanders(quiet: Prefix, table: list[tuple[int, float]]) -> bool:
    """Whether the noise of these samples wanders: a Wander model fits them, or their blocks'
    kappa passes MAX_KAPPA."""
    return wander_fit(quiet, 0) is not None or max((k for _, k in table), default=1.0) > MAX_KAPPA


def rising(raw: SeriesView, min_sigma: float, newest: int = 6, gap: int = 12) -> bool:
    """A look cheap enough for every tick, at the raw samples of the last RISING_SECONDS: whether
    the median of the newest half minute stands RISING_SIGMAS noise deviations above the mean of
    the samples up to a minute before it (the noise read from the first differences, blind to a
    climb, a spike only two of them; never below `min_sigma`: whole pages tie)."""
    values = raw.values
    base = values[:-newest - gap]
    if len(base) < 24:
        return False
    steps: list[float] = sorted(map(abs, map(operator.sub, values[1:], values[:-1])))
    sigma = max(steps[len(steps) // 2] / (0.6745 * math.sqrt(2.0)), min_sigma)  # |N(0, 2 s^2)|'s median
    return float(median(values[-newest:])) - math.fsum(base) / len(base) >= RISING_SIGMAS * sigma


def _grown(values: Sequence[float], window: int, newest: int = 12) -> bool:
    """A cheap look before the fits, which most minutes need not make: whether the mean of the
    newest minute stands above that of the first minute from `window` (the onsets' baseline) by
    twice its error, as it does long before the joined line's slope reaches its threshold."""
    if len(values) - window < 2 * newest:
        return False
    base = values[window:window + newest]
    rise = (math.fsum(values[-newest:]) - math.fsum(base)) / newest
    return rise >= 2.0 * robust_sigma(base, 1.0) * math.sqrt(2 / newest)


def despiked(values: Sequence[float], limit: float, half: int = 3) -> list[float]:
    """`values`, each one further than `limit` from the median of the 2 half + 1 around it
    replaced by that median."""
    out = list(values)
    for i, v in enumerate(values):
        around = median(values[max(0, i - half):i + half + 1])
        if abs(v - around) > limit:
            out[i] = around
    return out
