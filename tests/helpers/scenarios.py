"""Built-in scenarios played through the whole live pipeline (simulated NVML, host and vLLM
server → sampler → analysis → published State) on the scenario's virtual clock, and the episodes
of findings they raise, in a form a golden file can pin down."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from exporter.analysis.engine import Analyzer
from exporter.cli import make_analyzer
from exporter.config import build as build_config
from exporter.daemon import Daemon
from exporter.model import State
from exporter.runtime import build as build_runtime
from exporter.sim.scenario import builtin, load

STEP = 10.0  # seconds of scenario time between samples
# The scenario's start in Unix seconds, the same on every run: the detectors' results depend on
# where the history's downsampling boundaries fall, so a start taken from the wall clock (as
# `run --simulate` does) can move a finding by a few samples from one run to the next.
START = 1_699_999_200.0  # a whole hour
FINDINGS_GOLDEN = Path(__file__).parents[1] / "golden" / "scenario-findings.json"


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


@functools.cache  # each scenario is played once per test session for the tests that only read it
def played(name: str) -> tuple[Analyzer, float]:
    return play(name)


def episodes(analyzer: Analyzer, start: float) -> list[dict[str, object]]:
    """Every finding raised, in the order raised: what, where, its worst severity, and when it was
    raised and cleared (seconds after the scenario's start; cleared None while still active)."""
    return [{"kind": f.kind, "severity": f.severity, "gpu": f.gpu, "pid": f.pid,
             "endpoint": f.endpoint, "raised_at": round(f.first_detected_at - start, 3),
             "cleared_at": None if cleared is None else round(cleared - start, 3)}
            for f, cleared in analyzer.episodes()]


def scenario_names() -> list[str]:
    return sorted(name for name, _ in builtin())


def render_golden() -> str:
    return json.dumps({name: episodes(*played(name)) for name in scenario_names()}, indent=1) + "\n"
