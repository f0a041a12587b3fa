"""One decision per verdict (issue 19), checked end to end: every built-in scenario is replayed
through the real pipeline and detectors on its virtual clock, what the exporter exposes after each
sample becomes the input of a promtool rule test, and the real promtool evaluates the real rules
(alerts/gpu-memory-exporter.rules.yml) on it. For every finding kind, the alerts it maps to fire
if and only if the finding is active, allowing for each alert's `for:`:

- wherever the finding has been active for the alert's `for:` and one evaluation more, its alert
  fires, with the finding's GPU, pid and endpoint;
- wherever it has not been active for an evaluation, no alert of its kind fires for it.

Moments in between (a finding raised less than `for:` ago, or cleared within the last
evaluation: an alert over a recording rule of another group sees it one evaluation late) are not
judged. The expectation is
the replay's own findings, so promtool's verdict is the only judge of the rules.
"""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from exporter.analysis.engine import CLEAR_AFTER_SECONDS
from exporter.analysis.registry import finding_kinds
from exporter.model import Finding
from helpers.rules import RULES, alert_rules
from helpers.scenarios import STEP, Replay, played, promtool_series, promtool_values, scenario_names, selector
from helpers.tools import REPO, tool

EVAL = 60  # seconds between rule evaluations (Prometheus' default evaluation_interval)
CHECK_EVERY = 120  # seconds between the moments judged
IDENTITY = ("gpu", "pid", "endpoint")  # what tells two findings of a kind apart, in the alert's labels
KINDS = {kind.name: kind.alerts for kind in finding_kinds()}
# Kinds a raw rule alerts on whose finding the engine holds after its detector stops reporting
# it (engine.CLEAR_AFTER_SECONDS): the raw alert may end that much before the finding.
HELD_RAW = {kind.name for kind in finding_kinds() if kind.raw_alerts and kind.clear_hold}


def _seconds(duration: str | None) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration or ""))


FOR = {r["alert"]: _seconds(r.get("for")) for r in alert_rules()}


def identity(f: Finding) -> tuple[tuple[str, str], ...]:
    values = {"gpu": f.gpu or "", "pid": "" if f.pid is None else str(f.pid), "endpoint": f.endpoint}
    return tuple((k, values[k]) for k in IDENTITY if values[k])


def expectations(replay: Replay, kind: str, alerts: tuple[str, ...]) -> list[tuple[float, set]]:
    """(moment, the identities whose alert must be firing then) at every judged moment."""
    wait = max(FOR[a] for a in alerts) + EVAL  # `for:`, and the evaluation that first sees it
    # A held finding outlasts its raw alert by up to the hold: judged firing only where it is
    # still active that long after.
    after = CLEAR_AFTER_SECONDS + STEP if kind in HELD_RAW else 0
    ids = [{identity(f) for f in findings if f.kind == kind} for findings in replay.active]
    out = []
    for t in range(0, int(replay.times[-1] - after) + 1, CHECK_EVERY):
        window = [i for i, at in enumerate(replay.times) if t - wait <= at <= t + after]
        held = set.intersection(*(ids[i] for i in window)) if t >= wait else set()
        # An alert over a recording rule of another group may see it one evaluation late.
        recent = set().union(*(ids[i] for i in window if replay.times[i] >= t - EVAL))
        if recent - held:
            continue  # raised less than `for:` ago, or cleared within an evaluation: not judged
        out.append((t, held))
    return out


def rule_test(replay: Replay) -> tuple[dict, int]:
    """The promtool test file for a replay, and how many moments it judges."""
    checks = []
    for kind, alerts in KINDS.items():
        expr = (f'group by ({", ".join(IDENTITY)}) '
                f'(ALERTS{{alertstate="firing",alertname=~"{"|".join(alerts)}"}})')
        for t, firing in expectations(replay, kind, alerts):
            checks.append({"expr": expr, "eval_time": f"{t}s",
                           "exp_samples": [{"labels": selector(ident), "value": 1} for ident in sorted(firing)]})
    test = {"rule_files": [str(RULES)], "evaluation_interval": f"{EVAL}s",
            "tests": [{"interval": f"{STEP:g}s", "input_series": promtool_series(replay), "promql_expr_test": checks}]}
    return test, len(checks)


@pytest.mark.parametrize("name", scenario_names())
@pytest.mark.slow
@pytest.mark.integration
def test_alerts_fire_if_and_only_if_their_finding_is_active(name, tmp_path):
    replay = played(name)
    test, judged = rule_test(replay)
    assert judged >= len(KINDS) * len(replay.times) * STEP / CHECK_EVERY / 2  # most moments are judged
    path = tmp_path / f"{name}.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=10**6))
    result = subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def _series(replay: Replay, name: str) -> dict[int, float]:
    (samples,) = [v for (n, _), v in replay.series.items() if n == name]
    return samples


@pytest.mark.slow
def test_where_the_unified_memory_page_holds_the_findings_are_critical():
    """#19 item 2 on a unified-memory host: GpuUnifiedMemoryHostPressure judges the raw series and
    pages; wherever its condition holds (same numbers as the rule: exporter/thresholds.py), the
    daemon's pressure finding on the GPU is active and critical, and so is any contention finding
    (at "MemAvailable 10.0 GiB (8%), memory PSI 55 %" both were warnings, or absent)."""
    from exporter import thresholds

    assert "GpuUnifiedMemoryHostPressure" in KINDS["pressure"]  # judged by the replay above too
    replay = played("unified-memory")
    available, total = (_series(replay, f"gpumem_host_memory_{k}_bytes") for k in ("available", "total"))
    psi = _series(replay, "gpumem_host_memory_pressure_some_ratio")
    pages = [i for i in available if available[i] / total[i] < thresholds.UNIFIED_HOST_AVAILABLE.value
             or psi.get(i, 0.0) > thresholds.UNIFIED_HOST_PRESSURE.value]
    assert len(pages) > 100  # the scenario spends a good while there (PSI from ~100 min, then the kill)
    for i in pages:
        found = {(f.kind, f.severity) for f in replay.active[i] if f.gpu == "0"}
        assert ("pressure", "critical") in found, (replay.times[i], found)
        assert ("contention", "warning") not in found, (replay.times[i], found)


def test_the_expectations_wait_for_for_and_judge_silence():
    """The judge itself: a finding raised at 300 s on a 1-minute alert is not judged before it
    has been active for `for:` and one evaluation, then must fire; after it clears it must not."""
    f = Finding(kind="leak", severity="warning", first_detected_at=0, gpu="0", pid=7)
    times = [i * STEP for i in range(int(3600 / STEP))]
    active = [(f,) if 300 <= t < 1800 else () for t in times]
    replay = Replay(found=[], start=0.0, times=times, active=active)
    got = dict(expectations(replay, "leak", ("GpuMemoryLeakSuspected",)))
    me = {(("gpu", "0"), ("pid", "7"))}
    assert got[240] == set() and 360 not in got  # pending: not judged
    assert got[480] == me and got[1680] == me and 1800 not in got and got[1920] == set() and got[3480] == set()


def test_promtool_input_marks_a_series_that_stops_stale():
    assert promtool_values({0: 1.0, 1: 1.0, 2: 1.0, 5: 2.0}, 8) == "1.0x2 stale _x1 2.0 stale _x1"
