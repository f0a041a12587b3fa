"""Built-in scenarios played through the whole live pipeline (simulated NVML, host and vLLM
server → sampler → analysis → published State → exposition) on the scenario's virtual clock: the
episodes of findings they raise, in a form a golden file can pin down, and the series the alert
rules read, sample by sample, as Prometheus would have scraped them."""
from __future__ import annotations

import fcntl
import functools
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from exporter.analysis.engine import Analyzer
from exporter.cli import make_analyzer
from exporter.config import build as build_config
from exporter.daemon import Daemon
from exporter.model import Finding, State
from exporter.runtime import build as build_runtime
from exporter.serve.exposition import build_registry
from exporter.sim.scenario import builtin, load
from helpers.rules import PROMETHEUS_METRICS, load_groups, metric_names, recording_rules
from helpers.tools import REPLAYS_DIR

STEP = 10.0  # seconds of scenario time between samples
# The scenario's start in Unix seconds, the same on every run: the detectors' results depend on
# where the history's downsampling boundaries fall, so a start taken from the wall clock (as
# `run --simulate` does) can move a finding by a few samples from one run to the next.
START = 1_699_999_200.0  # a whole hour
FINDINGS_GOLDEN = Path(__file__).parents[1] / "golden" / "scenario-findings.json"

# Every family an alert or recording rule reads (what a replay keeps of each exposition).
RULE_INPUTS = frozenset(set().union(*(metric_names(r["expr"]) for g in load_groups() for r in g["rules"]))
                        - {r["record"] for r in recording_rules()} - PROMETHEUS_METRICS)

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted non-empty labels)


@dataclass
class Replay:
    found: list[tuple[Finding, float | None]]  # the analyzer's episodes(): (finding, cleared_at)
    start: float  # Unix seconds of the scenario's time 0
    times: list[float] = field(default_factory=list)  # scenario seconds of each sample
    active: list[tuple[Finding, ...]] = field(default_factory=list)  # findings after each sample
    # The rules' input series, as scraped after each sample: key -> {sample index: value}.
    series: dict[SeriesKey, dict[int, float]] = field(default_factory=dict)

    def episodes(self) -> list[tuple[Finding, float | None]]:
        return self.found

    @property
    def all_findings(self) -> tuple[Finding, ...]:
        return tuple(f for f, _ in self.found)


def play(name: str, step: float = STEP, on_tick: Callable[[State, float], None] | None = None
         ) -> tuple[Analyzer, float]:
    """Sample and analyse every `step` seconds for the scenario's duration, as the daemon does;
    `on_tick(state, elapsed)` sees each published State. Returns the analyzer and the clock's
    start (Unix seconds)."""
    config = build_config()
    runtime = build_runtime(config, simulate=name, at=0.0)
    runtime.clock.start = START  # type: ignore[attr-defined]  # a FixedClock: nothing sampled yet
    analyzer = make_analyzer(config)
    daemon = Daemon(runtime.sampler, runtime.clock, config.interval_seconds, analyzer=analyzer)
    try:
        duration = load(name).duration
        while (elapsed := runtime.clock.elapsed()) < duration:
            state = daemon.tick()
            if on_tick is not None:
                on_tick(state, elapsed)
            runtime.clock.advance(step)
    finally:
        runtime.close()
    return analyzer, runtime.clock.start


@functools.cache
def played(name: str) -> Replay:
    """The scenario played, once per test run. Under pytest-xdist the workers share each replay
    through a file (conftest.py names the directory): the first to ask plays it, while the
    others wait for its file."""
    shared = os.environ.get(REPLAYS_DIR)
    if not shared:
        return _record(name)
    with open(Path(shared) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = Path(shared) / f"{name}.pickle"
        if kept.exists():
            return pickle.loads(kept.read_bytes())  # written by another worker of this run
        replay = _record(name)
        partial = kept.with_suffix(".tmp")  # renamed once whole: a reader never sees half a file
        partial.write_bytes(pickle.dumps(replay))
        partial.replace(kept)
        return replay


def _record(name: str) -> Replay:
    current: list[State] = []
    registry = build_registry(lambda: current[-1], lambda: current[-1].last_sample_at or 0.0)
    record = Replay(found=[], start=START)

    def scrape(state: State, elapsed: float) -> None:
        current.append(state)
        del current[:-1]
        i = len(record.times)
        record.times.append(elapsed)
        record.active.append(state.analysis.findings if state.analysis else ())
        for family in registry.collect():
            for s in family.samples:
                if s.name in RULE_INPUTS:
                    # Prometheus drops empty labels when it scrapes; so do we.
                    key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v)))
                    record.series.setdefault(key, {})[i] = s.value

    analyzer, record.start = play(name, on_tick=scrape)
    record.found = analyzer.episodes()
    return record


# The labels Prometheus adds to every series it scrapes from the simulated exporter.
SCRAPE_LABELS = {"instance": "sim:9842", "job": "gpu-memory-exporter"}


def promtool_values(samples: dict[int, float], n: int) -> str:
    """promtool's input notation, run-length encoded: a series that stops gets a stale marker,
    as a scrape that no longer finds it writes one."""
    tokens: list[str] = []
    for i in range(n):
        if i in samples:
            tokens.append(repr(float(samples[i])))
        else:
            tokens.append("stale" if i - 1 in samples else "_")
    out, i = [], 0
    while i < n:
        j = i
        while j + 1 < n and tokens[j + 1] == tokens[i]:
            j += 1
        run = j - i
        if tokens[i] == "_":
            out.append(f"_x{run + 1}")
        elif run:
            out.append(f"{tokens[i]}x{run}")
        else:
            out.append(tokens[i])
        i = j + 1
    return " ".join(out)


def selector(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in labels) + "}"


def promtool_series(replay: Replay) -> list[dict[str, str]]:
    """A replay's series as a promtool rule test's input_series, one sample every STEP seconds
    (the test's `interval`), labelled as Prometheus scrapes them."""
    n = len(replay.times)
    return [{"series": name + selector(tuple(sorted({**dict(labels), **SCRAPE_LABELS}.items()))),
             "values": promtool_values(samples, n)}
            for (name, labels), samples in sorted(replay.series.items())]


def episodes(analyzer: Analyzer | Replay, start: float) -> list[dict[str, object]]:
    """Every finding raised, in the order raised: what, where, its worst severity, and when it was
    raised and cleared (seconds after the scenario's start; cleared None while still active)."""
    return [{"kind": f.kind, "severity": f.severity, "gpu": f.gpu, "pid": f.pid,
             "endpoint": f.endpoint, "raised_at": round(f.first_detected_at - start, 3),
             "cleared_at": None if cleared is None else round(cleared - start, 3)}
            for f, cleared in analyzer.episodes()]


def scenario_names() -> list[str]:
    return sorted(listed.name for listed in builtin())


def render_golden() -> str:
    return json.dumps({name: episodes(played(name), played(name).start) for name in scenario_names()},
                      indent=1) + "\n"
