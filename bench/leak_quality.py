"""How well does the leak detector tell leaks from normal vLLM memory behaviour?

    python bench/leak_quality.py [--seeds N] [--workers N] [--json FILE] [--perf]

Builds a labelled corpus of generated per-process GPU memory traces (80 GiB card, 5 s samples,
6 h): vLLM start-up (weights load, profiling spike, KV cache preallocation, CUDA graph capture)
followed by one normal pattern (flat, allocator warming, caching sawtooth, one-off steps, a mix,
heavy noise), with or without a leak (linear creep, staircase, creep under a sawtooth) at
0.5 ... 50 MiB/min. Then it measures

  * the leak detector, replayed causally point by point through History + assess() exactly as
    the daemon does each tick;
  * the alert rules a user would write instead, evaluated with PromQL semantics by a faithful
    reimplementation (see `PromRule`): Prometheus scrapes every 15 s, evaluates rules every
    15 s, range selectors are closed intervals (Prometheus 2.x), deriv() / predict_linear() are
    the least-squares fit over the samples in the range (computed here exactly in integers), and
    `for:` fires once the expression has held at every evaluation for that long;
  * the best *tuned* rule of each family with zero false alerts on this corpus (picked with
    hindsight on the same traces: a generous baseline).

Reimplementation rather than `promtool test rules`: ~100 traces x ~130 rule variants x 1440
evaluations is minutes of pure arithmetic here but hours of promtool process start-ups and
YAML; `--check-promtool` cross-checks the reimplementation against a real promtool on a few
traces when one is installed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from exporter.analysis.history import History
from exporter.analysis.leak import LeakLatch, assess
from exporter.model import GpuSample, ProcessSample, Snapshot

MiB = 1024 * 1024
GiB = 1024 * MiB
TOTAL = 80 * GiB
T0 = 1_700_000_000
DT = 5
DURATION = 6 * 3600
NORMAL_PATTERNS = ("flat", "warming", "sawtooth", "steps", "mixed", "noisy")
LEAK_SHAPES = ("linear", "staircase", "under_sawtooth")
LEAK_RATES = (0.5, 1, 2, 5, 10, 20, 50)  # MiB/min


# --- corpus --------------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    pattern: str
    times: list[int]
    values: list[int]
    leak_rate: float | None = None  # MiB/min
    leak_shape: str = ""
    leak_start: float | None = None  # Unix s
    full_at: float | None = None  # when the leak filled the card (None: never)


def _startup(rng: random.Random) -> tuple[list[tuple[float, float]], float]:
    """Breakpoints (t_rel, level) of a vLLM start-up; returns them and the ready time."""
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
    level = rng.uniform(0.80, 0.90) * TOTAL  # KV cache preallocated up to gpu_memory_utilization
    pts.append((t, level))
    t += rng.uniform(2, 10)
    graphs = rng.uniform(0.25, 2) * GiB
    capture = rng.uniform(10, 90)
    for k in range(1, 21):  # CUDA graphs, one batch size after another
        pts.append((t + capture * k / 20, level + graphs * k / 20))
    return pts, t + capture


def _step_fn(pts: list[tuple[float, float]]):
    """Piecewise-constant function through breakpoints (t sorted)."""
    ts = [p[0] for p in pts]
    import bisect

    def f(t: float) -> float:
        i = bisect.bisect_right(ts, t) - 1
        return pts[i][1] if i >= 0 else 0.0
    return f


def _warming(rng, start):
    steps = rng.randint(4, 7)
    tau = rng.uniform(0.5, 1.5) * 60
    amount = rng.uniform(128 * MiB, 1.5 * GiB)
    weights = [0.7 ** k * rng.uniform(0.5, 1.5) for k in range(steps)]
    pts = [(start - 1, 0.0)]
    acc = 0.0
    for k in range(steps):
        acc += amount * weights[k] / sum(weights)
        pts.append((start + tau * (2 ** (k + 1) - 1) * rng.uniform(0.7, 1.3), acc))
    pts.sort()
    return _cummax_fn(pts)


def _cummax_fn(pts):
    """Monotone staircase through (t, level) points even if jittered times reorder them."""
    out, best = [], 0.0
    for t, v in pts:
        best = max(best, v)
        out.append((t, best))
    return _step_fn(out)


def _sawtooth(rng, start, amp_range=(64 * MiB, 2 * GiB)):
    period = rng.uniform(1, 12) * 60
    amp = rng.uniform(*amp_range)
    seg = 20 * MiB  # the caching allocator grows in segments
    teeth: list[tuple[float, float, float]] = []  # (start, length, amplitude)
    t = start
    while t < DURATION + 600:
        length = period * rng.uniform(0.8, 1.2)
        teeth.append((t, length, amp * rng.uniform(0.8, 1.2)))
        t += length
    import bisect
    starts = [x[0] for x in teeth]

    def f(tt: float) -> float:
        i = bisect.bisect_right(starts, tt) - 1
        if i < 0:
            return 0.0
        s, length, a = teeth[i]
        return math.floor(a * (tt - s) / length / seg) * seg
    return f


def _steps(rng, start, count):
    pts = [(start - 1, 0.0)]
    level = 0.0
    t = start
    for _ in range(count):
        t += rng.uniform(30, 120) * 60
        level += rng.uniform(256 * MiB, 3 * GiB)
        pts.append((t, level))
    if count and rng.random() < 0.5:  # sometimes the extra memory is given back later
        pts.append((t + rng.uniform(20, 60) * 60, level - rng.uniform(0.3, 1.0) * (level - pts[-2][1])))
    return _step_fn(pts)


def _leak(rng, shape, rate_mib_min, leak_start):
    rate = rate_mib_min * MiB / 60.0
    if shape == "staircase":
        interval = rng.uniform(3, 15) * 60
        size = rate * interval
        return lambda t: 0.0 if t < leak_start else (math.floor((t - leak_start) / interval) + 1) * size
    return lambda t: 0.0 if t < leak_start else rate * (t - leak_start)


def make_trace(pattern: str, seed: int, leak_rate: float | None = None, leak_shape: str = "") -> Trace:
    rng = random.Random(f"{pattern}/{seed}/{leak_rate}/{leak_shape}")
    pts, ready = _startup(rng)
    startup = _step_fn(pts)
    traffic = ready + rng.uniform(0, 300)
    parts = []
    sigma = rng.uniform(0, 8) * MiB
    spike_p = 0.002
    if pattern == "warming":
        parts.append(_warming(rng, traffic))
    elif pattern == "sawtooth":
        parts.append(_sawtooth(rng, traffic))
    elif pattern == "steps":
        parts.append(_steps(rng, traffic, rng.randint(1, 3)))
    elif pattern == "mixed":
        parts += [_warming(rng, traffic), _sawtooth(rng, traffic, (64 * MiB, 512 * MiB)),
                  _steps(rng, traffic, 1)]
    elif pattern == "noisy":
        sigma = rng.uniform(16, 32) * MiB
        spike_p = 0.01
    leak_start = None
    if leak_rate is not None:
        leak_start = traffic + rng.uniform(0, 2.5 * 3600)
        if leak_shape == "under_sawtooth":
            parts.append(_sawtooth(rng, traffic, (256 * MiB, 2 * GiB)))
        parts.append(_leak(rng, leak_shape, leak_rate, leak_start))
    times, values = [], []
    full_at = None
    for k in range(DURATION // DT):
        t = k * DT
        v = startup(t) + sum(p(t) for p in parts) + rng.gauss(0, sigma)
        if rng.random() < spike_p:
            v += rng.uniform(64 * MiB, 1 * GiB)  # a transient, one sample long
        v = min(max(0.0, v), TOTAL)
        v = int(v // (2 * MiB)) * 2 * MiB  # NVML reports whole pages
        if leak_rate is not None and full_at is None and v >= TOTAL - 256 * MiB and t > leak_start:
            full_at = T0 + t  # the process would be out of memory here
        times.append(T0 + t)
        values.append(v)
    name = pattern if leak_rate is None else f"{leak_shape}@{leak_rate}MiB/min({pattern})"
    return Trace(name, pattern, times, values, leak_rate, leak_shape,
                 None if leak_start is None else T0 + leak_start, full_at)


def corpus(seeds: int) -> list[tuple]:
    specs = [(p, s, None, "") for p in NORMAL_PATTERNS for s in range(seeds)]
    backgrounds = ("flat", "warming", "steps", "mixed", "noisy")
    for shape in LEAK_SHAPES:
        for rate in LEAK_RATES:
            for s in range(max(1, seeds // 2)):
                # under_sawtooth brings its own sawtooth: put it on a plain background
                bg = "flat" if shape == "under_sawtooth" else backgrounds[(s + int(rate * 2)) % len(backgrounds)]
                specs.append((bg, s, rate, shape))
    return specs


# --- the leak detector, replayed as the daemon runs it ------------------------------------
def detector_episodes(trace: Trace) -> tuple[list[float], float]:
    """Start times of the detector's alert episodes (verdicts through the LeakLatch hysteresis,
    as a finding would be raised and cleared); also seconds spent in update + assess."""
    history = History()
    latch = LeakLatch()
    uuid = "GPU-bench"
    episodes: list[float] = []
    active = False
    spent = 0.0
    for t, v in zip(trace.times, trace.values, strict=True):
        proc = ProcessSample(pid=4242, used_bytes=v, name="python3", start_time=T0 - 1.0, role="vllm")
        snap = Snapshot(timestamp=float(t), gpus=(GpuSample(index="0", uuid=uuid, total_bytes=TOTAL,
                                                            used_bytes=v, processes=(proc,)),))
        c0 = time.perf_counter()
        history.update(snap)
        verdict = assess(history.process_memory(uuid, proc.identity), TOTAL, float(t))
        spent += time.perf_counter() - c0
        now_active = latch.update(proc.identity, verdict.suspected, float(t))
        if now_active and not active:
            episodes.append(float(t))
        active = now_active
    return episodes, spent


# --- PromQL baselines ------------------------------------------------------------------------
SCRAPE = 15
EVAL = 15
EVAL_OFFSET = 7  # rule evaluation is not aligned with scrapes


@dataclass(frozen=True)
class PromRule:
    func: str  # deriv | predict_linear
    range_s: int
    for_s: int
    threshold: float  # bytes/s for deriv, bytes for predict_linear
    horizon_s: int = 0

    @property
    def text(self) -> str:
        r = _dur(self.range_s)
        if self.func == "deriv":
            return f"deriv(x[{r}]) > {self.threshold * 3600 / MiB:g} MiB/h for {_dur(self.for_s)}"
        return f"predict_linear(x[{r}], {self.horizon_s // 3600}*3600) > total for {_dur(self.for_s)}"


def _dur(s: int) -> str:
    return f"{s // 3600}h" if s % 3600 == 0 else f"{s // 60}m"


def scraped(trace: Trace) -> tuple[list[int], list[int]]:
    """What Prometheus stores: the exporter's latest sample at each 15 s scrape."""
    ts, vs = [], []
    i = 0
    n = len(trace.times)
    for s in range(trace.times[0] + 3, trace.times[-1] + 1, SCRAPE):
        while i + 1 < n and trace.times[i + 1] <= s:
            i += 1
        ts.append(s)
        vs.append(trace.values[i])
    return ts, vs


def regression_at_evals(ts: list[int], vs: list[int], range_s: int, offset: int = EVAL_OFFSET):
    """For each rule evaluation time T: (T, slope, mean_t, mean_v) of samples in [T-range, T].

    Least squares over the range's samples as PromQL's deriv/predict_linear do, with exact
    integer sums in a sliding window (so no float cancellation for 80 GiB values).
    """
    out = []
    lo = hi = 0
    st = stt = sv = stv = 0
    n = len(ts)
    for T in range(ts[0] + offset, ts[-1] + 1, EVAL):
        while hi < n and ts[hi] <= T:
            t, v = ts[hi] - ts[0], vs[hi]
            st += t
            stt += t * t
            sv += v
            stv += t * v
            hi += 1
        while lo < hi and ts[lo] < T - range_s:
            t, v = ts[lo] - ts[0], vs[lo]
            st -= t
            stt -= t * t
            sv -= v
            stv -= t * v
            lo += 1
        k = hi - lo
        if k < 2:
            out.append((T, None, 0.0, 0.0))
            continue
        den = k * stt - st * st
        slope = (k * stv - st * sv) / den if den else None
        out.append((T, slope, st / k + ts[0], sv / k))
    return out


def rule_episodes(regs, rule: PromRule) -> list[float]:
    """Times at which the alert starts firing, with Prometheus `for:` semantics."""
    episodes = []
    active_at = None
    firing = False
    for T, slope, mean_t, mean_v in regs:
        if slope is None:
            cond = False
        elif rule.func == "deriv":
            cond = slope > rule.threshold
        else:  # intercept at T plus slope * horizon, as predict_linear computes it
            cond = mean_v + slope * (T + rule.horizon_s - mean_t) > rule.threshold
        if not cond:
            active_at, firing = None, False
            continue
        if active_at is None:
            active_at = T
        if not firing and T - active_at >= rule.for_s:
            firing = True
            episodes.append(float(T))
    return episodes


SPEC_RULES = (
    PromRule("predict_linear", 1800, 600, TOTAL, 4 * 3600),
    PromRule("deriv", 1800, 1800, 100 * MiB / 3600),
)


def tuned_rules() -> list[PromRule]:
    rules = []
    for r in (1800, 3600, 7200):
        for f in (600, 1800, 3600, 7200):
            for th in (25, 50, 100, 200, 400, 800, 1600):
                rules.append(PromRule("deriv", r, f, th * MiB / 3600))
            for h in (1, 4, 12, 24):
                rules.append(PromRule("predict_linear", r, f, TOTAL, h * 3600))
    return rules


# --- running and scoring -----------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    pattern: str
    leak_rate: float | None
    leak_shape: str
    leak_start: float | None
    full_at: float | None
    end: float
    episodes: dict = field(default_factory=dict)  # method -> list of episode start times
    detector_seconds: float = 0.0
    ticks: int = 0


def run_one(spec) -> Outcome:
    trace = make_trace(*spec)
    out = Outcome(trace.name, trace.pattern, trace.leak_rate, trace.leak_shape, trace.leak_start,
                  trace.full_at, float(trace.times[-1]))
    out.episodes["detector"], out.detector_seconds = detector_episodes(trace)
    out.ticks = len(trace.times)
    ts, vs = scraped(trace)
    regs = {}
    for rule in list(SPEC_RULES) + tuned_rules():
        if rule.range_s not in regs:
            regs[rule.range_s] = regression_at_evals(ts, vs, rule.range_s)
        out.episodes[rule] = rule_episodes(regs[rule.range_s], rule)
    return out


def score(outcomes: list[Outcome], method) -> dict:
    false_traces = false_eps = 0
    caught = caught_1 = leaks = leaks_1 = 0
    delays: list[float] = []
    per_rate: dict[float, list] = {}
    for o in outcomes:
        eps = o.episodes[method]
        onset = o.leak_start if o.leak_rate is not None else math.inf
        early = [e for e in eps if e < onset]
        if early:
            false_traces += 1
            false_eps += len(early)
        if o.leak_rate is None:
            continue
        leaks += 1
        leaks_1 += o.leak_rate >= 1
        deadline = o.full_at if o.full_at is not None else o.end
        hits = [e for e in eps if onset <= e <= deadline]
        row = per_rate.setdefault(o.leak_rate, [0, 0, []])
        row[1] += 1
        if hits:
            d = hits[0] - onset
            delays.append(d)
            caught += 1
            caught_1 += o.leak_rate >= 1
            row[0] += 1
            row[2].append(d)
    normal = sum(1 for o in outcomes if o.leak_rate is None)
    normal_false = sum(1 for o in outcomes if o.leak_rate is None and o.episodes[method])
    return {
        "false_traces": false_traces, "false_episodes": false_eps, "normal_traces": normal,
        "normal_false": normal_false, "caught": caught, "leaks": leaks, "caught_1": caught_1,
        "leaks_1": leaks_1,
        "median_delay": statistics.median(delays) if delays else None,
        "max_delay": max(delays) if delays else None, "per_rate": per_rate,
    }


def _min(s):
    return "–" if s is None else f"{s / 60:.0f} min"


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [
        "| method | false alerts: leak-free traces (episodes) | pre-onset alerts on leak traces | "
        "leaks caught >= 1 MiB/min | all leaks caught | median delay | max delay |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        pre = s["false_traces"] - s["normal_false"]
        lines.append(
            f"| {name} | {s['normal_false']}/{s['normal_traces']} ({s['false_episodes']} total) | {pre} | "
            f"{s['caught_1']}/{s['leaks_1']} | {s['caught']}/{s['leaks']} | {_min(s['median_delay'])} | "
            f"{_min(s['max_delay'])} |")
    return "\n".join(lines)


def per_rate_table(s: dict) -> str:
    lines = ["| leak rate (MiB/min) | caught | median delay | max delay |", "|---|---|---|---|"]
    for rate in sorted(s["per_rate"]):
        c, n, d = s["per_rate"][rate]
        lines.append(f"| {rate:g} | {c}/{n} | {_min(statistics.median(d) if d else None)} | "
                     f"{_min(max(d) if d else None)} |")
    return "\n".join(lines)


def _first_catch(o: Outcome, method) -> float | None:
    deadline = o.full_at if o.full_at is not None else o.end
    hits = [e for e in o.episodes[method] if o.leak_start <= e <= deadline]
    return hits[0] - o.leak_start if hits else None


def _common_delays(outcomes, a, b) -> list[tuple[float, float]]:
    """(delay of a, delay of b) on the leaks both catch."""
    out = []
    for o in outcomes:
        if o.leak_rate is None or o.leak_start is None:
            continue
        da, db = _first_catch(o, a), _first_catch(o, b)
        if da is not None and db is not None:
            out.append((da, db))
    return out


def best_zero_false(outcomes, rules, func) -> tuple[PromRule | None, dict | None]:
    best = None
    for rule in rules:
        if rule.func != func:
            continue
        s = score(outcomes, rule)
        if s["false_episodes"]:
            continue
        key = (s["caught"], -(s["median_delay"] or math.inf))
        if best is None or key > best[0]:
            best = (key, rule, s)
    return (best[1], best[2]) if best else (None, None)


# --- per-tick cost ----------------------------------------------------------------------------
def perf(processes: int = 512, minutes: int = 60) -> str:
    """Worst and mean cost of History.update + assess for `processes` processes per 5 s tick."""
    history = History()
    rng = random.Random(1)
    uuids = [f"GPU-{g}" for g in range(8)]
    procs = [(uuids[i % 8], i + 1000, 70 * GiB + rng.uniform(0, GiB)) for i in range(processes)]
    costs = []
    for k in range(minutes * 60 // DT):
        t = float(T0 + k * DT)
        gpus = []
        for uuid in uuids:
            ps = tuple(ProcessSample(pid=pid, used_bytes=int(base + k * 4096 * (pid % 3) + rng.gauss(0, 4 * MiB)),
                                     start_time=float(T0 - 10), host_rss_bytes=2 * GiB)
                       for u, pid, base in procs if u == uuid)
            gpus.append(GpuSample(index=uuid[-1], uuid=uuid, total_bytes=TOTAL, used_bytes=70 * GiB, processes=ps))
        snap = Snapshot(timestamp=t, gpus=tuple(gpus))
        c0 = time.perf_counter()
        history.update(snap)
        for gpu in gpus:
            for p in gpu.processes:
                assess(history.process_memory(gpu.uuid, p.identity), TOTAL, t)
                assess(history.process_rss(p.identity), 512 * GiB, t)
        costs.append(time.perf_counter() - c0)
    tail = costs[len(costs) // 2:]  # once every window length has history
    return (f"{processes} processes (GPU memory + host RSS each), {minutes} min of 5 s ticks: "
            f"mean {statistics.mean(tail) * 1000:.1f} ms/tick, "
            f"p99 {sorted(tail)[int(len(tail) * 0.99)] * 1000:.1f} ms, max {max(tail) * 1000:.1f} ms")


# --- promtool cross-check --------------------------------------------------------------------
def check_promtool(specs, points: int = 960, step: int = 300) -> tuple[int, int, int]:
    """Run the two spec rules through real `promtool test rules` on the first 4 h of some traces
    and count the evaluation times (every `step` s) where promtool and this reimplementation
    agree on whether the alert fires. Returns (agreeing, checked, of which firing)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
    checked = agree = firing = 0
    for spec in specs:
        _, vs = scraped(make_trace(*spec))
        vs = vs[:points]
        ts = [i * SCRAPE for i in range(len(vs))]  # promtool's input series start at 0 s
        for rule in SPEC_RULES:
            regs = regression_at_evals(ts, vs, rule.range_s, offset=0)  # promtool evaluates at 0, 15 s, ...
            at = list(range(step, ts[-1], step))
            theirs = _promtool_firing(promtool, vs, rule, at)
            for T in at:
                mine = _firing_at(regs, rule, T)
                checked += 1
                agree += mine == theirs[T]
                firing += theirs[T]
    return agree, checked, firing


def _firing_at(regs, rule: PromRule, T: int) -> bool:
    """Whether the alert is firing at evaluation time T (a firing episode not yet interrupted)."""
    active_at = None
    firing = False
    for t, slope, mean_t, mean_v in regs:
        if t > T:
            break
        cond = slope is not None and (slope > rule.threshold if rule.func == "deriv" else
                                      mean_v + slope * (t + rule.horizon_s - mean_t) > rule.threshold)
        if not cond:
            active_at, firing = None, False
            continue
        if active_at is None:
            active_at = t
        firing = t - active_at >= rule.for_s
    return firing


def _promtool_firing(promtool: str, vs: list[int], rule: PromRule, at: list[int]) -> dict[int, bool]:
    expr = (f"deriv(x[{_dur(rule.range_s)}]) > {rule.threshold!r}" if rule.func == "deriv" else
            f"predict_linear(x[{_dur(rule.range_s)}], {rule.horizon_s}) > {rule.threshold!r}")
    result = {}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "rules.yml"), "w") as f:  # JSON is YAML
            json.dump({"groups": [{"name": "g", "interval": f"{EVAL}s", "rules": [
                {"alert": "Leak", "expr": expr, "for": _dur(rule.for_s)}]}]}, f)
        for T in at:
            test = {"rule_files": ["rules.yml"], "evaluation_interval": f"{EVAL}s", "tests": [{
                "interval": f"{SCRAPE}s",
                "input_series": [{"series": "x", "values": " ".join(str(v) for v in vs)}],
                "alert_rule_test": [{"eval_time": f"{T}s", "alertname": "Leak",
                                     "exp_alerts": [{"exp_labels": {}}]}]}]}
            with open(os.path.join(d, "test.yml"), "w") as f:
                json.dump(test, f)
            proc = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=d,
                                  capture_output=True, text=True, timeout=120)
            result[T] = proc.returncode == 0
    return result


# --- main --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=14, help="seeds per normal pattern (leaks: half)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the raw outcome summary here")
    ap.add_argument("--perf", action="store_true", help="also measure the per-tick cost for 512 processes")
    ap.add_argument("--check-promtool", action="store_true", help="cross-check the PromQL reimplementation")
    args = ap.parse_args(argv)

    specs = corpus(args.seeds)
    started = time.time()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        outcomes = list(pool.map(run_one, specs, chunksize=2))
    elapsed = time.time() - started

    det = score(outcomes, "detector")
    rows = [("leak detector (exporter.analysis.leak)", det)]
    for rule in SPEC_RULES:
        rows.append((f"`{rule.text}`", score(outcomes, rule)))
    tuned = tuned_rules()
    for func in ("deriv", "predict_linear"):
        rule, s = best_zero_false(outcomes, tuned, func)
        if s is not None:
            s["_method"] = rule
        if rule is None:
            rows.append((f"best zero-false-alert {func} (none found)", score(outcomes, tuned[0])))
        else:
            rows.append((f"best zero-false-alert {func}: `{rule.text}`", s))
    normal = sum(1 for o in outcomes if o.leak_rate is None)
    print(f"# Leak detection quality\n\n{len(outcomes)} traces ({normal} leak-free, "
          f"{len(outcomes) - normal} with a leak), 6 h each at 5 s, 80 GiB card; "
          f"{elapsed:.0f} s on {args.workers} workers.\n")
    print(table(rows))
    print("\n## Leak detector by leak rate\n")
    print(per_rate_table(det))
    ticks = sum(o.ticks for o in outcomes)
    print(f"\nDetector cost in replay: {sum(o.detector_seconds for o in outcomes) / ticks * 1e6:.0f} µs "
          f"per process per tick (History.update + assess).")
    zero = [(n, s) for n, s in rows[1:] if s["false_episodes"] == 0 and s["median_delay"] is not None]
    if zero and det["median_delay"] is not None:
        best = min(s["median_delay"] for _, s in zero)
        print(f"Median delay: detector {det['median_delay'] / 60:.0f} min vs best zero-false-alert "
              f"baseline {best / 60:.0f} min (ratio {det['median_delay'] / best:.2f}).")
    for name, s in rows[3:]:
        common = _common_delays(outcomes, "detector", s["_method"]) if "_method" in s else []
        if common:
            print(f"On the {len(common)} leaks that the {name.split(':')[0]} also catches: median delay detector "
                  f"{statistics.median(d for d, _ in common) / 60:.0f} min vs "
                  f"{statistics.median(b for _, b in common) / 60:.0f} min.")
    if args.perf:
        print("\n" + perf())
    if args.check_promtool:
        picks = [s for s in specs if s[2] in (None, 20, 50) and s[1] == 0][:6]
        agree, checked, firing = check_promtool(picks)
        print(f"\npromtool cross-check ({len(picks)} traces, first 4 h, every 5 min): {agree}/{checked} "
              f"evaluation points agree on whether each alert fires ({firing} of them firing).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": o.name, "leak_rate": o.leak_rate, "leak_start": o.leak_start,
                        "full_at": o.full_at, "detector": o.episodes["detector"]} for o in outcomes], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
