"""The labelled corpus of bench/leak_quality.py: generated per-process GPU memory series in the
shapes real vLLM memory has, grouped in families, each trace with what a statistical limit needs
to know about it (the noise the leak hides in, where it hides).

Every trace is 6 h of 5 s samples on an 80 GiB card. It starts with a vLLM start-up (CUDA
context, weights in shards, the profiling run's peak, KV cache preallocation, CUDA graph
capture); then the family's normal shape; then, in the leak families, a leak from a random
moment. NVML reports whole 2 MiB pages. The probed families also carry what the allocator probe
would read (torch allocated and reserved, every 5 s), with the leak, where there is one, in one
component.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

MiB = 1024 * 1024
GiB = 1024 * MiB
TOTAL = 80 * GiB
T0 = 1_700_000_000
DT = 5
DURATION = 6 * 3600
PAGE = 2 * MiB

Curve = Callable[[float], float]


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    leak: bool
    # The leak rates (MiB/min) drawn from, one per trace in turn.
    rates: tuple[float, ...] = ()


FAMILIES = (
    Family("startup_flat", "start-up, then flat (2-8 MiB white noise)", False),
    Family("warmup", "start-up, then the allocator warming up to a plateau in shrinking steps", False),
    Family("sawtooth", "allocator caching cycles: 1-12 min teeth of 64 MiB-2 GiB", False),
    Family("level_shifts", "a second model loading (+4-20 GiB), a sleep and wake, a step given back, "
           "the cache emptied and refilling", False),
    Family("correlated", "noise that wanders (AR(1), 0.5-8 min memory, 4-16 MiB)", False),
    Family("noisy", "16-32 MiB white noise with 1 % one-sample spikes", False),
    Family("mixed", "warm-up, a small sawtooth and a step together", False),
    Family("sleep_wake", "sleeps and wakes, the cache warming up again after each (cycles or steps)", False),
    Family("slow_leak", "1 MiB/min on a flat or warmed-up background", True, (1.0,)),
    Family("leak_4", "4 MiB/min on a flat, warmed-up or wandering background", True, (4.0,)),
    Family("fast_leak", "16-50 MiB/min", True, (16.0, 50.0)),
    Family("late_leak", "2 MiB/min starting 3-5 h after start-up", True, (2.0,)),
    Family("leak_under_sawtooth_slow", "1 MiB/min under allocator cycles", True, (1.0,)),
    Family("leak_under_sawtooth", "4-16 MiB/min under allocator cycles", True, (4.0, 16.0)),
    Family("staircase_leak", "4-16 MiB/min in steps every 3-15 min", True, (4.0, 16.0)),
    Family("leak_after_shift", "2-8 MiB/min after a second model load or a wake", True, (2.0, 8.0)),
    Family("noisy_leak", "8 MiB/min under 16-32 MiB noise", True, (8.0,)),
    Family("wandering_leak", "1-2 MiB/min in noise that wanders (AR(1), 2-8 min memory, 3-8 MiB)", True,
           (1.0, 2.0)),
    Family("probed_leak_under_sawtooth", "1 MiB/min outside torch under the cache's cycles (probed)", True,
           (1.0,)),
    Family("probed_slow_leak", "1 MiB/min in torch allocated, the cache breathing (probed)", True, (1.0,)),
    Family("probed_sawtooth", "the cache's cycles of 256 MiB-2 GiB, nothing leaking (probed)", False),
    Family("probed_mixed", "warm-up, a small sawtooth and a step, nothing leaking (probed)", False),
)
FAMILY = {f.name: f for f in FAMILIES}


@dataclass
class Trace:
    name: str
    family: str
    times: list[int]
    values: list[int]  # NVML used bytes
    leak_rate: float | None = None  # MiB/min
    leak_shape: str = ""
    leak_start: float | None = None  # Unix s
    full_at: float | None = None  # when the leak filled the card (None: never)
    # What the statistical limit needs: the leak-free residual the leak must be told from, as
    # (deviation, seconds between informative samples) -- see limit_seconds().
    noise_sigma: float = 0.0
    noise_dt: float = DT
    stair_interval: float = 0.0  # seconds between a staircase leak's steps
    # Probed traces: what the probe read at each sample (None: not probed).
    allocated: list[int] | None = None
    reserved: list[int] | None = None
    spec: tuple = field(default=())


# --- shapes ----------------------------------------------------------------------------------
def _step_fn(pts: list[tuple[float, float]]) -> Curve:
    """Piecewise-constant function through breakpoints (t sorted)."""
    ts = [p[0] for p in pts]

    def f(t: float) -> float:
        i = bisect.bisect_right(ts, t) - 1
        return pts[i][1] if i >= 0 else 0.0
    return f


def startup(rng: random.Random, kv=(0.80, 0.88)) -> tuple[Curve, float]:
    """A vLLM start-up as a step function, and the moment it is ready to serve; the KV cache
    takes the card up to a fraction `kv` (gpu_memory_utilization)."""
    pts: list[tuple[float, float]] = []
    level = rng.uniform(300, 600) * MiB  # CUDA context
    pts.append((0.0, level))
    t = rng.uniform(5, 30)
    weights = rng.uniform(8, 40) * GiB
    shards = rng.randint(2, 8)
    load = rng.uniform(20, 120)
    for k in range(1, shards + 1):  # safetensors shards arrive one by one
        pts.append((t + load * k / shards, level + weights * k / shards))
    t += load + rng.uniform(5, 20)
    level += weights
    spike = rng.uniform(1, 8) * GiB  # profiling run's activation peak, freed afterwards
    pts.append((t, level + spike))
    t += rng.uniform(5, 30)
    pts.append((t, level))
    t += rng.uniform(2, 10)
    level = rng.uniform(*kv) * TOTAL  # KV cache preallocated up to gpu_memory_utilization
    pts.append((t, level))
    t += rng.uniform(2, 10)
    graphs = rng.uniform(0.25, 2) * GiB
    capture = rng.uniform(10, 90)
    for k in range(1, 21):  # CUDA graphs, one batch size after another
        pts.append((t + capture * k / 20, level + graphs * k / 20))
    return _step_fn(pts), t + capture


def warming(rng: random.Random, start: float) -> Curve:
    """The caching allocator meeting new shapes: steps at doubling intervals, shrinking."""
    steps = rng.randint(4, 7)
    tau = rng.uniform(0.5, 1.5) * 60
    amount = rng.uniform(128 * MiB, 1.5 * GiB)
    weights = [0.7 ** k * rng.uniform(0.5, 1.5) for k in range(steps)]
    pts = []
    acc = 0.0
    for k in range(steps):
        acc += amount * weights[k] / sum(weights)
        pts.append((start + tau * (2 ** (k + 1) - 1) * rng.uniform(0.7, 1.3), acc))
    pts.sort()
    out, best = [(start - 1, 0.0)], 0.0
    for t, v in pts:  # monotone even where the jitter reordered the times
        best = max(best, v)
        out.append((t, best))
    return _step_fn(out)


def sawtooth(rng: random.Random, start: float, amp_range=(64 * MiB, 2 * GiB),
             period_range=(1.0, 12.0)) -> tuple[Curve, float]:
    """Cache growing in 20 MiB segments, then freed: teeth of jittered length and height.
    Returns the curve and its mean period (s)."""
    period = rng.uniform(*period_range) * 60
    amp = rng.uniform(*amp_range)
    seg = 20 * MiB
    teeth: list[tuple[float, float, float]] = []  # (start, length, amplitude)
    t = start
    while t < DURATION + 600:
        length = period * rng.uniform(0.8, 1.2)
        teeth.append((t, length, amp * rng.uniform(0.8, 1.2)))
        t += length
    starts = [x[0] for x in teeth]

    def f(tt: float) -> float:
        i = bisect.bisect_right(starts, tt) - 1
        if i < 0:
            return 0.0
        s, length, a = teeth[i]
        return math.floor(a * (tt - s) / length / seg) * seg
    f.tooth_starts = starts  # type: ignore[attr-defined]  # for the limit's trough sampling
    return f, period


def level_shifts(rng: random.Random, start: float) -> Curve:
    """One or two of: a second model loading into the process, a sleep and wake, a step partly
    given back later, the cache emptied (torch.cuda.empty_cache) and filling up again."""
    events: list[tuple[float, float]] = [(start - 1, 0.0)]
    ramps: list[tuple[float, float, float]] = []  # (start, end, height): the cache refilling
    kinds = rng.sample(("model", "sleep", "giveback", "refill"), rng.randint(1, 2))
    t = start
    level = 0.0
    for kind in kinds:
        t += rng.uniform(20, 100) * 60
        if kind == "model":  # a draft model or a second engine's weights
            level += rng.uniform(4, 20) * GiB
            events.append((t, level))
        elif kind == "sleep":  # weights offloaded, KV cache discarded; back on wake
            events.append((t, -0.44 * TOTAL))
            t += rng.uniform(5, 40) * 60
            events.append((t, level))
        elif kind == "giveback":
            up = rng.uniform(256 * MiB, 3 * GiB)
            events.append((t, level + up))
            t += rng.uniform(20, 60) * 60
            level += up * rng.uniform(0.0, 0.7)
            events.append((t, level))
        else:
            size = rng.uniform(256 * MiB, 2 * GiB)
            refill = rng.uniform(5, 30) * 60
            ramps.append((t, t + refill, size))
            t += refill
    step = _step_fn(events)

    def f(tt: float) -> float:
        v = step(tt)
        for a, b, size in ramps:  # down by `size` at a, back up linearly by b
            if a <= tt < b:
                v -= size * (1 - (tt - a) / (b - a))
        return v
    return f


def sleeping(rng: random.Random, start: float) -> Curve:
    """vLLM's sleep mode: 1-2 sleeps of 5-40 min, 20-100 min apart. Asleep, the weights and KV
    cache are offloaded and the cache emptied; on wake they are back and the cache is empty again
    (CuMemAllocator.sleep() and wake_up() both end with empty_cache()), so after each wake the
    caching allocator warms up as it did after start-up: its cycles start over, a first tooth
    included (half the traces), or it climbs to its plateau in shrinking steps again."""
    cache = sawtooth(rng, start, (64 * MiB, 2 * GiB))[0] if rng.random() < 0.5 else warming(rng, start)
    naps: list[tuple[float, float]] = []
    t = start
    for _ in range(rng.randint(1, 2)):
        t += rng.uniform(20, 100) * 60
        naps.append((t, t + rng.uniform(5, 40) * 60))
        t = naps[-1][1]

    def f(tt: float) -> float:
        woke = start
        for asleep, awake in naps:
            if asleep <= tt < awake:
                return -0.44 * TOTAL
            if tt >= awake:
                woke = awake
        return cache(start + (tt - woke))  # the cache as it began after start-up
    return f


def steps(rng: random.Random, start: float) -> Curve:
    """One level shift of 256 MiB-3 GiB 30-120 min after `start`."""
    t = start + rng.uniform(30, 120) * 60
    return _step_fn([(start - 1, 0.0), (t, rng.uniform(256 * MiB, 3 * GiB))])


def linear_leak(rate_bytes_s: float, onset: float) -> Curve:
    return lambda t: 0.0 if t < onset else rate_bytes_s * (t - onset)


def staircase_leak(rate_bytes_s: float, onset: float, interval: float) -> Curve:
    size = rate_bytes_s * interval
    return lambda t: 0.0 if t < onset else (math.floor((t - onset) / interval) + 1) * size


class Noise:
    """White or AR(1) noise; `sigma_long` is the deviation a long window's slope sees."""

    def __init__(self, rng: random.Random, sigma: float, phi: float = 0.0):
        self.rng, self.phi = rng, phi
        self.innovation = sigma * math.sqrt(1 - phi * phi)
        self.state = rng.gauss(0, sigma)
        self.sigma_long = sigma * math.sqrt((1 + phi) / (1 - phi))

    def __call__(self) -> float:
        self.state = self.phi * self.state + self.rng.gauss(0, self.innovation)
        return self.state


# --- the traces ------------------------------------------------------------------------------
def make_trace(family: str, seed: int) -> Trace:
    fam = FAMILY[family]
    rng = random.Random(f"{family}/{seed}")
    # A server that loads a second model leaves room for it (a lower gpu_memory_utilization).
    boot, ready = startup(rng, (0.45, 0.6) if family in ("level_shifts", "leak_after_shift") else (0.80, 0.88))
    traffic = ready + rng.uniform(0, 300)
    parts: list[Curve] = [boot]
    sigma = rng.uniform(2, 8) * MiB
    phi = 0.0
    spike_p = 0.002
    tooth: tuple[Curve, float] | None = None
    rate = fam.rates[seed % len(fam.rates)] if fam.leak else None
    onset = traffic + rng.uniform(0, 2.5 * 3600)
    background = family
    if family in ("slow_leak", "leak_4"):
        background = rng.choice(("startup_flat", "warmup", "correlated") if family == "leak_4"
                                else ("startup_flat", "warmup"))
    elif family in ("fast_leak", "late_leak", "staircase_leak"):
        background = rng.choice(("startup_flat", "warmup"))
    elif family == "leak_after_shift":
        background = "level_shifts"
    elif family == "noisy_leak":
        background = "noisy"
    elif family == "wandering_leak":
        background = "correlated"
    elif family == "probed_mixed":
        background = "mixed"
    if background == "warmup":
        parts.append(warming(rng, traffic))
    elif background == "sawtooth" or "sawtooth" in family:
        amp = (64 * MiB, 2 * GiB) if background == "sawtooth" else (256 * MiB, 2 * GiB)
        tooth = sawtooth(rng, traffic, amp)
    elif background == "level_shifts":
        shifts = level_shifts(rng, traffic)
        parts.append(shifts)
        if family == "leak_after_shift":  # after the first shift, once it has settled
            first = next(t for t in range(int(traffic), DURATION, 30) if shifts(t) != 0.0)
            onset = first + rng.uniform(15, 60) * 60
    elif background == "correlated":
        # A slow leak in such noise is found after hours at 16 MiB: the wandering leak's noise
        # is kept to where its limit lies within the trace.
        memory, size = ((2, 8), (3, 8)) if family == "wandering_leak" else ((0.5, 8), (4, 16))
        phi = math.exp(-DT / (rng.uniform(*memory) * 60))
        sigma = rng.uniform(*size) * MiB
    elif background == "noisy":
        sigma = rng.uniform(16, 32) * MiB
        spike_p = 0.01
    elif background == "sleep_wake":
        parts.append(sleeping(rng, traffic))
    elif background == "mixed":
        parts.append(warming(rng, traffic))
        parts.append(steps(rng, traffic))
        tooth = sawtooth(rng, traffic, (64 * MiB, 512 * MiB))
    if family == "late_leak":
        onset = traffic + rng.uniform(3, 5) * 3600
    if family == "probed_slow_leak":
        tooth = sawtooth(rng, traffic, (64 * MiB, 256 * MiB))
    stair = 0.0
    leak: Curve = lambda t: 0.0  # noqa: E731
    if rate is not None:
        r = rate * MiB / 60
        if family == "staircase_leak":
            stair = rng.uniform(3, 15) * 60
            leak = staircase_leak(r, onset, stair)
        else:
            leak = linear_leak(r, onset)
    noise = Noise(rng, sigma, phi)
    probed = family.startswith("probed_")
    # The probe's view: non-torch (context, NCCL, graphs) steady; allocated = weights + KV cache
    # + activations in flight; cached = the cache's cycles (and whatever is not allocated).
    non_torch = rng.uniform(500, 900) * MiB
    act_sigma = rng.uniform(0.5, 2) * MiB
    lag = rng.uniform(0, DT)  # the probe reads on its own clock, up to one interval before NVML
    times, values, allocated, reserved = [], [], [], []
    full_at = None
    for k in range(DURATION // DT):
        t = k * DT
        base = sum(p(t) for p in parts)
        cyc = tooth[0](t) if tooth else 0.0
        lk = leak(t)
        e = noise()
        v = base + cyc + lk + e
        if rng.random() < spike_p:
            v += rng.uniform(64 * MiB, 1 * GiB)  # a transient, one sample long
        v = min(max(0.0, v), TOTAL)
        v = int(v // PAGE) * PAGE
        if rate is not None and full_at is None and v >= TOTAL - 256 * MiB and t > onset:
            full_at = T0 + t
        times.append(T0 + t)
        values.append(v)
        if probed:
            # NVML's noise is the cache breathing: the probe's reserved moves with it.
            leak_alloc = lk if family == "probed_slow_leak" else 0.0
            alloc = max(0.0, base - non_torch + leak_alloc + rng.gauss(0, act_sigma))
            res = alloc + max(0.0, (tooth[0](t - lag) if tooth else 0.0) + e + 64 * MiB)
            allocated.append(int(alloc))
            # Up to one interval older than NVML's figure, as a real probe's: once the cache has
            # shrunk, reserved may exceed NVML used, and that sample has no non-torch figure
            # (ProcessSample.non_torch_bytes). Clipped to used, it read as non-torch 0.
            reserved.append(int(res))
    trace = Trace(f"{family}#{seed}", family, times, values, rate, "staircase" if stair else "linear",
                  None if rate is None else T0 + onset, full_at, stair_interval=stair,
                  spec=(family, seed))
    if probed:
        trace.allocated, trace.reserved = allocated, reserved
    # The leak-free residual the leak must be told from (see limit_seconds): white or AR(1)
    # noise plus NVML's page rounding; under a sawtooth, the troughs, one per tooth.
    quant = PAGE / math.sqrt(12)
    trace.noise_sigma = math.hypot(noise.sigma_long, quant)
    if tooth is not None:
        trace.noise_sigma, trace.noise_dt = _trough_noise(tooth, sigma, quant, random.Random(seed))
    return trace


def _trough_noise(tooth: tuple[Curve, float], sigma: float, quant: float,
                  rng: random.Random) -> tuple[float, float]:
    """Deviation of the sampled trough of each tooth (its lowest 5 s sample, noise and page
    rounding included) and the mean tooth period: the samples a test can read a leak from under
    a sawtooth whose teeth vary in height. Simulated over the trace's own teeth."""
    curve, period = tooth
    starts = curve.tooth_starts  # type: ignore[attr-defined]
    mins = []
    for a, b in itertools.pairwise(starts):
        if b > DURATION:
            break
        phase = rng.uniform(0, DT)  # where the 5 s sampling falls in the tooth
        lows = [curve(t) + rng.gauss(0, sigma) + rng.uniform(-0.5, 0.5) * quant * math.sqrt(12)
                for t in _frange(a + phase, b, DT)]
        if lows:
            mins.append(min(lows))
    if len(mins) < 3:
        return math.hypot(sigma, quant), period
    m = sum(mins) / len(mins)
    return math.sqrt(sum((x - m) ** 2 for x in mins) / (len(mins) - 1)), period


def _frange(a: float, b: float, step: float):
    t = a
    while t < b:
        yield t
        t += step


def limit_seconds(trace: Trace, z: float = 5.0) -> float | None:
    """The statistical limit for this trace's leak: how long after the onset a least-squares
    slope (free intercept) over the informative samples since the onset -- the test knows when
    the leak started and what the noise is -- first reaches z. In continuous time that is
    T = (z sigma sqrt(12 dt) / r)^(2/3); here counted in whole samples, the first of them half a
    sample interval after the onset on average, and at least three of them (a line needs them):
    m samples give z = r dt sqrt(m (m^2 - 1) / 12) / sigma. A staircase is never found before
    three step intervals (until its fourth step it is a warm-up's few steps)."""
    if trace.leak_rate is None or trace.noise_sigma <= 0:
        return None
    r = trace.leak_rate * MiB / 60
    dt = trace.noise_dt
    m = 3
    while r * dt * math.sqrt(m * (m * m - 1) / 12) / trace.noise_sigma < z:
        m += 1
    t = dt / 2 + (m - 1) * dt
    if trace.stair_interval:
        t = max(t, 3 * trace.stair_interval)
    return t


def corpus(seeds: int) -> list[tuple[str, int]]:
    return [(f.name, s) for f in FAMILIES for s in range(seeds)]
