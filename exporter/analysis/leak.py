"""Leak detector: is this process's memory growing the way a leak grows?

Input is History's per-minute tier. A leak is memory that never comes back, so the detector
tests the *floor* of the series (per-minute minima, then the minimum per sub-window): a
sawtooth from an allocator caching and freeing keeps a flat floor, growth hidden under it
lifts the floor.

Suspected when, for some window length W (8 min ... 5 h 20 min, shortest first), all hold:
  1. the window lies wholly after the settling period that follows the last large up-step
     (weights load, KV cache preallocation, a second model), so start-up is never judged,
     whenever it happens, with no fixed grace period after start;
  2. the floor rises in every one of `blocks` consecutive sub-windows, each rise above the
     floor's noise, the rises are of comparable size (one or two steps are no trend) and do
     not shrink (an allocator warming up decelerates, a leak keeps its pace) — also compared
     with the sub-windows just before the window;
  3. when the series has a sawtooth (recurring drops), sub-windows are longer than a tooth, so
     a tooth's ramp is never mistaken for a leak;
  4. the latest floor is above every earlier floor since the last large step (growth that
     merely returns to a level seen before is no leak);
  5. Mann–Kendall on the (binned) floor is significant (p < 0.001) and the Theil–Sen slope and
     the growth over the window exceed small absolute minimums.

Fast leaks pass at short windows, slow ones once a long window shows enough growth, so the
delay scales with the leak rate instead of being one fixed `for:` duration. assess() is pure;
LeakLatch adds the hysteresis a caller raising and clearing findings needs.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .history import SeriesView
from .trend import mad, mann_kendall, median, theil_sen, theil_sen_line

MiB = 1024 * 1024
GiB = 1024 * MiB

Evidence = tuple[tuple[str, float | int | str], ...]


@dataclass(frozen=True)
class LeakConfig:
    # Window lengths tried, shortest first; each needs that much settled history.
    windows_seconds: tuple[float, ...] = tuple(
        60.0 * m for m in (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                           160, 192, 224, 256, 320))
    # Sub-windows whose floors must each rise: the trend has to persist, not be one step.
    blocks: int = 4
    # Points per window fed to Mann–Kendall/Theil–Sen (longer windows are binned by minimum).
    max_bins: int = 32
    # Fewest points a window may have.
    min_points: int = 6
    # An up-step of at least this many bytes *and* this fraction of the level before it starts a
    # new settling period (start-up ramp, KV cache preallocation, model reload).
    large_step_bytes: float = 1 * GiB
    large_step_fraction: float = 0.25
    # How long after a large step the series is left alone (CUDA graph capture, first warm-up).
    settle_seconds: float = 600
    # Mann–Kendall z the floor series must reach (3.09 = one-sided p 0.001).
    min_z: float = 3.09
    # The floor must grow at least this much over the window ...
    min_growth_bytes: float = 32 * MiB
    # ... at a robust slope of at least this (0.25 MiB/min).
    min_slope_bytes_per_second: float = 0.25 * MiB / 60
    # Each sub-window's floor must exceed the previous one by max(min_step, noise_factor x noise).
    min_step_bytes: float = 2 * MiB
    noise_factor: float = 3.0
    # The last sub-window's rise must be at least this fraction of the first's (no plateauing),
    # and the smallest rise at least this fraction of the largest (one or two steps are no trend).
    min_rise_ratio: float = 0.5
    min_rise_balance: float = 0.3
    # The floor's median rate of rise must be at least this fraction of its median rate over the
    # sub-windows just before the window (settling period included).
    min_pace_ratio: float = 0.7
    # A fall between consecutive points of at least max(min_drop_bytes, drop_noise_factor x
    # noise) is a "drop" (a cache being freed). When drops recur, a rising stretch is likely just
    # the next tooth of a sawtooth: sub-windows must then be at least 1.25 x the median tooth
    # (gaps over max_tooth_seconds are no sawtooth), so their floors sit on the troughs.
    min_drop_bytes: float = 16 * MiB
    drop_noise_factor: float = 4.0
    max_tooth_seconds: float = 1800
    drop_lookback_seconds: float = 7200
    # Window of the slope reported when no leak is suspected.
    slope_window_seconds: float = 1800
    # No verdict on a series whose newest point is older than this (process gone or not sampled).
    stale_seconds: float = 300


@dataclass(frozen=True)
class LeakAssessment:
    suspected: bool
    slope_bytes_per_second: float | None  # robust (Theil–Sen) slope; None if too few points
    evidence: Evidence = ()


DEFAULT_CONFIG = LeakConfig()


def assess(series: SeriesView, total_bytes: int | None, now: float,
           config: LeakConfig = DEFAULT_CONFIG) -> LeakAssessment:
    """Assess one series (History's per-minute tier) for leak-like growth, causally at `now`.

    The verdict depends only on the series and `total_bytes` (for the time-to-full evidence);
    `now` only withholds a verdict on a stale series. Reported slope: Theil–Sen of the floor
    over the window that matched, else over the last slope_window_seconds.
    """
    times = series.times
    if times and now - times[-1] > config.stale_seconds:
        return LeakAssessment(False, None, (("reason", "stale"),))
    return verdict(series, total_bytes, config)


class LeakAssessor:
    """assess() that keeps each series' last verdict, for a caller assessing the same series
    every tick: History hands out the same tier view until the series' next bucket closes, so
    all but about one tick a minute reuse it. Keys not assessed between two prune() calls are
    forgotten, so it holds only the series still asked about."""

    def __init__(self) -> None:
        # key -> (view, total_bytes, config, verdict)
        self._kept: dict[Hashable, tuple[SeriesView, int | None, LeakConfig, LeakAssessment]] = {}
        self._asked: dict[Hashable, tuple[SeriesView, int | None, LeakConfig, LeakAssessment]] = {}

    def __call__(self, key: Hashable, series: SeriesView, total_bytes: int | None, now: float,
                 config: LeakConfig = DEFAULT_CONFIG) -> LeakAssessment:
        times = series.times
        if times and now - times[-1] > config.stale_seconds:
            return assess(series, total_bytes, now, config)  # no verdict on a stale series
        kept = self._kept.get(key) or self._asked.get(key)
        if kept is not None and kept[0] is series and kept[1] == total_bytes and \
                (kept[2] is config or kept[2] == config):
            result = kept[3]
        else:
            result = verdict(series, total_bytes, config)
        self._asked[key] = (series, total_bytes, config, result)
        return result

    def prune(self) -> None:
        self._kept, self._asked = self._asked, {}


def last_large_step(values: tuple[float, ...] | list[float], config: LeakConfig = DEFAULT_CONFIG) -> int:
    """Index of the first point after the last large up-step (0 when there is none)."""
    for i in range(len(values) - 1, 0, -1):
        jump = values[i] - values[i - 1]
        if jump >= config.large_step_bytes and jump >= config.large_step_fraction * values[i - 1]:
            return i
    return 0


def verdict(series: SeriesView, total_bytes: int | None,
            config: LeakConfig = DEFAULT_CONFIG) -> LeakAssessment:
    """assess() without the staleness check: a function of the series' points alone, so a
    caller may keep it for as long as it holds the same SeriesView."""
    times = series.times
    # The floor: bucket minima when History provides them, else the values themselves.
    values = series.lows if len(series.lows) == len(times) else series.values
    n = len(times)
    if n < config.min_points:
        return LeakAssessment(False, None, (("reason", "too_few_points"), ("points", n)))
    base = last_large_step(values, config)
    end = times[-1]
    slope = _recent_slope(times, values, base, config)
    settled_from = times[base] + config.settle_seconds
    if end - config.windows_seconds[0] < settled_from:
        return LeakAssessment(False, slope, (("reason", "settling"), ("settled_at", settled_from)))
    noise = _noise(values, base)
    drops = _drops(times, values, base, max(config.min_drop_bytes, config.drop_noise_factor * noise),
                   config)
    tooth = _tooth(drops, times[base], config)
    why = "no_window"
    for window in config.windows_seconds:
        start = end - window
        if start < settled_from:
            break  # longer windows reach even further back into the settling period
        if tooth is not None and window / config.blocks < tooth:
            # Sub-windows shorter than a tooth: only a rise outlasting every tooth counts.
            last_drop = drops[-1] if drops else times[base]
            if last_drop > start or end - last_drop < 1.5 * tooth:
                why = "sawtooth"
                continue
        hit = _window_test(times, values, base, settled_from, start, window, noise, config)
        if isinstance(hit, str):
            why = hit
        else:
            w_slope, evidence = hit
            evidence = (("window_seconds", window),) + evidence
            if tooth is not None:
                evidence += (("sawtooth_period_seconds", round(tooth)),)
            if total_bytes:
                ttf = _seconds_to(total_bytes, values[-1], w_slope)
                if ttf is not None:
                    evidence += (("time_to_full_seconds", round(ttf, 1)),)
            return LeakAssessment(True, w_slope, evidence)
    # The reason the longest window tried gave for not suspecting a leak.
    return LeakAssessment(False, slope, (("reason", why),))


def _noise(values: Sequence[float], base: int) -> float:
    """Robust sigma of point-to-point noise since the last large step.

    The smaller of two estimates: the MAD of first differences (blind to a steady climb) and
    each point's distance to the median of it and its neighbours (zero wherever the series is
    locally monotone, so blind to a sawtooth's ramps; 0.316 sigma for white noise).
    """
    diffs = [values[i] - values[i - 1] for i in range(base + 1, len(values))]
    if len(diffs) < 3:
        return 0.0
    res = []
    for i in range(base + 1, len(values) - 1):
        a, b, c = values[i - 1], values[i], values[i + 1]
        res.append(abs(b - (a if (a - b) * (a - c) <= 0 else (c if (c - a) * (c - b) <= 0 else b))))
    return min(1.4826 * mad(diffs) / math.sqrt(2.0), median(res) / 0.316)


def _drops(times: Sequence[float], values: Sequence[float], base: int, threshold: float,
           config: LeakConfig) -> list[float]:
    """Times of sharp falls in the recent past; falls split over adjacent points count once."""
    lo = max(base + 1, bisect.bisect_left(times, times[-1] - config.drop_lookback_seconds))
    out: list[float] = []
    for i in range(lo, len(values)):
        if values[i - 1] - values[i] >= threshold:
            if out and times[i] - out[-1] <= 150:
                out[-1] = times[i]
            else:
                out.append(times[i])
    return out


def _tooth(drops: list[float], since: float, config: LeakConfig) -> float | None:
    """Typical sawtooth period with some slack, from the gaps between drops (None: no sawtooth)."""
    if not drops:
        return None
    edges = drops if len(drops) > 1 else [since] + drops
    teeth = [b - a for a, b in itertools.pairwise(edges) if b - a <= config.max_tooth_seconds]
    return 1.25 * median(teeth) if teeth else None


def _recent_slope(times: Sequence[float], values: Sequence[float], base: int, config: LeakConfig) -> float | None:
    """Theil–Sen slope over the last slope_window_seconds, never across a large step.

    Thinned to at most 16 evenly spaced points (120 pairs): this runs for every process on every
    bucket, and the slope of 1-min medians loses little from the thinning.
    """
    j = max(base, bisect.bisect_left(times, times[-1] - config.slope_window_seconds))
    n = len(times) - j
    if n < 3:
        return None
    stride = -(-n // 16)
    idx = range(len(times) - 1, j - 1, -stride)
    return theil_sen([times[i] for i in idx][::-1], [values[i] for i in idx][::-1])


def _floor(values: Sequence[float], lo: int, hi: int) -> float | None:
    return min(values[lo:hi]) if hi > lo else None


def _window_test(times: Sequence[float], values: Sequence[float], base: int, settled_from: float,
                 start: float, window: float, noise: float,
                 config: LeakConfig) -> str | tuple[float, Evidence]:
    """The persistent-floor-growth test on [start, end]: (slope, evidence), or why not."""
    n = len(times)
    j = bisect.bisect_left(times, start)
    if n - j < max(config.min_points, 2 * config.blocks):
        return "too_few_points"
    span = window / config.blocks
    edges = [bisect.bisect_left(times, start + k * span, j) for k in range(config.blocks)] + [n]
    floors: list[float] = []
    for k in range(config.blocks):
        f = _floor(values, edges[k], edges[k + 1])
        if f is None:
            return "sampling_gap"  # not enough evidence
        floors.append(f)
    rises = [floors[k + 1] - floors[k] for k in range(config.blocks - 1)]
    # Cheap tests first: most series fail here.
    if min(rises) < config.min_step_bytes:
        return "floor_not_rising_throughout"
    growth = floors[-1] - floors[0]
    if growth < config.min_growth_bytes:
        return "growth_too_small"
    if min(rises) < config.min_rise_balance * max(rises):
        return "uneven_rises"  # a step or two, not a steady climb
    if rises[-1] < config.min_rise_ratio * rises[0]:
        return "decelerating"
    # Floors of the earlier sub-windows of the same length back to the last large step, most
    # recent first, as (start time, floor or None when unsampled). The oldest may be cut short
    # by the step (kept if at least a quarter long); the first two minutes after the step (CUDA
    # graph capture finishing) are left out.
    earlier: list[tuple[float, float | None]] = []
    first_t = times[base] + 120
    first = bisect.bisect_left(times, first_t, base)
    hi = j
    k = 1
    while hi > first:
        lo_t = start - k * span
        if lo_t < first_t:
            if start - (k - 1) * span - first_t < span / 4:
                break
            lo_t = first_t
        lo = bisect.bisect_left(times, lo_t, first, hi)
        earlier.append((lo_t, _floor(values, lo, hi)))
        hi = lo
        k += 1
    # Noise of the floor at this sub-window length, from the settled floors' second differences
    # (blind to a steady trend and to the onset of one; the MAD ignores the odd step). Too few
    # floors: the series' point-to-point noise.
    settled = [f for t, f in earlier[:4 * config.blocks] if t >= settled_from and f is not None]
    seq = settled[::-1] + floors
    if len(seq) >= 8:
        d2 = [seq[i + 1] - 2 * seq[i] + seq[i - 1] for i in range(1, len(seq) - 1)]
        noise = 1.4826 * mad(d2) / math.sqrt(6.0)
    margin = max(config.min_step_bytes, config.noise_factor * noise)
    if min(rises) < margin:
        return "floor_not_rising_throughout"
    # Growth that only returns to a floor seen before (since the last large step) is no leak.
    if any(f is not None and f + margin > floors[-1] for _, f in earlier):
        return "not_above_earlier_level"
    # An allocator warming up decelerates; a leak keeps its pace. Compare the median rate of
    # rise between sub-windows with that over the sub-windows just before, settling period
    # included (medians: one step there does not count as pace).
    recent = earlier[:config.blocks]
    known = [(t, f) for t, f in recent if f is not None]
    if recent and len(known) == len(recent):
        chain = known[::-1] + [(start, floors[0])]
        before = median([(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(chain)])
        if median(rises) / span < config.min_pace_ratio * before:
            return "slower_than_before"
    bt, bv = _binned_floor(times, values, j, start, window, config.max_bins)
    mk = mann_kendall(bv)
    if mk.z < config.min_z:
        return "trend_not_significant"
    slope = theil_sen(bt, bv)
    if slope is None or slope < config.min_slope_bytes_per_second:
        return "slope_too_small"
    evidence: Evidence = (
        ("slope_bytes_per_second", round(slope, 3)),
        ("growth_bytes", int(growth)),
        ("mann_kendall_z", round(mk.z, 2)),
        ("mann_kendall_p", float(f"{mk.p_increasing:.3g}")),
        ("points", n - j),
        ("noise_bytes", int(noise)),
    )
    return slope, evidence


def _binned_floor(times: Sequence[float], values: Sequence[float], j: int, start: float,
                  window: float, max_bins: int) -> tuple[Sequence[float], Sequence[float]]:
    """At most max_bins points: the minimum of each equal-time bin, at the time it occurred."""
    if len(times) - j <= max_bins:
        return times[j:], values[j:]
    width = window / max_bins
    bt: list[float] = []
    bv: list[float] = []
    cur = -1
    for i in range(j, len(times)):
        b = min(int((times[i] - start) / width), max_bins - 1)
        if b != cur:
            bt.append(times[i])
            bv.append(values[i])
            cur = b
        elif values[i] < bv[-1]:
            bt[-1] = times[i]
            bv[-1] = values[i]
    return bt, bv


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
    verdict and clears only after `clear_after_seconds` without one. Keys not updated for that
    long (their processes are gone) are forgotten, so the latch stays bounded.
    """

    def __init__(self, clear_after_seconds: float = 1800) -> None:
        self.clear_after_seconds = clear_after_seconds
        self._last_suspected: dict[Hashable, float] = {}

    def update(self, key: Hashable, suspected: bool, now: float) -> bool:
        """Record this tick's verdict for `key`; return whether the leak finding is active."""
        if suspected:
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
