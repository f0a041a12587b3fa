"""Offline replay: deterministic, causal, the same as live, and the analyze output formats."""
from __future__ import annotations

import json
import random
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from exporter.analysis.engine import Analyzer
from exporter.postmortem.analyze import analyze, analyze_trace, replay
from exporter.postmortem.trace import TraceError, load_traces, read_trace, write_csv
from helpers.timeline import T0, GiB, MiB, gpu, leaking_server, proc, snap, timeline, vllm_proc

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
LEAK_CSV = str(FIXTURES / "vllm_leak.csv")
NORMAL_CSV = str(FIXTURES / "normal.csv")


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def incident():
    """A leak on GPU 0, a notebook crowding GPU 1, and memory left behind on GPU 2."""
    def make(e):
        leak = vllm_proc(10, 30 * GiB + max(0, e - 600) / 60 * 12 * MiB, start=T0 - 60)
        crowd = [vllm_proc(20, 60 * GiB, endpoint="http://b")]
        if e >= 1200:
            crowd.append(proc(777, min(14 * GiB, (e - 1190) * 200 * MiB), name="python",
                              pod="notebook-1", namespace="research"))
        stale = [vllm_proc(30, 25 * GiB, endpoint="http://c")] if e < 1500 else []
        return snap(T0 + e, [gpu([leak], index="0"), gpu(crowd, index="1"),
                             gpu(stale, index="2", used=25 * GiB + 400 * MiB)])
    return timeline(2700, 15, make)


def test_replay_finds_each_incident_in_time_order():
    findings = replay(incident())
    by_kind = {(f.kind, f.gpu) for f in findings}
    assert {("leak", "0"), ("contention", "1"), ("stale_memory", "2")} <= by_kind
    times = [f.first_detected_at for f in findings]
    assert times == sorted(times)


def test_replay_is_deterministic_and_independent_of_input_order():
    snaps = incident()
    first = replay(snaps)
    shuffled = snaps[:]
    random.Random(7).shuffle(shuffled)
    assert replay(snaps) == first
    assert replay(shuffled) == first


def test_replay_is_causal_each_finding_appears_from_its_prefix():
    """Replaying only the samples up to a finding's first_detected_at already raises it then:
    no later sample was needed."""
    snaps = incident()
    for f in replay(snaps):
        prefix = [s for s in snaps if s.timestamp <= f.first_detected_at]
        again = [g for g in replay(prefix) if g.key == f.key]
        assert again and again[-1].first_detected_at == f.first_detected_at


def test_replay_matches_the_live_engine():
    snaps = incident()
    live = Analyzer(log_findings=False)
    raised = {}
    for s in snaps:
        for f in live.update(s).findings:
            raised.setdefault((f.key, f.first_detected_at), f.first_detected_at)
    assert sorted({(f.key, f.first_detected_at) for f in replay(snaps)}) == sorted(raised)


def test_flight_recorder_csv_replays_to_the_same_findings(tmp_path):
    snaps = incident()
    path = str(tmp_path / "flight.csv")
    write_csv(snaps, path)
    assert replay(read_trace(path)) == replay(snaps)


def test_analyze_json_on_a_recorded_leak():
    doc = json.loads(analyze([LEAK_CSV], fmt="json"))
    (leak,) = [f for f in doc["findings"] if f["kind"] == "leak"]
    assert leak["pid"] == 4711 and leak["gpu"] == "0" and leak["process"] == "VLLM::EngineCor"
    for key in ("kind", "gpu", "pid", "process", "first_detected_at", "severity", "evidence",
                "advice"):
        assert key in leak
    # The leak starts 10 min in; it is found after start-up settled, well before the end.
    start = doc["trace"]["start"]
    assert start + 600 < leak["first_detected_at"] < doc["trace"]["end"]
    assert leak["evidence"]["slope_bytes_per_second"] == pytest.approx(8 * MiB / 60, rel=0.2)
    assert doc["trace"]["samples"] == 181


def test_analyze_tells_what_raised_a_finding_beside_its_latest_evidence():
    # The leak is raised 15 minutes into its growth, young (in the half hour after start-up
    # settled); held afterwards at half that bar, it tells its newest, longer window at the end.
    doc = json.loads(analyze([LEAK_CSV], fmt="json"))
    (leak,) = [f for f in doc["findings"] if f["kind"] == "leak"]
    raised, latest = leak["evidence_when_raised"], leak["evidence"]
    assert raised["threshold_z"] == pytest.approx(1.5 * 5.35, abs=0.01)
    assert latest["threshold_z"] == pytest.approx(raised["threshold_z"] / 2, abs=0.01)
    assert raised["window_seconds"] < latest["window_seconds"]
    # The latest version is dated: the last tick that reported it, after the raise.
    assert leak["first_detected_at"] < leak["reported_at"] <= doc["trace"]["end"]
    when = _utc(leak["reported_at"])
    text = analyze([LEAK_CSV])
    first = _utc(leak["first_detected_at"])
    assert f"  evidence when raised {first}: slope_bytes_per_second={raised['slope_bytes_per_second']}," in text
    assert f"  evidence as last reported {when}: slope_bytes_per_second={latest['slope_bytes_per_second']}," in text
    assert f"  as last reported {when}: " in text
    assert text.index(f"evidence when raised {first}:") < text.index(f"evidence as last reported {when}:")


def test_analyze_dates_what_a_cleared_finding_said(tmp_path):
    # Full for ten minutes, then freed: the pressure finding clears, and its summary and advice
    # are told as what was said while it lasted, not as the state at the trace's end.
    path = str(tmp_path / "freed.csv")
    write_csv(timeline(1200, 15, lambda e: snap(T0 + e, [gpu([proc(1, (78 if e < 600 else 10) * GiB)])])),
              path)
    (f,) = json.loads(analyze([path], fmt="json"))["findings"]
    assert f["kind"] == "pressure" and f["cleared_at"] is not None and f["advice"]
    assert f["first_detected_at"] <= f["reported_at"] < T0 + 600 < f["cleared_at"]
    text = analyze([path])
    assert f", cleared {_utc(f['cleared_at'])}" in text
    assert text.index("  what was advised while it lasted:") < text.index("  - " + f["advice"][0])


def test_analyze_tells_a_finding_that_eased_before_it_cleared(tmp_path):
    # 98 % used for ten minutes, then 92 % for ten, then freed (a newcomer's trial): the worst
    # version is shown, and beside it that it went on as a warning until later.
    path = str(tmp_path / "eased.csv")
    used = {0: 78, 1: 73, 2: 10, 3: 10}
    write_csv(timeline(1800, 15, lambda e: snap(T0 + e, [gpu([proc(1, used[int(e // 600)] * GiB)])])), path)
    doc = json.loads(analyze([path], fmt="json"))
    (f,) = doc["findings"]
    assert f["severity"] == "critical" and "98% used" in f["summary"] and f["reported_at"] < T0 + 600
    eased = f["eased"]
    assert eased["severity"] == "warning" and "92% used" in eased["summary"]
    assert T0 + 600 <= eased["reported_at"] < T0 + 1200 < f["cleared_at"]
    text = analyze([path])
    assert f"  later warning, as last reported {_utc(eased['reported_at'])}: GPU 0 memory 92% used" in text
    assert f"  as last reported {_utc(f['reported_at'])}: GPU 0 memory 98% used" in text  # when its worst ended
    report = tmp_path / "eased.html"
    analyze_trace(load_traces([path]), report_path=str(report))
    assert f"later warning, as last reported {_utc(eased['reported_at'])}: GPU 0 memory 92% used" in \
        report.read_text(encoding="utf-8")
    # Back at its worst, it is no longer told as eased; a finding that never eased says nothing of it.
    used[2] = used[3] = 78
    write_csv(timeline(1800, 15, lambda e: snap(T0 + e, [gpu([proc(1, used[int(e // 600)] * GiB)])])), path)
    (f,) = json.loads(analyze([path], fmt="json"))["findings"]
    assert f["eased"] is None and f["reported_at"] == T0 + 1800 and "later" not in analyze([path])
    assert json.loads(analyze([LEAK_CSV], fmt="json"))["findings"][0]["eased"] is None


def test_analyze_normal_trace_has_no_findings():
    """vLLM start-up, a plateau with allocator noise and a short job that returns its memory."""
    assert json.loads(analyze([NORMAL_CSV], fmt="json"))["findings"] == []
    assert "No findings." in analyze([NORMAL_CSV])


def test_analyze_json_pid_is_null_for_gpu_findings(tmp_path):
    path = str(tmp_path / "full.csv")
    write_csv(timeline(60, 15, lambda e: snap(T0 + e, [gpu([proc(1, 78 * GiB)])])), path)
    (f,) = json.loads(analyze([path], fmt="json"))["findings"]
    assert f["kind"] == "pressure" and f["pid"] is None and f["severity"] == "critical"
    assert f["first_detected_at"] == T0 and f["cleared_at"] is None
    assert f["evidence_when_raised"] == f["evidence"]  # one verdict all along: told once in text
    assert "  evidence: " in analyze([path]) and "evidence when raised" not in analyze([path])


def test_analyze_text_is_a_readable_list():
    text = analyze([LEAK_CSV])
    assert text.startswith("Replayed 181 samples of 1 GPU ")
    assert "[warning] leak - GPU 0, pid 4711 (VLLM::EngineCor)" in text
    assert "first detected 2024-11-22" in text and "  - " in text
    # A narrow interval is printed with the decimals that show it (it read "8.0-8.0").
    low, high = re.search(r"grows [\d.]+ MiB/min \(95 % interval ([\d.]+)-([\d.]+)", text).groups()
    assert low != high and float(low) < 8.0 < float(high)


def test_analyze_reads_prometheus_json():
    doc = json.loads(analyze([str(FIXTURES / "prometheus_range.json")], fmt="json"))
    assert doc["trace"]["samples"] == 3 and doc["trace"]["gpus"] == ["0"]


def test_analyze_bad_trace_names_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("timestamp,gpu,pid,process,used_bytes\n1,0,1,a,5\n2,0,1,a,lots\n")
    with pytest.raises(TraceError, match=rf"^{path}:3: used_bytes is not a number"):
        analyze([str(path)])
    with pytest.raises(ValueError, match="unknown format"):
        analyze([LEAK_CSV], fmt="yaml")


def test_analyze_escapes_control_characters_in_text(tmp_path):
    path = str(tmp_path / "t.csv")
    evil = vllm_proc(1, 20 * GiB)
    evil = type(evil)(**{**evil.__dict__, "name": "x\x1b[31mred\nfake"})
    # The server exits at t=30 and leaves its memory behind: a finding that names it.
    write_csv(timeline(150, 10, lambda e: snap(T0 + e, [gpu([evil] if e < 30 else [],
                                                             used=20 * GiB)])), path)
    out = analyze([path])
    assert "stale_memory" in out and "red" in out
    assert "\x1b" not in out and not any(line.startswith("fake") for line in out.splitlines())
    doc = json.loads(analyze([path], fmt="json"))
    # The trace's writer takes control characters out of every cell (#21 M5).
    assert doc["findings"][0]["evidence"]["exited_process"] == "x[31mredfake"


def test_replay_of_leaking_server_matches_process_role_and_endpoint():
    (f,) = [f for f in replay(leaking_server(3600, 8 * MiB)) if f.kind == "leak"]
    assert (f.pid, f.role, f.endpoint) == (10, "vllm", "http://127.0.0.1:8000")
