"""A sequential test for a linear trend in a noisy series, with explicit non-trend models.

The leak detector (leak.py) asks, once a minute, whether the series' newest stretch grows
like a straight line. A straight line of rate r in noise of deviation sigma, sampled every dt,
is told apart from no trend by its least-squares slope, whose standard error over a window of
T seconds is sigma * sqrt(12 * dt / T^3): the slope's z = r / se grows as T^1.5. Testing every
window length ending now, every minute, is a sequential test (a scan over the onset): it fires
at the first minute some window's z reaches the threshold, so a fast leak is found within
minutes and a slow one once a long enough window has accumulated, without one fixed `for:`.

Three things keep it honest on real memory series:
  * Correlated noise. The slope's standard error is inflated by kappa(b), the ratio of the
    noise variance of b-point block means to what white noise would give (b * sigma_b^2 /
    sigma_1^2), measured on the series itself at several block sizes (an Allan-variance style
    estimate from second differences, blind to a linear trend); a window uses the largest
    kappa at the block sizes up to a quarter of its length. Where the variances of second
    differences rise clearly with their lag, an AR(1) model fitted to them (Wander) gives the
    exact inflation for every window length, which the blocks cannot reach on a young series or
    a long window; the larger of the two is used.
  * Steps. A level shift inside a window makes a significant slope; the line must fit
    clearly better than one step (two levels, the point that straddles the step left out), and
    two steps (three levels) must not fit clearly better than the line (by the information
    criterion's penalty for the steps' extra parameters), the steps fitted
    with the line's intercept per segment where level shifts were taken out.
  * Warm-up. An allocator warming up decelerates; a quadratic term significantly negative
    (the growth slowing down) is no leak.

All arithmetic is on prefix sums (O(1) per window) in builtins (itertools.accumulate, map),
so a series of a few hundred points costs tens of microseconds.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from statistics import NormalDist

from .trend import MAD_SIGMA, mad, median

_SQRT6 = math.sqrt(6.0)  # a second difference of white noise has deviation sqrt(6) sigma
# robust_sigma's reading of a heavy tail: the quantile of the differences' spread, where a
# normal's stands _Z_TAIL deviations out.
TAIL_QUANTILE = 0.9
_Z_TAIL = NormalDist().inv_cdf(0.5 + TAIL_QUANTILE / 2)
HEAVY_TAIL_RATIO = 2.0


# Fewer second differences than this are read about 0 as well as about their median (robust_sigma).
FEW_DIFFERENCES = 16


def robust_sigma(values: Sequence[float], min_sigma: float = 0.0, heavy_tails: bool = False) -> float:
    """Deviation of white noise from the series' second differences (MAD, so a step or a kink
    counts as one outlier; blind to a linear trend). `min_sigma` with fewer than 3 second
    differences, and never less (values rounded to whole pages tie, and their MAD can be 0).
    With fewer than FEW_DIFFERENCES differences, the larger of that and their median size about 0.

    With `heavy_tails`, where the differences' 90th percentile stands more than HEAVY_TAIL_RATIO
    times above a normal's of that MAD, the deviation that percentile gives: a median reads the
    core of a mixture only. (A sawtooth's cache grows in 20 MiB segments; its floor, read where a
    sample fell in a tooth's first segment or did not, scatters between levels a segment apart,
    and a few minima read a segment up pass for growth in the core's noise: probed_mixed#8000.)
    Normal noise reads past the ratio in 1.3 % of series of 10 differences (3 % before the reading
    about 0), 0.03 % of 40 (4000 draws each)."""
    if len(values) < 5:
        return min_sigma
    d2 = list(map(operator.sub, map(operator.sub, values[2:], values[1:-1]),
                  map(operator.sub, values[1:-1], values[:-2])))
    sigma = MAD_SIGMA * mad(d2) / _SQRT6
    if len(d2) < FEW_DIFFERENCES:
        # Few differences: their median strays from 0, where a series without curvature centres
        # them, and a deviation read about it reads low (sawtooth#10008: troughs 0, -16, -8, -24,
        # -22, -6, -14, -2, 4 MiB, whose second differences alternate in sign about a median of 14,
        # read as 6.1 MiB of noise where they scatter by about 12). On white noise the MAD about
        # the median alone is 0.90 of the deviation in the median draw of 9 points
        # (tests/test_trend_test.py).
        sigma = max(sigma, MAD_SIGMA * median([abs(d) for d in d2]) / _SQRT6)
    if heavy_tails:
        centre = median(d2)
        spread = sorted(abs(d - centre) for d in d2)
        tail = spread[int(TAIL_QUANTILE * (len(spread) - 1))] / (_Z_TAIL * _SQRT6)
        if tail > HEAVY_TAIL_RATIO * sigma:
            sigma = tail
    return max(min_sigma, sigma)


def threshold_z(false_alarms_per_day: float, tests_per_day: float) -> float:
    """One-sided z a test must reach so that `tests_per_day` tests raise at most
    `false_alarms_per_day` false alarms a day under the noise model (Bonferroni: a bound, the
    tests overlap so the actual rate is lower)."""
    p = min(0.5, false_alarms_per_day / max(1.0, tests_per_day))
    return NormalDist().inv_cdf(1.0 - p)


class Prefix:
    """Prefix sums of u (minutes from the first point), y (bytes from the first point), u^2,
    y^2 and u*y over a point series: any window's least squares in O(1).

    `cuts` are the points where a new segment begins (a level shift taken out of the series):
    a fit across them gives each segment its own intercept (fixed effects), so the slope is
    read only from growth within the segments, whatever the shifts' sizes."""

    __slots__ = ("cuts", "su", "suu", "suy", "sy", "syy", "u", "y")

    def __init__(self, times: Sequence[float], values: Sequence[float], cuts: Sequence[int] = ()):
        t0, y0 = times[0], values[0]
        u = [(t - t0) / 60.0 for t in times]
        y = [v - y0 for v in values]
        self.u, self.y = u, y
        self.cuts = sorted(cuts)
        self.su: list[float] = [0.0, *accumulate(u)]
        self.sy: list[float] = [0.0, *accumulate(y)]
        self.suu: list[float] = [0.0, *accumulate(map(operator.mul, u, u))]
        self.syy: list[float] = [0.0, *accumulate(map(operator.mul, y, y))]
        self.suy: list[float] = [0.0, *accumulate(map(operator.mul, u, y))]

    def pieces(self, i: int, j: int) -> list[tuple[int, int]]:
        """[i, j) split at the cuts inside it."""
        cuts = self.cuts
        if not cuts:
            return [(i, j)]
        lo = bisect.bisect_right(cuts, i)
        hi = bisect.bisect_left(cuts, j)
        edges = [i, *cuts[lo:hi], j]
        return list(itertools.pairwise(edges))

    def line(self, i: int, j: int) -> tuple[float, float, float, float, float]:
        """Least squares over points [i, j), an intercept per segment: (slope per minute, mean u
        and mean y of the last segment, Sxx, RSS)."""
        if not self.cuts:  # the common case, without the loop
            n = j - i
            su = self.su[j] - self.su[i]
            sy = self.sy[j] - self.sy[i]
            sxx = (self.suu[j] - self.suu[i]) - su * su / n
            sxy = (self.suy[j] - self.suy[i]) - su * sy / n
            syy = (self.syy[j] - self.syy[i]) - sy * sy / n
            if sxx <= 0:
                return 0.0, su / n, sy / n, 0.0, max(0.0, syy)
            slope = sxy / sxx
            return slope, su / n, sy / n, sxx, max(0.0, syy - slope * sxy)
        sxx = sxy = syy = 0.0
        su_, suu_, suy_, sy_, syy_ = self.su, self.suu, self.suy, self.sy, self.syy
        mu = my = 0.0
        for a, b in self.pieces(i, j):
            n = b - a
            su = su_[b] - su_[a]
            sy = sy_[b] - sy_[a]
            sxx += (suu_[b] - suu_[a]) - su * su / n
            sxy += (suy_[b] - suy_[a]) - su * sy / n
            syy += (syy_[b] - syy_[a]) - sy * sy / n
            mu, my = su / n, sy / n
        if sxx <= 0:
            return 0.0, mu, my, 0.0, max(0.0, syy)
        slope = sxy / sxx
        return slope, mu, my, sxx, max(0.0, syy - slope * sxy)

    def level_rss(self, i: int, j: int) -> float:
        """Residual sum of squares of a constant fitted to points [i, j)."""
        n = j - i
        if n <= 1:
            return 0.0
        sy = self.sy[j] - self.sy[i]
        return max(0.0, (self.syy[j] - self.syy[i]) - sy * sy / n)

    def mean(self, i: int, j: int) -> float:
        return (self.sy[j] - self.sy[i]) / (j - i)


def kappas(prefix: Prefix, start: int, sigma1: float, scales: Sequence[int],
           min_blocks: int = 8) -> list[tuple[int, float]]:
    """(block size b, kappa_b) for the block sizes the points from `start` on allow: kappa_b is
    b * sigma_b^2 / sigma_1^2, sigma_b the white-noise deviation of b-point block means from
    their second differences (blocks taken at every quarter-block offset, so the estimate rests
    on four times as many differences as disjoint blocks give). 1 for white noise, above 1
    where the noise wanders (its low frequencies are what a long window's slope sees)."""
    n = len(prefix.y)
    out: list[tuple[int, float]] = []
    if sigma1 <= 0:
        return out
    sy = prefix.sy
    for b in scales:
        if (n - start) // b < min_blocks:
            break
        stride = max(1, b // 4)
        # Means of the blocks ending at n, n - stride, ...: block k ends at n - k * stride.
        ends = range(n, start + b - 1, -stride)
        means = [(sy[e] - sy[e - b]) / b for e in ends]
        step = b // stride  # blocks apart that are adjacent
        d2 = [means[k] - 2 * means[k + step] + means[k + 2 * step] for k in range(len(means) - 2 * step)]
        sb = MAD_SIGMA * mad(d2) / _SQRT6
        out.append((b, max(1.0, b * sb * sb / (sigma1 * sigma1))))
    return out


@dataclass(frozen=True)
class Wander:
    """Noise that wanders, as a model: white noise of variance `white` plus an AR(1) process of
    variance `var` whose correlation from one point to the next is `rho`. Fitted (wander_fit) to
    the variances of the series' second differences at several lags, which a straight line does
    not move. It gives the exact inflation of a least-squares slope for any window length,
    however much longer than the lags it was fitted on: where the block estimates of kappa need
    eight blocks of a size before they see it (a young series, a window longer than the largest
    block), an AR(1) of several minutes' memory makes a short stretch of it look like a trend."""

    white: float
    var: float
    rho: float
    # rho is the longest memory the lags fitted could show (wander_fit): the memory may be longer.
    bounded: bool = False

    def kappa(self, points: int, sigma1: float) -> float:
        """The slope's variance over a window of `points` equally spaced points, over what white
        noise of deviation sigma1 would give."""
        if sigma1 <= 0 or points < 3:
            return 1.0
        return (self.white + self.var * ar1_slope_factor(self.rho, points)) / (sigma1 * sigma1)

    def block_kappa(self, b: int, sigma1: float) -> float:
        """What kappas() reads at block size b under this model: b times the variance of the
        second difference of adjacent b-point means, over 6 sigma1^2."""
        if sigma1 <= 0 or b < 1:
            return 1.0
        rho = self.rho

        def cov(j: int) -> float:
            # Of two b-point means j blocks apart, the AR(1) part of unit variance: their b^2
            # pairs of points grouped by distance (b - |d| pairs d apart within the blocks).
            return sum((b - abs(d)) * rho ** abs(j * b + d) for d in range(1 - b, b)) / (b * b)
        second = 6.0 * cov(0) - 8.0 * cov(1) + 2.0 * cov(2)
        return (self.white + b * self.var * second / 6.0) / (sigma1 * sigma1)

    def medians(self, k: float) -> Wander:
        """The model of the medians of k consecutive points: the white part's variance that of a
        median (pi / 2k), the wander's kept whole (a mean over less than its memory barely moves
        it; more, and this errs on the safe side), its memory counted in medians."""
        return Wander(self.white * math.pi / (2.0 * k), self.var, self.rho ** k)

    def explains(self, table: list[tuple[int, float]], sigma1: float) -> bool:
        """Whether the model accounts for the wander the blocks measured, at the largest block
        size (within BLOCK_SCATTER of it)."""
        return bool(table) and self.block_kappa(table[-1][0], sigma1) >= table[-1][1] / BLOCK_SCATTER


def ar1_slope_factor(rho: float, m: int) -> float:
    """Var(least-squares slope) over m equally spaced points of an AR(1) process of unit variance
    and lag-1 correlation rho, over what white noise of unit variance gives:
    1 + 2 sum_k rho^k S_k / Sxx, S_k = sum_i x_i x_(i+k) over the centred abscissae."""
    if rho <= 0 or m < 3:
        return 1.0
    c = (m - 1) / 2.0
    sxx = m * (m * m - 1) / 12.0
    total, power = 0.0, 1.0
    for k in range(1, m):
        power *= rho
        if power < 1e-6:
            break
        big_n = m - k  # pairs k apart: sum over i < N of (i - c)(i - c + k)
        s1 = big_n * (big_n - 1) / 2.0 - c * big_n
        s2 = (big_n - 1) * big_n * (2 * big_n - 1) / 6.0 - 2 * c * big_n * (big_n - 1) / 2.0 + big_n * c * c
        total += power * (s2 + k * s1)
    return max(1.0, 1.0 + 2.0 * total / sxx)


_RHOS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99)
WANDER_LAGS = (1, 2, 3, 4, 6, 8, 12, 16)


def wander_fit(prefix: Prefix, start: int, lags: Sequence[int] = WANDER_LAGS,
               min_differences: int = 12, min_rise: float = 3.0) -> Wander | None:
    """The Wander model that best fits the robust variances (MAD) of the second differences at
    each lag k, y(i+2k) - 2 y(i+k) + y(i), within the segments from `start` on (none across a
    cut): 6 white + 2 var (3 - 4 rho^k + rho^2k). Fitted in relative terms (each lag's variance
    is known to a similar fraction), rho on a grid, white and var by least squares, neither
    negative. None with fewer than two lags to fit."""
    y = prefix.y
    pieces = prefix.pieces(start, len(y)) if prefix.cuts else [(start, len(y))]
    observed: list[tuple[int, float]] = []
    for k in lags:
        d2 = [y[i + 2 * k] - 2 * y[i + k] + y[i] for a, b in pieces for i in range(a, b - 2 * k)]
        # A kink (a leak's onset) biases every difference that spans it, 2k of them: the lag's
        # differences must be many more than that for their MAD to pass over it.
        if len(d2) < max(min_differences, 8 * k):
            break
        v = (MAD_SIGMA * mad(d2)) ** 2
        observed.append((k, v))
    if len(observed) < 2 or observed[0][1] <= 0:
        return None
    # White noise gives the same variance at every lag; estimates from a few dozen overlapping
    # differences scatter by tens of percent. Only a clear rise (`min_rise`-fold by some lag) is
    # taken for wandering: a model fitted to scatter would inflate every slope's error.
    if max(v for _, v in observed[1:]) < min_rise * observed[0][1]:
        return None
    # Memory much longer than the longest lag fitted is not told apart from a random walk by
    # these points (and a random walk's inflation grows without bound with the window): rho is
    # kept to what the lags can show, correlation falling to a quarter within the longest lag.
    # Wandering slower than that is the block estimates' to extrapolate (kappa_from_table).
    rho_max = 0.25 ** (1.0 / observed[-1][0])
    best: tuple[float, Wander] | None = None
    allowed = [rho for rho in _RHOS if rho <= rho_max]
    for rho in allowed:
        # Rows a_k = 6 / v_k, b_k = 2 (3 - 4 rho^k + rho^2k) / v_k against 1: least squares in
        # (white, var), each clipped to >= 0 (then the other alone).
        rows = [(6.0 / v, 2.0 * (3 - 4 * rho ** k + rho ** (2 * k)) / v) for k, v in observed if v > 0]
        saa = sum(a * a for a, _ in rows)
        sbb = sum(b * b for _, b in rows)
        sab = sum(a * b for a, b in rows)
        sa = sum(a for a, _ in rows)
        sb = sum(b for _, b in rows)
        det = saa * sbb - sab * sab
        white = (sbb * sa - sab * sb) / det if det > 0 else -1.0
        var = (saa * sb - sab * sa) / det if det > 0 else -1.0
        if white < 0 or var < 0:
            white, var = (sa / saa, 0.0) if sa / saa * sa >= sb / sbb * sb else (0.0, sb / sbb)
        rss = sum((1.0 - white * a - var * b) ** 2 for a, b in rows)
        if best is None or rss < best[0]:
            best = (rss, Wander(white, var, rho, bounded=rho == allowed[-1]))
    return best[1] if best else None


# Where the noise wanders, its excess over white noise is raised by this many of its estimate's
# standard errors (kappa_for).
WANDER_UNCERTAINTY = 2.0
# How far below the largest block's kappa a Wander model's may fall and still account for it: the
# scatter of a kappa read from eight blocks (a relative error of about 0.5).
BLOCK_SCATTER = 1.5


def kappa_for(window_points: int, table: list[tuple[int, float]], wander: Wander | None = None,
              sigma1: float = 0.0, measured: int = 0) -> float:
    """kappa_from_table, or where the noise was fitted as a Wander model, the larger of that and
    the model's exact inflation for this window, its excess over white noise then raised by
    WANDER_UNCERTAINTY standard errors of an estimate from `measured` points.

    Beyond the largest block measured, a Wander model that accounts for the wander the blocks
    measured (Wander.explains) says how the inflation grows, not the blocks' own growth: between
    small blocks an AR(1) of several minutes' memory grows as a random walk's would, and carried
    on at that rate to a long window it overstated the inflation tenfold (wandering_leak#4 in
    bench/leak_corpus.py: 400-770 where the model gave 50-130, and its 1 MiB/min leak was found
    after 193 minutes, 4.4x its limit). A model that falls short of the blocks (a quiet stretch
    fitted with a memory of a minute where the blocks still grew at eight points: correlated#2013
    at +30 s) leaves the blocks' extrapolation in force.

    The standard error is a rule of thumb, not the fit's own: the wander at a window's scale
    shows in about measured / window_points stretches that long, and a variance read from k
    stretches has a relative error of sqrt(2 / k). A few stretches of noise with minutes of
    memory can be far quieter than its long run (correlated#4001 in bench/leak_corpus.py:
    measured on 211 points, a 7-minute memory, a 54-point slope's inflation read as 68 where the
    trace's own AR(1) gives about 240, and its noise passed for a line at z 5.41). The price:
    slow leaks in such noise are found later (bench/README.md, rounds 15 and 16). White noise
    rarely fits a Wander model (it asks a clear rise of the variance with the lag) and then keeps
    its estimate."""
    explained = wander is not None and wander.explains(table, sigma1)
    k = kappa_from_table(window_points, table, extrapolate=not explained)
    if wander is not None:
        k = max(k, wander.kappa(window_points, sigma1))
        if measured > 0 and k > 1.0:
            k = 1.0 + (k - 1.0) * (1.0 + WANDER_UNCERTAINTY * math.sqrt(2.0 * min(window_points, measured) / measured))
    return k


@dataclass
class NoiseModel:
    """A series' noise as measured: the deviation of its points (`sigma`), the slope's variance
    inflation at the block sizes measured (`table`, from kappas), a Wander model where it
    wanders, the points it was measured on, and where given, the model read on finer points.
    kappa() is kappa_for's, kept per window length (a scan asks the same lengths every minute
    while the noise is not measured again)."""

    sigma: float
    table: list[tuple[int, float]]
    wander: Wander | None = None
    measured: int = 0
    # A second reading of the same noise on finer points (its model carried to these points, and
    # the points it rests on): the larger inflation of the two is used.
    finer: tuple[Wander, int] | None = None
    _kappas: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    def kappa(self, points: int) -> float:
        k = self._kappas.get(points)
        if k is None:
            k = kappa_for(points, self.table, self.wander, self.sigma, self.measured)
            if self.finer is not None:
                k = max(k, kappa_for(points, [], self.finer[0], self.sigma, self.finer[1]))
            self._kappas[points] = k
        return k


def kappa_from_table(window_points: int, table: list[tuple[int, float]], extrapolate: bool = True) -> float:
    """The slope's variance inflation for a window of this many points: kappa at a block size of
    the window's own length, interpolated (log-log) between the block sizes measured, never below
    a smaller block's. For AR(1) noise this errs on the safe side, up to about 2x above the exact
    inflation of a least-squares slope (at 0.7 x the window it would lie within about 25 %, at
    half the window fall short by up to 2x). A window longer than the largest block measured
    gets that kappa extrapolated at the rate it grew between the two largest blocks (noise
    still wandering at the longest scale seen is assumed to go on wandering); without
    `extrapolate`, the largest block's kappa."""
    x = float(window_points)
    prev_b, prev_k = 1.0, 1.0
    best = 1.0
    for b, k in table:
        k = max(k, best)
        if x <= b:
            if x <= prev_b:
                return best
            f = math.log(x / prev_b) / math.log(b / prev_b)
            return max(best, float(prev_k * (k / prev_k) ** f))
        best, prev_b, prev_k = k, float(b), k
    if not extrapolate:
        return best
    if len(table) >= 2:  # beyond the largest block measured: at the rate it last grew
        (b1, k1), (b2, k2) = table[-2], table[-1]
        growth = min(1.0, max(0.0, math.log(max(k2, 1.0) / max(k1, 1.0)) / math.log(b2 / b1)))
        best = max(best, k2 * (x / b2) ** growth)
    elif table:  # one block size measured: no rate to go by, assume the worst (a random walk)
        b1, k1 = table[0]
        # Its excess over white noise grows as a random walk's would, however small: a young
        # series has shown nothing of how it wanders over the window's length.
        best = max(best, k1 * x / b1 if k1 > 1.5 else 1.0 + (k1 - 1.0) * x / b1)
    return best


def best_split(prefix: Prefix, i: int, j: int) -> tuple[float, int]:
    """(RSS, split) of the best one-step model on [i, j): two levels, split before some point k,
    the point at the split (which may straddle the step inside its bucket) optionally left out.
    (inf, -1) when [i, j) is too short to split."""
    if j - i < 4:
        return math.inf, -1
    sy, syy = prefix.sy, prefix.syy
    yi, yyi, yj, yyj = sy[i], syy[i], sy[j], syy[j]
    ks = range(i + 2, j - 1)
    left = [(syy[k] - yyi) - (sy[k] - yi) ** 2 / (k - i) for k in ks]
    right = [(yyj - syy[k]) - (yj - sy[k]) ** 2 / (j - k) for k in ks]
    skip = [(yyj - syy[k + 1]) - (yj - sy[k + 1]) ** 2 / (j - k - 1) for k in ks]
    rss = [a + (b if b < c else c) for a, b, c in zip(left, right, skip, strict=True)]
    best = min(rss)
    return max(0.0, best), i + 2 + rss.index(best)


def best_two_step_rss(prefix: Prefix, i: int, j: int, first: int) -> float:
    """RSS of a two-step model (three levels) on [i, j) found greedily: the best one-step split
    `first`, then the best second split on either side of it."""
    if first < 0:
        return math.inf
    level_rss = prefix.level_rss
    left, right = level_rss(i, first), min(level_rss(first, j), level_rss(first + 1, j))
    split_left = best_split(prefix, i, first)[0] + right
    lo = first + 1 if level_rss(first + 1, j) < level_rss(first, j) else first
    split_right = left + best_split(prefix, lo, j)[0]
    return min(split_left, split_right)


def step_models(prefix: Prefix, i: int, j: int) -> tuple[float, float]:
    """RSS of the best one-step and two-step models on [i, j), fitted as the line and the hinge
    are: an intercept per segment between the cuts (the level shifts already taken out), plus
    the steps. A step only splits the segment it falls in (the segments after it have their own
    intercepts), so the best one-step model splits the one segment where that gains most, and
    the best two-step model splits two segments once each or one segment twice. Without a cut
    this is best_split and best_two_step_rss over [i, j); with cuts, comparing the line with
    steps that ignore them would charge the steps for every error in the shifts taken out."""
    pieces = prefix.pieces(i, j) if prefix.cuts else [(i, j)]
    if len(pieces) == 1:
        one, split = best_split(prefix, i, j)
        return one, best_two_step_rss(prefix, i, j, split)
    base = 0.0
    gains: list[float] = []  # per segment: what one step inside it gains
    doubles: list[float] = []  # per segment: what two steps inside it gain
    for a, b in pieces:
        level = prefix.level_rss(a, b)
        base += level
        rss, split = best_split(prefix, a, b)
        if split < 0:
            continue
        gains.append(level - rss)
        doubles.append(level - best_two_step_rss(prefix, a, b, split))
    if not gains:
        return math.inf, math.inf
    gains.sort(reverse=True)
    one = base - gains[0]
    two = base - max(max(doubles), gains[0] + (gains[1] if len(gains) > 1 else 0.0))
    return max(0.0, one), max(0.0, two)


def steps_fit(prefix: Prefix, i: int, j: int, steps: int,
              min_points: int = 2) -> tuple[float, list[float], list[int]]:
    """The best model of `steps` steps on [i, j) (steps + 1 levels, each held by at least
    `min_points` points but the first, a level that held before the window began; an intercept
    per segment between the cuts as the line has), by dynamic programming over where the steps
    fall: O(steps x points^2), for the short series of troughs. (RSS, the steps' sizes, the points
    each level holds, oldest first); (inf, [], []) where there is no room for them."""
    m = j - i
    if m < steps * min_points + 1:
        return math.inf, [], []

    def cost(a: int, b: int) -> float:
        if not prefix.cuts:
            return prefix.level_rss(a, b)
        return sum(prefix.level_rss(x, y) for x, y in prefix.pieces(a, b))
    # best[e]: least RSS of [i, i + e) in the levels placed so far; back[r][e]: where its last began
    best = [math.inf] * (m + 1)
    for e in range(1, m + 1):
        best[e] = cost(i, i + e)
    back: list[list[int]] = []
    for _ in range(steps):
        nxt = [math.inf] * (m + 1)
        arg = [0] * (m + 1)
        for e in range(1 + min_points, m + 1):
            for s0 in range(1, e - min_points + 1):
                if best[s0] < math.inf:
                    c = best[s0] + cost(i + s0, i + e)
                    if c < nxt[e]:
                        nxt[e], arg[e] = c, s0
        best = nxt
        back.append(arg)
    if best[m] == math.inf:
        return math.inf, [], []
    edges = [m]
    for arg in reversed(back):
        edges.append(arg[edges[-1]])
    edges = [0, *reversed(edges)]
    means = [prefix.mean(i + a, i + b) for a, b in itertools.pairwise(edges)]
    return best[m], [b - a for a, b in itertools.pairwise(means)], [b - a for a, b in itertools.pairwise(edges)]


# A warm-up's step is at most this many times the one before it (beyond what the levels' noise
# allows): its steps shrink as the allocator meets fewer new shapes.
WARM_STEP_GROWTH = 1.25


def shrinking(sizes: Sequence[float], counts: Sequence[int], sigma: float) -> bool:
    """Whether steps of `sizes` between levels of `counts` points, in white noise of deviation
    `sigma`, are a warm-up's: all up, none larger than WARM_STEP_GROWTH x the one before it by
    two of the difference's standard errors (each size is the difference of two levels' means).
    With `sigma` 0, as read."""
    if not sizes or min(sizes) <= 0:
        return False
    g = WARM_STEP_GROWTH
    for k, (a, b) in enumerate(itertools.pairwise(sizes)):
        # b - g a = m[k+2] - (1 + g) m[k+1] + g m[k], of independent level means
        se = sigma * math.sqrt(1 / counts[k + 2] + (1 + g) ** 2 / counts[k + 1] + g * g / counts[k])
        if b - g * a > 2.0 * se:
            return False
    return True


def curvature_z(prefix: Prefix, i: int, j: int, sigma: float) -> float:
    """z of the quadratic term of a least-squares parabola over [i, j) (negative: the growth
    slows down). 0 with too few points or no noise estimate."""
    n = j - i
    if n < 5 or sigma <= 0:
        return 0.0
    u = prefix.u[i:j]
    y = prefix.y[i:j]
    mu = sum(u) / n
    x = [a - mu for a in u]
    x2 = [a * a for a in x]
    m2 = sum(x2) / n
    q = [a - m2 for a in x2]  # x^2 centred
    # Orthogonalise q against x (uniform spacing makes this small; gaps do not).
    sxx = sum(x2)
    if sxx <= 0:
        return 0.0
    proj = sum(map(operator.mul, q, x)) / sxx
    q = [a - proj * b for a, b in zip(q, x, strict=True)]
    sqq = sum(map(operator.mul, q, q))
    if sqq <= 0:
        return 0.0
    c: float = sum(map(operator.mul, q, y)) / sqq
    return c / (sigma / math.sqrt(sqq))


def hinge(prefix: Prefix, b: int, i: int, sigma1: float, kappa_of: Callable[[int], float],
          min_points: int, kink: float | None = None) -> WindowResult | None:
    """The joined line over [b, n): flat over [b, i), growing from point i on (an intercept per
    segment where cuts fall inside); None where it cannot be fitted or does not grow. `kink`
    (in u, between points i - 1 and i) is where the growth begins: by default point i itself."""
    n = len(prefix.u)
    big_n = n - b
    if n - i < 3 or i - b < 2 or big_n < min_points:  # two growing points are a step as much
        return None
    u, su, suu, suy, sy, syy = prefix.u, prefix.su, prefix.suu, prefix.suy, prefix.sy, prefix.syy
    ui = u[i] if kink is None else kink
    sxx = sxy = syy_c = 0.0
    sh = s_y = count = 0.0
    for a, c in (prefix.pieces(b, n) if prefix.cuts else ((b, n),)):
        count = c - a
        s_y = sy[c] - sy[a]
        g = max(a, i)  # the piece's growing part [g, c)
        if g < c:
            s_u = su[c] - su[g]
            k = c - g
            sh = s_u - k * ui
            shh = (suu[c] - suu[g]) - 2 * ui * s_u + k * ui * ui
            shy = (suy[c] - suy[g]) - ui * (sy[c] - sy[g])
        else:
            sh = shh = shy = 0.0
        sxx += shh - sh * sh / count
        sxy += shy - sh * s_y / count
        syy_c += (syy[c] - syy[a]) - s_y * s_y / count
    if sxx <= 0:
        return None
    slope = sxy / sxx
    if slope <= 0:
        return None
    rss = max(0.0, syy_c - slope * sxy)
    kappa = kappa_of(big_n)
    se = math.sqrt(max(sigma1 * sigma1 * kappa, rss / (big_n - 2) if big_n > 2 else 0.0) / sxx)
    level_end = s_y / count + slope * ((u[-1] - ui) - sh / count)  # in the last segment
    return WindowResult(b, i, n, True, slope, se, slope / se, kappa, level_end, rss, kink)


def best_hinge(prefix: Prefix, b: int, onsets: range, sigma1: float, kappa_of: Callable[[int], float],
               min_points: int) -> WindowResult | None:
    """The joined line over [b, n) (hinge()) with the least residual among those growing from
    each point of `onsets` (the first of equals); None where none can be fitted."""
    best = None
    for i in onsets:
        h = hinge(prefix, b, i, sigma1, kappa_of, min_points)
        if h is not None and (best is None or h.rss < best.rss):
            best = h
    return best


def refine(prefix: Prefix, w: WindowResult, noise: NoiseModel, min_points: int) -> WindowResult:
    """The growth `w` found, its onset read to the point: over the same points, the joined
    line (flat, then growing) with the least residual, where it fits better than `w` (a free
    line over a window that began before the onset dilutes the rate with the flat stretch it
    holds). For the rate and its interval; the decision stays `w`'s."""
    h = best_hinge(prefix, w.start, range(w.start + 2, len(prefix.u) - 1), noise.sigma, noise.kappa,
                   min_points)
    return h if h is not None and h.rss < w.rss else w


# The models of a warm-up's several steps (steps_fit, O(points^2)) are fitted over windows of at
# most this many points: 2 ms a window at 40, 90 ms at 320 (a sawtooth of 1-minute teeth over the
# longest window). A warm-up's few steps show in the shorter windows first.
WARM_STEPS_MAX_POINTS = 40


@dataclass(frozen=True)
class WindowResult:
    start: int  # first point of the fit (the baseline's first for a hinge)
    onset: int  # first point of the growth (= start for a free line)
    end: int  # one past the last point
    hinge: bool  # a joined line (flat, then growing from the onset) rather than a free line
    slope: float  # bytes per minute
    se: float  # its standard error (bytes per minute), kappa included
    z: float
    kappa: float
    level_end: float  # the fitted line at the last point (bytes, from the series' first point)
    rss: float  # residual sum of squares of the model
    kink: float | None = None  # a hinge's onset in u where it falls between points (else u[onset])

    def shape(self, prefix: Prefix, sigma1: float, step_sigma: float | None = None, young: bool = False) -> Shape:
        """How well steps explain the same points, whether the growth slows down, and the
        slope's z with its error from the model's own residuals (their lag-1 correlation).
        With `step_sigma` (a deviation blind to steps), the best two and three steps are also
        judged against that noise where it is lower, where they shrink as a warm-up's steps do:
        on a few points, one a tooth, steps inflate the noise measured from second differences
        enough to hide behind it. For growth begun `young` (where a warm-up is expected), a step
        may exceed WARM_STEP_GROWTH x the one before by what the noise of its levels allows (a
        level of a few points is read to within a few noise deviations); otherwise not at all."""
        # Steps raise the noise's measured correlations (kappa) themselves: the comparison with
        # step models reads the noise as at most twice white, so steps cannot hide behind it.
        noise = sigma1 * sigma1 * min(self.kappa, 2.0)
        one, two = step_models(prefix, self.start, self.end)
        warm = [math.inf, math.inf]
        if step_sigma is not None and self.end - self.start <= WARM_STEPS_MAX_POINTS:
            blind = min(noise, step_sigma * step_sigma)
            for k in (2, 3):
                rss, sizes, counts = steps_fit(prefix, self.start, self.end, k)
                if shrinking(sizes, counts, math.sqrt(blind) if young else 0.0):
                    warm[k - 2] = (rss - self.rss) / blind
        return Shape((one - self.rss) / noise, (two - self.rss) / noise,
                     curvature_z(prefix, self.onset, self.end, sigma1 * math.sqrt(self.kappa)),
                     self.slope / self.residual_se(prefix), warm[0], warm[1])

    def residual_se(self, prefix: Prefix) -> float:
        """The slope's standard error as AR(1) residuals would make it: their variance and
        lag-1 correlation (bias-corrected for a short window) measured about the fitted model
        (an intercept per segment, as it was fitted). Noise that wanders more slowly than the
        window is long shows up here even where the series is too young for the block
        estimates of kappa."""
        u, y = prefix.u, prefix.y
        b, i, n = self.start, self.onset, self.end
        m = n - b
        if m < 5:
            return self.se
        res: list[float] = []
        sxx = 0.0
        for a, c in (prefix.pieces(b, n) if prefix.cuts else ((b, n),)):
            ui = u[i] if self.kink is None else self.kink
            hs = [0.0 if k < i else u[k] - ui for k in range(a, c)] if self.hinge else u[a:c]
            mh = sum(hs) / (c - a)
            my = sum(y[a:c]) / (c - a)
            sxx += sum((h - mh) ** 2 for h in hs)
            res += [yy - my - self.slope * (h - mh) for h, yy in zip(hs, y[a:c], strict=True)]
        ss = sum(e * e for e in res)
        if sxx <= 0 or ss <= 0:
            return self.se
        rho = sum(map(operator.mul, res[1:], res[:-1])) / ss
        rho = min(0.95, rho + (1 + 3 * max(rho, 0.0)) / m)
        inflation = max(1.0, (1 + rho) / (1 - rho))
        return max(self.se, math.sqrt(ss / (m - 2) * inflation / sxx))


@dataclass(frozen=True)
class Shape:
    step_margin: float  # (RSS of the best step - RSS of the model) / (sigma^2 kappa)
    two_step_margin: float  # (RSS of the best two steps - RSS of the model) / (sigma^2 kappa)
    curvature: float  # z of the quadratic term of the growing part
    residual_z: float  # the slope's z with its error from the residuals (residual_se)
    # As two_step_margin, for two and three steps that shrink as a warm-up's do, against the
    # noise blind to steps (where tried: the troughs); inf where the best such steps do not shrink.
    warm_two_margin: float = math.inf
    warm_three_margin: float = math.inf


def scan(prefix: Prefix, start: int, noise: NoiseModel, windows_minutes: Sequence[float], min_points: int,
         threshold: float, baseline: float = 2.0, half_kink_minutes: float = 0.0) -> list[WindowResult]:
    """Every growth ending at the newest point, begun a window length ago (the given lengths),
    at or after `start`, whose slope reaches `threshold`, in two models:
      free line   y = a + r t over the window;
      hinge       y = a + r (t - onset)+ over the window and `baseline` times as many points
                  before it: the level before the onset is read from the baseline, which
                  halves the slope's error, so a leak growing from a steady level is found
                  sooner (the generalised likelihood ratio for a change of slope);
                  for windows up to `half_kink_minutes` also with the onset half way to the
                  point before (a leak begun inside a bucket: that bucket holds part of its
                  growth, which a kink at either point misfits by a few noise deviations,
                  costing a fast leak a whole bucket).
    Sorted by z, highest first; their shape (steps, curvature) is dearer, measured on demand."""
    n = len(prefix.u)
    u = prefix.u
    out: list[WindowResult] = []
    sigma1, kappa_of = noise.sigma, noise.kappa
    if sigma1 <= 0 or n - start < min_points:
        return out
    end_u = u[-1]
    sy = prefix.sy
    for w in windows_minutes:
        i = bisect.bisect_left(u, end_u - w + 1e-9)
        if i < start:
            break  # longer windows reach further back still
        m = n - i
        if m < 2:
            continue
        # Free line over [i, n).
        if m >= min_points:
            slope, mean_u, mean_y, sxx, rss = prefix.line(i, n)
            if sxx > 0 and slope > 0:
                kappa = kappa_of(m)
                # The model's error, or the scatter about the line where that is larger (a noise
                # model that does not fit this window must not make it look significant).
                se = math.sqrt(max(sigma1 * sigma1 * kappa, rss / (m - 2) if m > 2 else 0.0) / sxx)
                if slope >= threshold * se:
                    out.append(WindowResult(i, i, n, False, slope, se, slope / se, kappa,
                                            mean_y + slope * (end_u - mean_u), rss))
        # Hinge: flat over [b, i), growing from u[i] on. Fitted only where the mean since the
        # onset stands above the baseline's by 0.4 x the threshold in z: the difference of the
        # means is about 0.8 x the hinge's z, so this leaves out only fits that fall far short.
        b = max(start, i - int(baseline * m))
        if i - b >= 2:
            rise = (sy[n] - sy[i]) / m - (sy[i] - sy[b]) / (i - b)
            if rise > 0.4 * threshold * sigma1 * math.sqrt(kappa_of(n - b) * (1 / m + 1 / (i - b))):
                h = hinge(prefix, b, i, sigma1, kappa_of, min_points)
                if w <= half_kink_minutes and i - 1 - b >= 2:
                    half = hinge(prefix, b, i, sigma1, kappa_of, min_points, (u[i - 1] + u[i]) / 2)
                    if half is not None and (h is None or half.z > h.z):
                        h = half
                if h is not None and h.z >= threshold:
                    out.append(h)
    out.sort(key=lambda w: -w.z)
    return out
