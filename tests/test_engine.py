"""The engine: finding lifecycle (raised once, cleared once), per-GPU analysis, bounds,
configuration checks, isolation of a failing detector, and no wall-clock reads."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pytest

import exporter.analysis.pressure as pressure
import exporter.analysis.stale as stale
from exporter.analysis.contention import ContentionConfig
from exporter.analysis.detector import DetectorSpec, FindingAlert, FindingKind
from exporter.analysis.engine import AnalysisConfig, Analyzer
from exporter.analysis.oom_findings import OomConfig
from exporter.analysis.registry import DETECTORS
from exporter.analysis.stale import StaleConfig
from exporter.model import Finding, GpuSample, HostMemory, OomEvent
from helpers.timeline import BASE, T0, GiB, MiB, gpu, leaking_server, proc, snap, vllm_proc

# The lifecycle tests use the pressure detector as their vehicle: they run it (and what else they
# are about) alone, so a detector added to the registry cannot change what they see.
PRESSURE_ONLY = [pressure.DETECTOR]
STALE_AND_PRESSURE = [stale.DETECTOR, pressure.DETECTOR]


def utilisation_timeline(ratios, step=10):
    """One GPU whose single (non-vLLM) process makes utilisation follow `ratios` tick by tick."""
    return [snap(T0 + i * step, [gpu([proc(10, r * 80 * GiB)], extra=0)])
            for i, r in enumerate(ratios)]


def test_finding_is_logged_once_when_raised_and_once_when_cleared(caplog):
    analyzer = Analyzer(detectors=PRESSURE_ONLY)
    ratios = [0.5] * 3 + [0.9] * 6 + [0.5] * 5
    with caplog.at_level(logging.INFO, logger="exporter.findings"):
        results = [analyzer.update(s) for s in utilisation_timeline(ratios)]
    records = [r for r in caplog.records if r.name == "exporter.findings"]
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in records] == [
        (logging.WARNING, "finding raised"), (logging.INFO, "finding cleared")]
    assert "pressure" in records[0].getMessage() and "gpu=0" in records[0].getMessage()
    assert records[0].finding["kind"] == "pressure"
    active = [r.findings for r in results]
    # Cleared once its condition has been gone CLEAR_AFTER_SECONDS (30 s: three more ticks).
    assert [len(a) for a in active] == [0] * 3 + [1] * 6 + [1] * 3 + [0] * 2
    # The same finding keeps the moment it was first raised while it stays active.
    assert {a[0].first_detected_at for a in active if a} == {T0 + 30}


def test_severity_change_keeps_first_detection_and_records_the_worst_version():
    analyzer = Analyzer(log_findings=False, detectors=PRESSURE_ONLY)
    results = [analyzer.update(s)
               for s in utilisation_timeline([0.86, 0.86, 0.97, 0.97, 0.88, 0.5, 0.5, 0.5, 0.5])]
    assert [r.findings[0].severity for r in results[:5]] == ["warning", "warning", "critical",
                                                            "critical", "warning"]
    assert {r.findings[0].first_detected_at for r in results[:5]} == {T0}
    (recorded,) = analyzer.all_findings
    assert recorded.severity == "critical" and recorded.first_detected_at == T0
    assert analyzer.episodes()[0][1] == T0 + 80  # cleared 30 s after its condition went


def test_escalation_and_de_escalation_are_logged_once_each(caplog):
    """A finding that turns critical is news for whoever reads the log: raised, escalated,
    de-escalated and cleared, one line each, however long it stays at each severity."""
    analyzer = Analyzer(detectors=PRESSURE_ONLY)
    with caplog.at_level(logging.INFO, logger="exporter.findings"):
        for s in utilisation_timeline([0.86, 0.86, 0.97, 0.97, 0.97, 0.88, 0.88, 0.5, 0.5, 0.5, 0.5]):
            analyzer.update(s)
    records = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records if r.name == "exporter.findings"]
    assert records == [(logging.WARNING, "finding raised"), (logging.WARNING, "finding escalated"),
                       (logging.INFO, "finding de-escalated"), (logging.INFO, "finding cleared")]
    escalated = next(r for r in caplog.records if "escalated" in r.getMessage())
    assert "pressure [warning -> critical] gpu=0" in escalated.getMessage()
    assert escalated.finding["severity"] == "critical"


def test_a_finding_raised_again_after_clearing_is_a_new_episode(caplog):
    analyzer = Analyzer(detectors=PRESSURE_ONLY)
    with caplog.at_level(logging.INFO, logger="exporter.findings"):
        for s in utilisation_timeline([0.9, 0.5, 0.5, 0.5, 0.5, 0.9]):
            analyzer.update(s)
    assert [f.first_detected_at for f in analyzer.all_findings] == [T0, T0 + 50]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.WARNING]


def test_a_condition_hovering_at_its_threshold_is_one_finding(caplog):
    """Memory PSI or usage hovering at a threshold: the detector says yes, no, yes from one tick
    to the next; the finding is raised once and stays, so no alert's `for:` restarts (the
    newcomer's trial of unified-memory saw pressure raised and cleared three times in 50 s)."""
    analyzer = Analyzer(detectors=PRESSURE_ONLY)
    with caplog.at_level(logging.INFO, logger="exporter.findings"):
        results = [analyzer.update(s) for s in utilisation_timeline([0.9, 0.5, 0.9, 0.5, 0.5, 0.9, 0.5, 0.9])]
    assert all(r.findings for r in results)
    assert [f.first_detected_at for f in analyzer.all_findings] == [T0]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["finding raised"]


def test_gpu_analysis_admission_hysteresis_and_unattributed_bytes():
    analyzer = Analyzer(log_findings=False)
    ratios = [0.5, 0.92, 0.85, 0.79, 0.85]
    results = [analyzer.update(s) for s in utilisation_timeline(ratios)]
    assert [r.gpus[0].admission_open for r in results] == [True, False, False, True, True]
    assert [r.gpus[0].utilization_ratio for r in results] == pytest.approx(ratios)
    assert results[0].gpus[0].unattributed_bytes == 0
    r = analyzer.update(snap(T0 + 100, [gpu([proc(1, GiB)], used=4 * GiB)]))
    assert r.gpus[0].unattributed_bytes == 3 * GiB


def test_lost_gpu_closes_admission_and_reports_no_utilisation():
    analyzer = Analyzer(log_findings=False)
    lost = GpuSample(index="0", uuid="GPU-0", up=False, error="gpu_lost")
    r = analyzer.update(snap(T0, [lost]))
    assert r.gpus[0].admission_open is False and r.gpus[0].utilization_ratio is None


def test_time_to_full_forecast_for_steady_growth_absent_on_plateau():
    analyzer = Analyzer(log_findings=False)
    growth = 20 * MiB  # per minute
    grow = [analyzer.update(snap(T0 + e, [gpu([proc(1, 20 * GiB + e / 60 * growth)])]))
            for e in range(0, 1801, 15)]
    ttf = grow[-1].gpus[0].time_to_full_seconds
    free = 80 * GiB - (20 * GiB + 30 * growth + BASE)
    assert ttf == pytest.approx(free / (growth / 60), rel=0.1)
    flat = Analyzer(log_findings=False)
    plateau = [flat.update(snap(T0 + e, [gpu([proc(1, 20 * GiB)])])) for e in range(0, 1801, 15)]
    assert all(r.gpus[0].time_to_full_seconds is None for r in plateau)


def test_process_trend_for_every_live_process():
    analyzer = Analyzer(log_findings=False)
    s = snap(T0, [gpu([vllm_proc(10, GiB), proc(20, GiB)], index="0"),
                  gpu([proc(30, GiB)], index="1")])
    trends = analyzer.update(s).process_trends
    assert sorted((t.gpu, t.pid, t.role) for t in trends) == [
        ("0", 10, "vllm"), ("0", 20, "other"), ("1", 30, "other")]
    assert all(t.growth_bytes_per_second is None and not t.leak_suspected for t in trends)


def test_oom_event_becomes_a_finding_held_for_a_while():
    cfg = AnalysisConfig(detectors={"oom": OomConfig(hold_seconds=60)})
    analyzer = Analyzer(cfg, log_findings=False)
    event = OomEvent(kind="torch_cuda_oom", klass="shortage", line=7, source="vllm.log", gpu="0",
                     requested_bytes=GiB, advice=("Lower --max-num-seqs.",))
    results = []
    for e in range(0, 121, 10):
        events = [event] if e == 20 else []
        results.append(analyzer.update(snap(T0 + e, [gpu([vllm_proc(10, 70 * GiB)])],
                                            events=events)))
    oom = [[f for f in r.findings if f.kind == "oom"] for r in results]
    # Held by the detector for hold_seconds (60 s), then by the engine's clear hold (30 s).
    assert [bool(x) for x in oom] == [False, False] + [True] * 10 + [False]
    f = oom[2][0]
    assert f.gpu == "0" and f.uuid == "GPU-0" and f.severity == "critical"
    assert dict(f.evidence)["class"] == "shortage" and f.advice == ("Lower --max-num-seqs.",)


def test_no_wall_clock_is_read(monkeypatch):
    """Live and replay must behave the same: only snapshot timestamps count."""
    def forbidden():
        raise AssertionError("the engine read the wall clock")
    monkeypatch.setattr(time, "time", forbidden)
    monkeypatch.setattr(time, "monotonic", forbidden)
    analyzer = Analyzer(log_findings=False)
    for s in leaking_server(1800, 8 * MiB):
        analyzer.update(s)
    assert analyzer.all_findings


def test_a_failing_detector_is_counted_and_does_not_silence_the_others(monkeypatch, caplog):
    analyzer = Analyzer(log_findings=False, detectors=STALE_AND_PRESSURE)
    s0 = snap(T0, [gpu([proc(1, GiB)], used=6 * GiB)])
    analyzer.update(s0)
    calls = {"n": 0}

    def broken(history, snapshot, config, *tools):
        calls["n"] += 1
        raise RuntimeError("bug")
    monkeypatch.setattr(stale, "detect_stale", broken)
    with caplog.at_level(logging.ERROR):
        r = analyzer.update(snap(T0 + 10, [gpu([proc(1, 76 * GiB)])]))
    assert calls["n"] == 1 and analyzer.detector_errors["stale_memory"] == 1
    assert [f.kind for f in r.findings] == ["pressure"]
    assert any("detector stale_memory failed" in rec.getMessage() for rec in caplog.records)


def test_active_findings_of_a_failed_detector_are_kept_not_cleared(monkeypatch):
    cfg = AnalysisConfig(detectors={"stale_memory": StaleConfig(seconds=0)})
    analyzer = Analyzer(cfg, log_findings=False)
    r = analyzer.update(snap(T0, [gpu([proc(1, GiB)], used=6 * GiB)]))
    assert [f.kind for f in r.findings] == ["stale_memory"]
    monkeypatch.setattr(stale, "detect_stale", lambda *a: 1 / 0)
    r = analyzer.update(snap(T0 + 10, [gpu([proc(1, GiB)], used=6 * GiB)]))
    assert [(f.kind, f.first_detected_at) for f in r.findings] == [("stale_memory", T0)]


def test_all_findings_is_bounded():
    cfg = AnalysisConfig(max_recorded_findings=3)
    analyzer = Analyzer(cfg, log_findings=False, detectors=PRESSURE_ONLY)
    for i in range(10):  # ten separate pressure episodes, each cleared 30 s after its condition went
        analyzer.update(snap(T0 + 60 * i, [gpu([proc(1, 75 * GiB)])]))
        for after in (10, 20, 30, 40):
            analyzer.update(snap(T0 + 60 * i + after, [gpu([proc(1, GiB)])]))
    assert len(analyzer.all_findings) == 3 and analyzer.dropped_findings == 7
    assert [f.first_detected_at for f in analyzer.all_findings] == [T0 + 420, T0 + 480, T0 + 540]


def test_history_stays_bounded_under_process_churn():
    cfg = AnalysisConfig(history_dead_grace_seconds=120, history_raw_seconds=1800,
                         detectors={"stale_memory": StaleConfig(lookback_seconds=900)})
    analyzer = Analyzer(cfg, log_findings=False)
    for i in range(600):  # a new short-lived process every 10 s for 100 minutes
        analyzer.update(snap(T0 + 10 * i, [gpu([proc(1000 + i, GiB, start=T0 + 10 * i)])]))
    assert analyzer.history.series_count() < 40


def test_analysis_config_is_validated():
    with pytest.raises(ValueError, match="admission"):
        AnalysisConfig(admission_close_above=0.7, admission_open_below=0.8)
    with pytest.raises(ValueError, match="history_raw_seconds"):
        AnalysisConfig(history_raw_seconds=600, detectors={"contention": ContentionConfig(window_seconds=600)})
    with pytest.raises(ValueError, match="max_recorded_findings"):
        AnalysisConfig(max_recorded_findings=0)


def test_findings_log_line_cannot_be_forged_by_a_process_name(caplog):
    analyzer = Analyzer(AnalysisConfig(detectors={"stale_memory": StaleConfig(seconds=0, exit_grace_seconds=0)}))
    evil = vllm_proc(10, 20 * GiB)
    evil = type(evil)(**{**evil.__dict__, "name": "x\nfinding cleared: all"})
    with caplog.at_level(logging.INFO, logger="exporter.findings"):
        analyzer.update(snap(T0, [gpu([evil])]))
        analyzer.update(snap(T0 + 10, [gpu([], used=20 * GiB + BASE)]))
    assert caplog.records and all("\n" not in r.getMessage() for r in caplog.records)


def test_unified_memory_utilisation_comes_from_the_host():
    analyzer = Analyzer(log_findings=False, detectors=PRESSURE_ONLY)
    g = GpuSample(index="0", uuid="GPU-gb10", unified=True)
    r = analyzer.update(snap(T0, [g], host=HostMemory(128 * GiB, 16 * GiB)))
    assert r.gpus[0].utilization_ratio == pytest.approx(112 / 128)
    assert r.gpus[0].admission_open is True  # 87.5 %: not above 90 %
    assert [f.severity for f in r.findings if f.kind == "pressure"] == ["warning"]
    # Under 10 % available GpuUnifiedMemoryHostPressure pages: the finding is critical too.
    r = analyzer.update(snap(T0 + 10, [g], host=HostMemory(128 * GiB, 8 * GiB)))
    assert r.gpus[0].utilization_ratio == pytest.approx(120 / 128)
    assert r.gpus[0].admission_open is False
    assert [f.severity for f in r.findings if f.kind == "pressure"] == ["critical"]


def test_a_unified_gpu_takes_no_work_while_its_host_stalls_on_memory_and_until_it_recovers():
    # A newcomer's trial of the unified-memory scenario: memory PSI at 49 %, the pressure finding
    # critical and GpuUnifiedMemoryHostPressure paging, and /admission open (the GPU's share was
    # under 90 %) until use passed it ten minutes later.
    analyzer = Analyzer(log_findings=False, detectors=PRESSURE_ONLY)
    g = GpuSample(index="0", uuid="GPU-gb10", unified=True)
    hosts = [HostMemory(128 * GiB, 40 * GiB, psi_some_avg10=2.0),   # 69 % in use, calm: open
             HostMemory(128 * GiB, 40 * GiB, psi_some_avg10=49.0),  # stalling: closed at once
             HostMemory(128 * GiB, 40 * GiB, psi_some_avg10=15.0),  # under the page, not yet out of it
             HostMemory(128 * GiB, 16 * GiB, psi_some_avg10=2.0),   # calm, 12.5 % available: not yet
             HostMemory(128 * GiB, 40 * GiB, psi_some_avg10=2.0)]   # out of it: open again
    gates = [analyzer.update(snap(T0 + 10 * k, [g], host=h)).gpus[0] for k, h in enumerate(hosts)]
    assert [a.admission_open for a in gates] == [True, False, False, False, True]
    assert "memory PSI 49 %" in gates[1].closed_because
    assert "has not recovered yet" in gates[2].closed_because and gates[4].closed_because == ""
    # A GPU with memory of its own does not close for its host's.
    own = GpuSample(index="0", uuid="GPU-h100", total_bytes=80 * GiB, used_bytes=40 * GiB)
    assert Analyzer(log_findings=False, detectors=PRESSURE_ONLY).update(
        snap(T0, [own], host=hosts[1])).gpus[0].admission_open is True



@dataclass(frozen=True)
class _EveryTenthConfig:
    every: int = 10


class _EveryTenth:
    """A stateful detector: a finding on every `every`-th tick it sees."""

    def __init__(self):
        self.ticks = 0

    def __call__(self, tick, config):
        self.ticks += 1
        if self.ticks % config.every:
            return []
        return [Finding(kind="tenth", severity="info", first_detected_at=tick.now, gpu=g.gpu, uuid=g.uuid,
                        summary=f"tick {self.ticks}, {len(tick.active)} active before")
                for g in tick.gpus]


_TENTH = DetectorSpec(
    name="tenth", help="test", config=_EveryTenthConfig, create=_EveryTenth,
    kinds=(FindingKind("tenth", help="test", scenario="steady",
                       alert=FindingAlert("Tenth", severity="ticket", for_="0s", summary="s", description="d")),))


def test_the_engine_runs_whatever_is_registered():
    """A detector is a spec: the engine calls it with the tick and its settings, keeps its state
    in the object `create` made for this analyzer, and tracks its findings like any other's."""
    analyzer = Analyzer(log_findings=False, detectors=[_TENTH])
    results = [analyzer.update(s) for s in utilisation_timeline([0.5] * 21)]
    # Each held until it has been gone 30 s (three ticks), then cleared.
    assert [i for i, r in enumerate(results) if r.findings] == [9, 10, 11, 12, 19, 20]
    assert [f.summary for f in analyzer.all_findings] == ["tick 10, 0 active before", "tick 20, 0 active before"]
    assert results[0].process_trends == ()  # no detector here publishes trends
    other = Analyzer(log_findings=False, detectors=[_TENTH])  # its own state
    assert not other.update(utilisation_timeline([0.5])[0]).findings


def test_every_registered_detector_has_a_unique_name_and_kinds():
    names = [spec.name for spec in DETECTORS]
    kinds = [k.name for spec in DETECTORS for k in spec.kinds]
    assert len(set(names)) == len(names) and len(set(kinds)) == len(kinds)
    assert set(AnalysisConfig().detectors) == set(names)
    with pytest.raises(ValueError, match="no detector named nope"):
        AnalysisConfig(detectors={"nope": StaleConfig()})
    with pytest.raises(ValueError, match="StaleConfig"):
        AnalysisConfig(detectors={"stale_memory": ContentionConfig()})
