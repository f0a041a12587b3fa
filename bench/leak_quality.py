"""How near the statistical limit does the leak detector find leaks, against today's detector
and the PromQL rules people write instead, and at what cost per tick?

    python bench/leak_quality.py [--seeds 8] [--first-seed 0] [--workers 2] [--families a,b]
                                 [--code DIR ...] [--perf] [--check-promtool] [--json FILE]

The corpus (bench/leak_corpus.py) is one family per shape real vLLM memory takes: start-up,
warm-up plateaus, allocator sawtooth, level shifts (a second model, a sleep and wake), noise
that wanders, heavy noise, and two where the allocator probe reports on the process; and leaks:
slow, fast, late, in steps, under a sawtooth, after a level shift, in heavy noise, and two where
the allocator probe reports on the process. Each trace is 6 h of 5 s samples.

For every family it prints, side by side from one run:
  * the statistical limit: how long after the onset a least-squares slope over the samples
    since the onset (the onset known) reaches z = 5, T = (z sigma sqrt(12 dt) / r)^(2/3), with
    the family's effective noise (see bench/README.md and leak_corpus.limit_seconds);
  * each code tree's detector (`--code DIR`, default this tree; e.g. a checkout of today's
    detector beside it), replayed tick by tick as the daemon runs it (History, then
    LeakDetector.detect with its latch): false alerts, leaks caught, median delay;
  * the best zero-false-alert PromQL rule (picked with hindsight over the whole corpus, a
    generous baseline): its delay and false alerts per family.
Probed families run twice per tree, with and without the probe's numbers: the gain; with them
also at the other bucket phases where the trace is replayed at every phase.
With ../shared/real-traces beside the checkout, every real series is replayed through the
whole analysis (`analyze`'s replay): the leak-free ones must raise no leak, and a 4 MiB/min leak
laid over each long one must be caught (first finding per tree).
`--perf` times LeakDetector.detect per tick on 8 GPUs x 64 processes with 6 h of history, the
trees alternating tick by tick.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
REAL_TRACES = ROOT.parent / "shared" / "real-traces"
sys.path.insert(0, str(BENCH))

from leak_corpus import DURATION, FAMILIES, FAMILY, T0, TOTAL, MiB, Trace, limit_seconds, make_trace  # noqa: E402
from leak_replay import PID, replay  # noqa: E402

# --- the phase of History's minute buckets ---------------------------------------------------
# History cuts each series into minutes at an offset drawn from its key (crc32 of the key's
# repr), so every GPU's process series sees its 5 s samples grouped at another phase: which
# sample opens a minute. The leak-free families are replayed under several GPU UUIDs whose
# process series' minutes open at phases spread over the minute; a false alert at any of them
# is one a real host can raise. The first UUID is the one the leak families' delays use.
PHASES = ("GPU-bench", "GPU-test", "GPU-b", "GPU-c")


def bucket_phase(uuid: str) -> int:
    """Seconds after the trace's start (0-55, on the 5 s grid) of the first sample that opens a
    minute bucket of the process series replayed under `uuid` (History's own offset)."""
    from exporter.analysis.history import bucket_offset

    offset = bucket_offset(("mem", uuid, PID, T0 - 1.0), 60.0)
    return math.ceil(((offset - T0) % 60.0) / 5.0) * 5 % 60


def phase_uuids() -> list[str]:
    """One UUID per phase on the 5 s grid (12), the bench's own first."""
    found = {bucket_phase(u): u for u in reversed(PHASES)}
    j = 0
    while len(found) < 12:
        found.setdefault(bucket_phase(f"GPU-phase-{j}"), f"GPU-phase-{j}")
        j += 1
    return [PHASES[0]] + [u for _, u in sorted(found.items()) if u != PHASES[0]]


# --- the detector of one code tree, in a worker process ------------------------------------
# A worker runs with that tree's `exporter` first on its path (--worker DIR); it reads one JSON
# request per line on stdin and answers one JSON line each.

def _replay(spec: list, probe: bool, uuid: str = "GPU-bench") -> dict:
    """One trace through leak_replay.replay: the start of each leak-finding episode, and the
    evidence of the first that began after the onset."""
    trace = make_trace(*spec)
    probed = probe and trace.allocated is not None
    out = replay(trace.times, trace.values, uuid, trace.allocated if probed else None,
                 trace.reserved if probed else None)
    after = [f for t, f in zip(out.starts, out.first, strict=True)
             if trace.leak_start is not None and t >= trace.leak_start]
    return {"episodes": out.starts, "evidence": dict(after[0].evidence) if after else None,
            "cpu": out.cpu_seconds, "ticks": out.ticks}


def _real(entry: dict, leak_mib_min: float) -> dict:
    """A real series through the whole analysis: the leak findings (first_detected_at)."""
    from exporter.postmortem.analyze import replay
    from exporter.postmortem.trace import read_traces

    snapshots = read_traces([str(REAL_TRACES / entry["file"])])
    if leak_mib_min:
        t0 = snapshots[0].timestamp
        laid = []
        for snap in snapshots:
            extra = int((snap.timestamp - t0) / 60 * leak_mib_min * MiB)
            gpus = tuple(dataclasses.replace(
                g, used_bytes=None if g.used_bytes is None else g.used_bytes + extra,
                processes=tuple(p if p.used_bytes is None else dataclasses.replace(p, used_bytes=p.used_bytes + extra)
                                for p in g.processes)) for g in snap.gpus)
            laid.append(dataclasses.replace(snap, gpus=gpus))
        snapshots = laid
    findings = replay(snapshots)
    return {"start": snapshots[0].timestamp, "end": snapshots[-1].timestamp,
            "leaks": sorted(f.first_detected_at for f in findings if f.kind == "leak"),
            "others": sorted({f.kind for f in findings if f.kind != "leak"})}


class _Fleet:
    """8 GPUs x 64 processes (1 GiB, a 60 s / 64 MiB sawtooth, 8 MiB noise; RSS with 4 MiB
    noise), 6 h of history built first; then each tick() is one more 5 s sample through
    History + LeakDetector.detect, timed."""

    def __init__(self, gpus: int = 8, procs: int = 64, hours: float = 6.0):
        import random

        from exporter.analysis.history import History
        from exporter.analysis.leak import LeakConfig
        from exporter.analysis.leak_detector import LeakDetector
        from exporter.model import GpuSample, ProcessSample, Snapshot

        self.GpuSample, self.ProcessSample, self.Snapshot = GpuSample, ProcessSample, Snapshot
        self.rng = random.Random(7)
        self.gpus, self.procs = gpus, procs
        self.history, self.detector, self.config = History(), LeakDetector(), LeakConfig()
        self.k = 0
        for _ in range(int(hours * 720)):
            self.history.update(self._snapshot())
        for _ in range(12):  # the detector's own state (latch, memos) warmed up
            self.tick()

    def _snapshot(self):
        t = T0 + 5.0 * self.k
        self.k += 1
        gpus = []
        for g in range(self.gpus):
            ps = []
            for i in range(self.procs):
                pid = 20000 + 1000 * g + i
                saw = ((t + 7 * i) % 60) / 60 * 64 * MiB
                used = int((1024 * MiB + saw + self.rng.gauss(0, 8 * MiB)) // (2 * MiB) * 2 * MiB)
                ps.append(self.ProcessSample(pid=pid, used_bytes=used, name="python3", start_time=T0 - 10.0,
                                             host_rss_bytes=int(512 * MiB + self.rng.gauss(0, 4 * MiB))))
            gpus.append(self.GpuSample(index=str(g), uuid=f"GPU-{g}", total_bytes=TOTAL,
                                       used_bytes=sum(p.used_bytes for p in ps), processes=tuple(ps)))
        return self.Snapshot(timestamp=t, gpus=tuple(gpus))

    def tick(self) -> float:
        snap = self._snapshot()
        c0 = time.thread_time()
        self.history.update(snap)
        self.detector.detect(self.history, snap, (), self.config, 3600.0)
        return time.thread_time() - c0


def worker_main(code: str) -> None:
    fleet = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "replay":
            out = _replay(req["spec"], req.get("probe", False), req.get("uuid", PHASES[0]))
        elif req["op"] == "real":
            out = _real(req["entry"], req["leak"])
        elif req["op"] == "perf_build":
            fleet = _Fleet()
            out = {"ok": True}
        else:  # perf_tick
            assert fleet is not None
            out = {"cpu": fleet.tick()}
        print(json.dumps(out), flush=True)


class Worker:
    """A worker process with `code`'s exporter package first on its path."""

    def __init__(self, code: str):
        env = dict(os.environ, PYTHONPATH=code)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", code],
                                     cwd=code, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, req: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("worker died")
        return json.loads(line)

    def ask(self, req: dict) -> dict:
        self.send(req)
        return self.receive()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_requests(codes: list[str], requests: list[dict], workers: int) -> dict[str, list[dict]]:
    """Every request answered by every tree: {code: [answer per request]}, by `workers` worker
    processes per tree (at least one), each through its share of the requests."""
    from concurrent.futures import ThreadPoolExecutor

    per_code = max(1, workers // len(codes))
    answers: dict[str, list[dict]] = {c: [{} for _ in requests] for c in codes}

    def work(code: str, share: list[int]) -> None:
        w = Worker(code)
        try:
            for i in share:
                answers[code][i] = w.ask(requests[i])
        finally:
            w.close()
    shares = [(c, list(range(k, len(requests), per_code))) for c in codes for k in range(per_code)]
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        for f in [pool.submit(work, c, share) for c, share in shares if share]:
            f.result()
    return answers


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



# --- scoring -------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    family: str
    leak_rate: float | None
    leak_start: float | None
    full_at: float | None
    end: float
    limit: float | None
    episodes: dict = field(default_factory=dict)  # method -> list of episode start times


def _rules_one(spec) -> tuple[Outcome, dict]:
    trace = make_trace(*spec)
    out = Outcome(trace.name, trace.family, trace.leak_rate, trace.leak_start, trace.full_at,
                  float(trace.times[-1]), limit_seconds(trace))
    ts, vs = scraped(trace)
    regs = {}
    eps = {}
    for rule in list(SPEC_RULES) + tuned_rules():
        if rule.range_s not in regs:
            regs[rule.range_s] = regression_at_evals(ts, vs, rule.range_s)
        eps[rule] = rule_episodes(regs[rule.range_s], rule)
    return out, eps


def while_leaking(o: Outcome, method) -> list[float]:
    """The episodes begun between the leak's onset and the card filling (or the trace's end)."""
    if o.leak_start is None:
        return []
    deadline = o.full_at if o.full_at is not None else o.end
    return [e for e in o.episodes[method] if o.leak_start <= e <= deadline]


def first_catch(o: Outcome, method) -> float | None:
    hits = while_leaking(o, method)
    return hits[0] - o.leak_start if hits and o.leak_start is not None else None


def false_alerts(o: Outcome, method) -> int:
    onset = o.leak_start if o.leak_start is not None else math.inf
    return sum(1 for e in o.episodes[method] if e < onset)


def exposure_days(o: Outcome) -> float:
    """The process-days of a trace in which any finding is a false one: up to its leak's onset."""
    end = o.leak_start if o.leak_start is not None else T0 + DURATION
    return (end - T0) / 86400


def poisson_upper(k: int, confidence: float = 0.95) -> float:
    """The one-sided upper confidence bound on a Poisson mean after k events (exact: the mean at
    which k or fewer events have probability 1 - confidence), by bisection."""
    def at_most_k(mean: float) -> float:
        term = total = math.exp(-mean)
        for i in range(1, k + 1):
            term *= mean / i
            total += term
        return total
    lo, hi = 0.0, k + 10.0 * math.sqrt(k + 1) + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at_most_k(mid) > 1 - confidence else (lo, mid)
    return hi


def cleared_while_leaking(o: Outcome, method) -> bool:
    """Whether the finding cleared and was raised again while the leak went on (a page that
    resolves in the middle of a leak)."""
    return len(while_leaking(o, method)) > 1


def summary(outcomes: list[Outcome], method) -> dict:
    leaks = [o for o in outcomes if o.leak_rate is not None]
    delays = [d for d in (first_catch(o, method) for o in leaks) if d is not None]
    return {"false_traces": sum(1 for o in outcomes if false_alerts(o, method)),
            "cleared": sum(1 for o in leaks if cleared_while_leaking(o, method)),
            "false_episodes": sum(false_alerts(o, method) for o in outcomes),
            "traces": len(outcomes), "leaks": len(leaks), "caught": len(delays),
            "exposure_days": sum(exposure_days(o) for o in outcomes),
            "median_delay": statistics.median(delays) if delays else None,
            "max_delay": max(delays) if delays else None}


def median_over_limit(outcomes: list[Outcome], method) -> float | None:
    """The median over the leaks of each one's delay over its own limit (a leak missed counts as
    infinitely late). Not the median delay over the median limit: a family mixes backgrounds whose
    limits differ tenfold (leak_4: 3.3 min on white noise, 40 min on noise that wanders), and a
    ratio of medians divides the delay of one trace by the limit of another."""
    ratios = [math.inf if d is None else d / o.limit
              for o in outcomes if o.leak_rate is not None and o.limit
              for d in [first_catch(o, method)]]
    return statistics.median(ratios) if ratios else None


def best_zero_false(outcomes, rules):
    best = None
    for rule in rules:
        s = summary(outcomes, rule)
        if s["false_episodes"]:
            continue
        key = (s["caught"], -(s["median_delay"] or math.inf))
        if best is None or key > best[0]:
            best = (key, rule, s)
    return (best[1], best[2]) if best else (None, None)


def _min(s: float | None) -> str:
    return "–" if s is None else f"{s / 60:.1f} min" if s < 600 else f"{s / 60:.0f} min"


def _ratio(r: float | None) -> str:
    return "–" if r is None else "never" if math.isinf(r) else f"{r:.2f}x"

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
def real_entries() -> list[dict]:
    import csv
    index = REAL_TRACES / "INDEX.tsv"
    if not index.is_file():
        return []
    with open(index, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def main(argv=None) -> int:
    from exporter.analysis.leak import LeakConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="traces per family")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first trace's seed (another range of seeds is a corpus not tuned on)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--families", default="", help="comma-separated subset of the families")
    ap.add_argument("--code", nargs="+", default=[str(ROOT)], metavar="DIR",
                    help="code trees to compare (each its exporter package), the first is the new one")
    ap.add_argument("--uuids", default=",".join(PHASES),
                    help="GPU UUIDs (bucket phases) the leak-free families are replayed under; the first "
                         "also gives the leak families' delays")
    ap.add_argument("--all-phases", action="store_true",
                    help="replay the leak-free families at all 12 phases of the 5 s grid")
    ap.add_argument("--phase-leaks", action="store_true",
                    help="also replay the leak families at every phase: their false alerts before the onset "
                         "and their delays per phase")
    ap.add_argument("--perf", action="store_true", help="also time LeakDetector.detect per tick, 8x64, 6 h history")
    ap.add_argument("--perf-ticks", type=int, default=60)
    ap.add_argument("--check-promtool", action="store_true", help="cross-check the PromQL reimplementation")
    ap.add_argument("--json", help="also write the raw outcomes here")
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0

    codes = [str(Path(c).resolve()) for c in args.code]
    names = {c: ("this tree" if c == str(ROOT) else Path(c).name) for c in codes}
    fams = [f for f in FAMILIES if not args.families or f.name in args.families.split(",")]
    specs = [(f.name, s) for f in fams for s in range(args.first_seed, args.first_seed + args.seeds)]
    probed = [i for i, (f, _) in enumerate(specs) if f.startswith("probed_")]
    started = time.time()
    requests = [{"op": "replay", "spec": list(s), "probe": False} for s in specs]
    requests += [{"op": "replay", "spec": list(specs[i]), "probe": True} for i in probed]
    uuids = phase_uuids() if args.all_phases else args.uuids.split(",")
    free = [i for i, (f, _) in enumerate(specs) if args.phase_leaks or not FAMILY[f].leak]
    for i in free:
        requests[i]["uuid"] = uuids[0]
    phased = [(i, u) for u in uuids[1:] for i in free]
    requests += [{"op": "replay", "spec": list(specs[i]), "probe": False, "uuid": u} for i, u in phased]
    # The probed traces with the probe's numbers at the other phases too (those replayed at every phase).
    probed_phased = [(i, u) for u in uuids[1:] for i in probed if i in free]
    requests += [{"op": "replay", "spec": list(specs[i]), "probe": True, "uuid": u} for i, u in probed_phased]
    reals = real_entries()
    long_real = []
    for e in reals:
        requests.append({"op": "real", "entry": e, "leak": 0})
    answers = run_requests(codes, requests, args.workers)
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        ruled = list(pool.map(_rules_one, specs, chunksize=2))
    outcomes = [o for o, _ in ruled]
    for (o, eps), k in zip(ruled, range(len(specs)), strict=True):
        o.episodes.update(eps)
        for c in codes:
            o.episodes[c] = answers[c][k]["episodes"]
    for j, i in enumerate(probed):
        for c in codes:
            outcomes[i].episodes[(c, "probe")] = answers[c][len(specs) + j]["episodes"]
    phase_base = len(specs) + len(probed)
    # per_phase[uuid][code]: {spec index: episodes} of the traces replayed at every phase
    per_phase = {u: {c: {i: answers[c][i]["episodes"] for i in free} for c in codes} for u in uuids[:1]}
    for j, (i, u) in enumerate(phased):
        for c in codes:
            per_phase.setdefault(u, {}).setdefault(c, {})[i] = answers[c][phase_base + j]["episodes"]
    probe_base = phase_base + len(phased)
    for j, (i, u) in enumerate(probed_phased):
        for c in codes:
            outcomes[i].episodes[(c, "probe", u)] = answers[c][probe_base + j]["episodes"]
    real_base = probe_base + len(probed_phased)
    real_free = {e["file"]: {c: answers[c][real_base + k] for c in codes} for k, e in enumerate(reals)}
    long_real = [e for e in reals if e["label"] == "no_leak"
                 and real_free[e["file"]][codes[0]]["end"] - real_free[e["file"]][codes[0]]["start"] >= 45 * 60]
    laid = run_requests(codes, [{"op": "real", "entry": e, "leak": 4} for e in long_real], args.workers) \
        if long_real else {}
    elapsed = time.time() - started

    rule, _ = best_zero_false(outcomes, tuned_rules())
    print(f"# Leak detection near the limit\n\n{len(outcomes)} traces ({args.seeds} per family), 6 h each "
          f"at 5 s; {elapsed:.0f} s on {args.workers} worker{'s' if args.workers != 1 else ''}. Trees: "
          + ", ".join(f"{names[c]} ({c})" for c in codes) + ".")
    print(f"Best zero-false-alert PromQL rule over the traces run: `{rule.text if rule else 'none'}`.\n")
    new, old = codes[0], codes[1] if len(codes) > 1 else None
    # "÷ own limit": the median over the family's leaks of each one's delay over its own limit.
    head = ["family", "limit", f"{names[new]}: delay", "÷ own limit", "caught", "false"]
    if old:
        head += [f"{names[old]}: delay", "÷ own limit", "caught", "false"]
    head += ["PromQL rule: delay", "caught", "false"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for fam in fams:
        group = [o for o in outcomes if o.family == fam.name]
        lims = [o.limit for o in group if o.limit is not None]
        limit = statistics.median(lims) if lims else None
        row = [fam.name, _min(limit)]
        for method in [new] + ([old] if old else []) + ([rule] if rule else []):
            s = summary(group, method)
            caught = f"{s['caught']}/{s['leaks']}" if fam.leak else "–"
            false = f"{s['false_traces']}/{s['traces']}" + (f" ({s['false_episodes']})" if s["false_episodes"] else "")
            row += [_min(s["median_delay"])] + ([_ratio(median_over_limit(group, method))] if method in codes else [])
            row += [caught, false]
        print("| " + " | ".join(row) + " |")
    print()
    for method, label in [(new, names[new])] + ([(old, names[old])] if old else []) + \
            ([(rule, f"PromQL `{rule.text}`")] if rule else []):
        s = summary(outcomes, method)
        print(f"- {label}: false alerts on {s['false_traces']}/{s['traces']} traces ({s['false_episodes']} episodes), "
              f"leaks caught {s['caught']}/{s['leaks']}, median delay {_min(s['median_delay'])}, "
              f"max {_min(s['max_delay'])}, cleared while leaking {s['cleared']}/{s['leaks']}.")
        if method in codes:  # the rate the false-alarm budget bounds
            k, days = s["false_episodes"], s["exposure_days"]
            print(f"  False alerts per process-day: {k} in {days:.2f} days before any leak, {k / days:.3f} "
                  f"(95 % upper bound {poisson_upper(k) / days:.3f}; the default budget "
                  f"{LeakConfig().false_alarms_per_day}).")
    for r in SPEC_RULES:
        s = summary(outcomes, r)
        print(f"- PromQL `{r.text}`: false alerts on {s['false_traces']}/{s['traces']} traces, "
              f"leaks caught {s['caught']}/{s['leaks']}, median delay {_min(s['median_delay'])}.")
    for c in codes:
        ratios = [(r, fam.name) for fam in fams if fam.leak
                  for r in [median_over_limit([o for o in outcomes if o.family == fam.name], c)] if r is not None]
        if ratios:
            best, worst = min(ratios), max(ratios)
            span = f"{_ratio(best[0])} ({best[1]})" + ("" if best == worst else f" to {_ratio(worst[0])} ({worst[1]})")
            print(f"- Delay over the limit (median of each leak's own), per leak family, {names[c]}: {span}; "
                  f"within 1.5x: {sum(1 for r, _ in ratios if r <= 1.5)}/{len(ratios)} families.")
    slow = [o for o in outcomes if o.leak_rate == 1.0]
    for c in codes:
        ds = [first_catch(o, c) for o in slow]
        within = sum(1 for d in ds if d is not None and d <= 1800)
        print(f"- 1 MiB/min leaks found within 30 min on NVML's figure, {names[c]}: {within}/{len(ds)}.")
        probed_ds = [first_catch(o, (c, "probe")) for o in slow if (c, "probe") in o.episodes]
        if probed_ds:
            within = sum(1 for d in probed_ds if d is not None and d <= 1800)
            print(f"- 1 MiB/min leaks found within 30 min with the probe's numbers (the probed families), "
                  f"{names[c]}: {within}/{len(probed_ds)}.")
    if free:
        for u in uuids:
            for c in codes:
                for i, eps in per_phase[u][c].items():
                    outcomes[i].episodes[(c, u)] = eps
        print(phase_table(fams, outcomes, codes, names, uuids, per_phase))
    if probed:
        print("\n## The allocator probe's signal (same traces, with and without the probe's numbers)\n")
        print("| family | tree | delay without probe | with probe | with probe ÷ NVML limit | caught without / with "
              "| false without / with |")
        print("|---|---|---|---|---|---|---|")
        for fam in fams:
            group = [o for o in outcomes if o.family == fam.name and (codes[0], "probe") in o.episodes]
            if not group:
                continue
            for c in codes:
                a = summary(group, c)
                b = summary(group, (c, "probe"))
                ratio = median_over_limit(group, (c, "probe"))
                caught = f"{a['caught']}/{a['leaks']} / {b['caught']}/{b['leaks']}" if fam.leak else "–"
                print(f"| {fam.name} | {names[c]} | {_min(a['median_delay'])} | {_min(b['median_delay'])} | "
                      f"{'–' if ratio is None else f'{ratio:.2f}x'} | {caught} | "
                      f"{a['false_traces']}/{a['traces']} / {b['false_traces']}/{b['traces']} |")
        if probed_phased:
            print("\nWith the probe's numbers at the other phases (cells: traces with a false alert (episodes); for "
                  "the leak families, [median delay, caught]):\n")
            print("| family | tree | " + " | ".join(f"{u} (+{bucket_phase(u)} s)" for u in uuids[1:]) + " |")
            print("|---|---|" + "---|" * len(uuids[1:]))
            for fam in fams:
                group = [o for k, o in enumerate(outcomes) if o.family == fam.name and k in probed and k in free]
                for c in codes if group else ():
                    cells = []
                    for u in uuids[1:]:
                        cells.append(phase_cell(summary(group, (c, "probe", u)), fam.leak))
                    print(f"| {fam.name} | {names[c]} | " + " | ".join(cells) + " |")
    if reals:
        print("\n## Real series (../shared/real-traces), through the whole analysis\n")
        print("| series | label | length | " + " | ".join(f"{names[c]}: leak findings" for c in codes)
              + " | " + " | ".join(f"{names[c]}: 4 MiB/min laid over, found after" for c in codes) + " |")
        print("|---|---|---|" + "---|" * (2 * len(codes)))
        for e in reals:
            first = real_free[e["file"]][codes[0]]
            row = [e["file"], e["label"], f"{(first['end'] - first['start']) / 60:.0f} min"]
            row += [str(len(real_free[e["file"]][c]["leaks"])) for c in codes]
            if e in long_real:
                j = long_real.index(e)
                for c in codes:
                    got = laid[c][j]
                    row.append(_min(got["leaks"][0] - got["start"]) if got["leaks"] else "not found")
            else:
                row += ["(shorter than 45 min)"] * len(codes)
            print("| " + " | ".join(row) + " |")
    if args.perf:
        print("\n## Cost: LeakDetector.detect per tick, 8 GPUs x 64 processes (GPU memory + host RSS), "
              "6 h of history\n")
        print(perf(codes, names, args.perf_ticks))
    if args.check_promtool:
        picks = [s for s in specs if FAMILY[s[0]].leak][:6]
        agree, checked, firing = check_promtool(picks)
        print(f"\npromtool cross-check ({len(picks)} traces, first 4 h, every 5 min): {agree}/{checked} "
              f"evaluation points agree on whether each alert fires ({firing} of them firing).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": o.name, "family": o.family, "leak_rate": o.leak_rate, "leak_start": o.leak_start,
                        "limit": o.limit, **{names[c]: o.episodes[c] for c in codes},
                        **{f"{names[c]} with probe": o.episodes[(c, "probe")] for c in codes
                           if (c, "probe") in o.episodes},
                        "phases": {u: {names[c]: per_phase.get(u, {}).get(c, {}).get(k) for c in codes} for u in uuids}}
                       for k, o in enumerate(outcomes)], f, indent=1)
    return 0


def phase_cell(sm: dict[str, Any], leak: bool) -> str:
    """One family at one phase: traces with a false alert (episodes), and for a leak family
    [median delay, caught]."""
    cell = f"{sm['false_traces']}/{sm['traces']}"
    cell += f" ({sm['false_episodes']})" if sm["false_traces"] else ""
    if leak:
        cell += f" [{_min(sm['median_delay'])}, {sm['caught']}/{sm['leaks']}]"
    return cell


def phase_table(fams, outcomes, codes, names, uuids, per_phase) -> str:
    """False alerts at each bucket phase, per family: traces with one before any leak's onset
    (episodes), and for the leak families replayed at every phase (--phase-leaks), the median
    delay; then the traces named."""
    lines = ["\n## False alerts per phase of the minute buckets\n",
             "Each trace replayed under each GPU UUID (the leak-free families always, the leak families with "
             "--phase-leaks); the phase is the second after the trace's start of the first 5 s sample that "
             "opens a minute of its process series (History's offset from the key). The table above used "
             f"`{uuids[0]}` (+{bucket_phase(uuids[0])} s). Cells: traces with a false alert (episodes)"
             " [median delay].\n"]
    head = ["family"] + [f"{names[c]}: {u} (+{bucket_phase(u)} s)" for c in codes for u in uuids]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam in fams:
        group = [o for k, o in enumerate(outcomes) if o.family == fam.name and k in per_phase[uuids[0]][codes[0]]]
        if not group:
            continue
        row = [fam.name]
        for c in codes:
            for u in uuids:
                row.append(phase_cell(summary(group, (c, u)), fam.leak))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for c in codes:
        for u in uuids:
            bad = []
            for k in sorted(per_phase[u][c]):
                o = outcomes[k]
                onset = o.leak_start if o.leak_start is not None else math.inf
                early = [e for e in per_phase[u][c][k] if e < onset]
                if early:
                    bad.append(f"{o.name} (min {', '.join(f'{(e - T0) / 60:.1f}' for e in early)})")
            lines.append(f"- {names[c]}, {u} (+{bucket_phase(u)} s): false alerts on {len(bad)}/{len(per_phase[u][c])} "
                         "traces" + (": " + "; ".join(bad) if bad else "") + ".")
    return "\n".join(lines)


def perf(codes: list[str], names: dict[str, str], ticks: int) -> str:
    """Each tree's fleet built in its own worker; then one tick each in turn, the order
    alternating, so the machine's drift falls on every tree alike."""
    workers = {c: Worker(c) for c in codes}
    for w in workers.values():
        w.send({"op": "perf_build"})
    for w in workers.values():
        w.receive()
    cpu: dict[str, list[float]] = {c: [] for c in codes}
    for k in range(ticks):
        order = codes if k % 2 == 0 else codes[::-1]
        for c in order:
            cpu[c].append(workers[c].ask({"op": "perf_tick"})["cpu"])
    for w in workers.values():
        w.close()
    lines = ["| tree | median per tick | mean | p90 | share of a core at 5 s | vs first |", "|---|---|---|---|---|---|"]
    base = statistics.median(cpu[codes[0]])
    for c in codes:
        xs = sorted(cpu[c])
        med = statistics.median(xs)
        lines.append(f"| {names[c]} | {med * 1e3:.1f} ms | {statistics.mean(xs) * 1e3:.1f} ms | "
                     f"{xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f} ms | {med / 5:.2%} | {med / base:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
