"""Each detector fires on its failure pattern and stays silent on the normal ones.

Detectors are called through their one interface, `detector(tick, config)`, a Tick per snapshot
over a real History (helpers/timeline.run_detector); the snapshots are built by the timeline
helpers in helpers/timeline.py (shared with test_engine.py and test_analyze.py).
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from exporter.analysis import contention, fragmentation, stale
from exporter.analysis.contention import ContentionConfig
from exporter.analysis.engine import Analyzer
from exporter.analysis.fragmentation import FragmentationConfig
from exporter.analysis.pressure import PressureConfig, admission_open, detect_pressure, memory_ratio
from exporter.analysis.stale import StaleConfig, unattributed_bytes
from exporter.model import (
    GpuAnalysis,
    GpuSample,
    HostMemory,
    OomEvent,
    Snapshot,
)
from helpers.timeline import (
    BASE,
    T0,
    GiB,
    MiB,
    gpu,
    leaking_server,
    proc,
    replay_all,
    run_detector,
    snap,
    startup_used,
    timeline,
    vllm_proc,
    vllm_server,
)

# ------------------------------------------------------------------ pressure

def test_memory_ratio_discrete_and_unified():
    assert memory_ratio(gpu(used=40 * GiB), None) == pytest.approx(0.5)
    # Unified memory without NVML memory info: the host's share in use.
    g = GpuSample(index="0", uuid="u", unified=True)
    assert memory_ratio(g, HostMemory(total_bytes=100, available_bytes=30)) == pytest.approx(0.7)
    assert memory_ratio(g, None) is None


def test_admission_hysteresis_closes_above_90_and_reopens_below_80():
    ratios = [0.50, 0.85, 0.89, 0.91, 0.95, 0.85, 0.81, 0.80, 0.79, 0.85, 0.90, 0.905]
    state, states = None, []
    for r in ratios:
        state = admission_open(state, r, r, 0.90, 0.80, 0.02)  # no vLLM: all memory beyond budget
        states.append(state)
    assert states == [True, True, True, False, False, False, False, False, True, True, True,
                      False]


def test_admission_keeps_state_when_utilisation_is_unknown():
    assert admission_open(False, None, None, 0.9, 0.8, 0.02) is False
    assert admission_open(True, None, None, 0.9, 0.8, 0.02) is True
    assert admission_open(None, None, None, 0.9, 0.8, 0.02) is True


def test_admission_stays_open_for_memory_vllm_reserves_by_design():
    # vLLM at gpu_memory_utilization 0.93: 93 % used, nothing beyond its budget.
    assert admission_open(True, 0.93, 0.0, 0.90, 0.80, 0.02) is True
    # A notebook takes 4 % more: closes; it exits again: reopens though still above 80 %.
    assert admission_open(True, 0.97, 0.04, 0.90, 0.80, 0.02) is False
    assert admission_open(False, 0.95, 0.03, 0.90, 0.80, 0.02) is False
    assert admission_open(False, 0.93, 0.005, 0.90, 0.80, 0.02) is True


def test_pressure_warning_at_85_critical_at_95_silent_below():
    cfg = PressureConfig()
    gpus = (gpu(used=50 * GiB, index="0"), gpu(used=70 * GiB, index="1"),
            gpu(used=77 * GiB, index="2"))
    analyses = [GpuAnalysis(g.index, g.uuid, g.used_bytes / g.total_bytes, True, 600.0, 0, g.used_bytes)
                for g in gpus]
    found = {f.gpu: f for f in detect_pressure(gpus, analyses, T0, cfg)}
    assert set(found) == {"1", "2"}
    assert found["1"].severity == "warning" and found["2"].severity == "critical"
    assert dict(found["1"].evidence)["time_to_full_seconds"] == 600.0
    assert found["1"].advice


def test_pressure_ignores_what_vllm_budgeted_but_not_the_cliff():
    cfg = PressureConfig()
    gpus = (gpu(used=72 * GiB, index="0"), gpu(used=74 * GiB, index="1"), gpu(used=77 * GiB, index="2"))
    beyond = {"0": GiB // 2, "1": 4 * GiB, "2": 0}  # 0: vLLM at its 0.9 budget; 1: + a notebook
    analyses = [GpuAnalysis(g.index, g.uuid, g.used_bytes / g.total_bytes, True, None, 0, beyond[g.index])
                for g in gpus]
    found = {f.gpu: f for f in detect_pressure(gpus, analyses, T0, cfg)}
    assert found["1"].severity == "warning" and "0" not in found
    assert found["2"].severity == "critical"  # >= 95 % is the cliff whoever owns the memory
    # What to change: memory beyond the budgets is not vLLM's plan, so shrinking vLLM is not the
    # first advice there (a newcomer's trial: chrome on a GB10, and the advice lowered vLLM); at
    # the cliff with vLLM inside its budget, it is.
    assert not [a for a in found["1"].advice if "--max-num-seqs" in a]
    assert any(a.startswith("5% of the GPU is beyond the vLLM servers' budgets") for a in found["1"].advice)
    assert any("--max-num-seqs" in a for a in found["2"].advice)


def test_pressure_on_a_gpu_no_vllm_server_uses_does_not_advise_vllm():
    # A notebook alone fills the GPU: all its memory is beyond any vLLM budget (a newcomer's trial
    # was told to lower vLLM's --gpu-memory-utilization where no vLLM ran).
    g = gpu(used=78 * GiB, index="0")
    analyses = [GpuAnalysis(g.index, g.uuid, g.used_bytes / g.total_bytes, False, None, 0, g.used_bytes)]
    (f,) = detect_pressure((g,), analyses, T0, PressureConfig())
    assert any(a.startswith("No vLLM server the exporter watches uses this GPU: the 98% in use") for a in f.advice)
    assert not [a for a in f.advice if "--gpu-memory-utilization" in a or "--max-num-seqs" in a]
    # A vLLM process there whose server the exporter does not watch: no budget known, not "no vLLM".
    g = gpu([vllm_proc(10, 70 * GiB), proc(555, 8 * GiB)], index="0")
    analyses = [GpuAnalysis(g.index, g.uuid, g.used_bytes / g.total_bytes, False, None, 0, g.used_bytes)]
    (f,) = detect_pressure((g,), analyses, T0, PressureConfig())
    assert not [a for a in f.advice if a.startswith("No vLLM server")]
    assert any(a.startswith("The vLLM processes on this GPU have no known budget") and "vllm.endpoints" in a
               for a in f.advice)


def test_pressure_names_the_processes_that_fill_the_gpu():
    """On-call should not have to look up who holds the memory: the exporter knows (#19 item 1)."""
    cfg = PressureConfig()
    g = gpu([vllm_proc(10, 67 * GiB), proc(555, 9 * GiB, name="python3"), proc(20, 200 * MiB, name="dcgm")])
    analysis = GpuAnalysis(g.index, g.uuid, g.used_bytes / g.total_bytes, False, None, 0, 9 * GiB)
    [f] = detect_pressure((g,), [analysis], T0, cfg)
    assert "held by pid 10 (VLLM::EngineCor, vLLM http://127.0.0.1:8000) 67.00 GiB, pid 555 (python3) 9.00 GiB" \
        in f.summary
    ev = dict(f.evidence)
    assert (ev["process_1_pid"], ev["process_2_pid"], ev["process_2_bytes"]) == (10, 555, 9 * GiB)
    # On unified memory a host process that is no GPU process fills it too.
    u = GpuSample(index="0", uuid="u", unified=True, total_bytes=128 * GiB, used_bytes=120 * GiB,
                  processes=(vllm_proc(10, 59 * GiB),))
    chrome = proc(7300, None, name="chrome", host_rss_bytes=50 * GiB)
    [f] = detect_pressure((u,), [GpuAnalysis("0", "u", 0.94, False, None, None, 61 * GiB)], T0, cfg,
                          host_processes=(chrome,))
    assert "pid 7300 (chrome) 50.00 GiB" in f.summary


def test_a_raised_pressure_finding_holds_until_use_is_clearly_lower():
    """Use hovering around 85 % raises the finding once, not every other tick."""
    cfg = PressureConfig()
    g = gpu(used=int(0.84 * 80 * GiB), index="0")  # just under the threshold, 10 % beyond budget

    def found(ratio, raised, beyond=8 * GiB):
        analysis = GpuAnalysis(g.index, g.uuid, ratio, True, None, 0, beyond)
        return [f.gpu for f in detect_pressure((g,), [analysis], T0, cfg, raised=raised)]

    assert found(0.84, frozenset()) == []  # not raised: 84 % is below 85 %
    assert found(0.84, frozenset({g.uuid})) == ["0"]  # raised: held until below 83 %
    assert found(0.829, frozenset({g.uuid})) == []
    assert found(0.90, frozenset({g.uuid}), beyond=int(0.015 * 80 * GiB)) == ["0"]  # slack: held above 1 %
    assert found(0.90, frozenset({g.uuid}), beyond=int(0.009 * 80 * GiB)) == []
    assert found(0.90, frozenset(), beyond=int(0.015 * 80 * GiB)) == []  # not raised: needs > 2 %


def test_pressure_hovering_at_the_threshold_is_one_episode_in_the_engine():
    analyzer = Analyzer(log_findings=False)
    for i in range(40):  # 84.5 % and 85.5 % in turn, nothing of it budgeted by vLLM
        used = int((0.845 if i % 2 else 0.855) * 80 * GiB)
        analyzer.update(snap(T0 + 5 * i, [gpu([proc(1, used)], used=used)]))
    episodes = [f for f in analyzer.all_findings if f.kind == "pressure"]
    assert len(episodes) == 1


def test_pressure_config_rejects_inverted_thresholds():
    with pytest.raises(ValueError):
        PressureConfig(warning_ratio=0.96, critical_ratio=0.95)


# ------------------------------------------------------------------ stale memory

def test_unattributed_bytes_unknown_when_a_process_reports_no_usage():
    assert unattributed_bytes(gpu([proc(1, GiB)], used=3 * GiB)) == 2 * GiB
    assert unattributed_bytes(gpu([proc(1, None)], used=3 * GiB)) is None
    assert unattributed_bytes(gpu([proc(1, GiB)], used=3 * GiB, unified=True)) is None


def test_stale_memory_fires_only_after_it_persists():
    cfg = StaleConfig(seconds=120)
    # 6 GiB used, processes account for 1 GiB: 5 GiB unowned from the start.
    snaps = timeline(300, 10, lambda e: snap(T0 + e, [gpu([proc(1, GiB)], used=6 * GiB)]))
    per_tick = run_detector(stale.DETECTOR, snaps, cfg)
    fired_at = [s.timestamp - T0 for s, f in zip(snaps, per_tick, strict=True) if f]
    assert fired_at[0] == 120 and fired_at == [e for e in range(120, 301, 10)]
    f = per_tick[-1][0]
    assert f.kind == "stale_memory" and f.pid is None and f.gpu == "0"
    assert dict(f.evidence)["unattributed_bytes"] == 5 * GiB
    assert any(a.startswith("Find the holder: list the processes using GPU 0") for a in f.advice)


def test_stale_memory_silent_below_threshold_and_on_short_blips():
    cfg = StaleConfig()
    # 700 MiB unowned all the time (under 1 GiB), plus a 60 s blip of 6 GiB unowned.
    def make(e):
        extra = 6 * GiB if 100 <= e < 160 else 700 * MiB
        return snap(T0 + e, [gpu([proc(1, 10 * GiB)], extra=extra)])
    assert not any(run_detector(stale.DETECTOR, timeline(600, 10, make), cfg))


def test_stale_memory_when_serving_process_exits_and_memory_stays():
    cfg = StaleConfig(exit_grace_seconds=60, seconds=600)
    server = vllm_proc(4242, 30 * GiB)

    def make(e):
        if e < 200:
            return snap(T0 + e, [gpu([server])])
        return snap(T0 + e, [gpu([], used=30 * GiB + BASE)])  # exited, memory not back
    per_tick = run_detector(stale.DETECTOR, timeline(400, 10, make), cfg)
    first = next(i for i, f in enumerate(per_tick) if f)
    assert first * 10 == 260  # exit seen at 200, 60 s grace
    f = per_tick[first][0]
    ev = dict(f.evidence)
    assert ev["exited_pid"] == 4242 and ev["held_bytes"] == 30 * GiB
    assert "4242" in f.summary and f.gpu == "0"


def test_stale_memory_names_the_exited_server_for_as_long_as_its_memory_stays():
    """Past lookback_seconds (15 min) the exit is no longer in what the detector scans; the
    finding still names the server that left the memory, with the time since it exited (the
    newcomer's trial: "20.0 GiB in use by no live process for 37 min", the server forgotten)."""
    cfg = StaleConfig(exit_grace_seconds=60, seconds=600)

    def make(e):
        if e < 200:
            return snap(T0 + e, [gpu([vllm_proc(4242, 30 * GiB)])])
        return snap(T0 + e, [gpu([], used=30 * GiB + BASE)])
    per_tick = run_detector(stale.DETECTOR, timeline(3600, 30, make), cfg)
    assert all(f for f in per_tick[10:])
    last = per_tick[-1][0]
    assert dict(last.evidence)["exited_pid"] == 4242
    assert "vLLM process 4242" in last.summary and "exited 56 min ago" in last.summary, last.summary


def test_stale_memory_exit_time_is_accurate_with_dense_sampling():
    """Only a thinned set of past snapshots is scanned; the exit time stays close."""
    cfg = StaleConfig(exit_grace_seconds=60, seconds=600)
    make = lambda e: snap(T0 + e, [gpu([vllm_proc(7, 30 * GiB)]) if e < 700  # noqa: E731
                                   else gpu([], used=30 * GiB + BASE)])
    per_tick = run_detector(stale.DETECTOR, timeline(1000, 1, make), cfg)
    first = next(i for i, f in enumerate(per_tick) if f)
    assert 760 <= first <= 760 + cfg.lookback_seconds / 120 + 1  # late by one thinning gap at most


def test_stale_memory_silent_when_memory_returns_after_exit_and_for_short_lived_process():
    cfg = StaleConfig()

    def make(e):
        procs = [vllm_proc(10, 20 * GiB)]
        if 100 <= e < 150:  # a short-lived helper process on the GPU
            procs.append(proc(77, 3 * GiB, name="nvidia-smi"))
        if e >= 300:
            procs = []  # server stopped, memory returned
        return snap(T0 + e, [gpu(procs)])
    assert not any(run_detector(stale.DETECTOR, timeline(900, 10, make), cfg))


def test_stale_memory_says_how_long_it_has_lasted_beyond_the_raw_window():
    """4.5 h in it says 4.3 h, not the 15 minutes the detector looks back through (#19 item 1);
    beyond what the history keeps it says "at least"."""
    cfg = StaleConfig()

    def make(e):
        return snap(T0 + e, [gpu([vllm_proc(10, 40 * GiB)], extra=BASE + (20 * GiB if e >= 600 else 0))])
    per_tick = run_detector(stale.DETECTOR, timeline(4.5 * 3600, 60, make), cfg)
    last = per_tick[-1][0]
    assert last.summary.endswith("20.39 GiB in use by no live process for 4.3 h"), last.summary  # + BASE
    assert dict(last.evidence)["for_seconds"] == pytest.approx(4.5 * 3600 - 600, abs=120)
    # From the exporter's start on: as far back as it knows, and it says so.
    always = run_detector(stale.DETECTOR, timeline(2 * 3600, 60, lambda e: make(e + 600)), cfg)
    assert always[-1][0].summary.endswith("for at least 2.0 h"), always[-1][0].summary


# ------------------------------------------------------------------ contention

def test_contention_names_other_process_taking_memory_from_a_serving_gpu():
    cfg = ContentionConfig(window_seconds=300)
    server = vllm_proc(10, 60 * GiB)

    def make(e):
        procs = [server]
        if e >= 600:  # a notebook appears and keeps allocating
            procs.append(proc(555, min(12 * GiB, (e - 590) * 100 * MiB), name="python",
                              container="3f2a9c1b7d0e55aa", pod="jupyter-alice",
                              namespace="research"))
        return snap(T0 + e, [gpu(procs)])
    per_tick = run_detector(contention.DETECTOR, timeline(900, 10, make), cfg)
    assert not any(per_tick[:60])  # nothing before the notebook
    f = per_tick[-1][0]
    assert f.kind == "contention" and f.gpu == "0"
    assert "pid 555" in f.summary and "research/jupyter-alice" in f.summary
    ev = dict(f.evidence)
    assert ev["process_1_pid"] == 555 and ev["process_1_pod"] == "jupyter-alice"
    assert ev["held_by_others_bytes"] >= 10 * GiB and ev["process_1_bytes"] >= 10 * GiB


def test_contention_silent_when_the_gpu_keeps_ample_headroom():
    cfg = ContentionConfig()

    def make(e):  # a 6 GiB job next to a 30 GiB server on an 80 GiB GPU
        procs = [vllm_proc(10, 30 * GiB)] + ([proc(555, 6 * GiB)] if e >= 400 else [])
        return snap(T0 + e, [gpu(procs)])
    assert not any(run_detector(contention.DETECTOR, timeline(900, 10, make), cfg))


def test_contention_silent_during_vllm_startup_and_for_small_or_vllm_growth():
    cfg = ContentionConfig()

    def make(e):
        procs = [vllm_proc(10, startup_used(e, 400, 60 * GiB)),  # the server itself grows
                 proc(20, 200 * MiB, name="dcgm")]  # a small, steady monitoring process
        if e >= 800:
            procs.append(proc(30, 300 * MiB, name="nvidia-smi"))  # small newcomer
        return snap(T0 + e, [gpu(procs)])
    assert not any(run_detector(contention.DETECTOR, timeline(1500, 10, make), cfg))


def budgeted(e, others, vllm_used=67 * GiB):
    """A vLLM server budgeted at 0.9 of an 80 GiB GPU (72 GiB), using `vllm_used`, beside `others`."""
    return snap(T0 + e, [gpu([vllm_proc(10, vllm_used), *others(e)])], vllm=[vllm_server(0, 0.4, util=0.9)])


def test_contention_lasts_while_the_other_process_holds_the_memory():
    """The notebook takes 9 GiB at 10 min and keeps it: the finding names it, with its bytes, for
    as long as it holds them, not just for the window after it grew (#19 item 1)."""
    cfg = ContentionConfig(window_seconds=300)
    notebook = lambda e: [proc(555, 9 * GiB, name="python3")] if e >= 600 else []  # noqa: E731
    per_tick = run_detector(contention.DETECTOR, timeline(3 * 3600, 30, lambda e: budgeted(e, notebook)), cfg)
    assert not any(per_tick[:20])
    held = per_tick[20:]
    assert all(len(f) == 1 for f in held)  # raised at once and never cleared while it holds
    first, last = held[0][0], held[-1][0]
    assert first.severity == last.severity == "critical"  # 72 + 9 + 0.4 GiB > 80 GiB
    assert "pid 555 (python3) 9.00 GiB" in last.summary
    assert "hold 9.00 GiB; 1.39 GiB more than the vLLM budget (72.00 GiB) leaves them" in last.summary
    assert dict(first.evidence)["process_1_grew_bytes"] == 9 * GiB
    assert dict(last.evidence)["process_1_grew_bytes"] == 0  # holding still, not growing


def test_contention_held_past_its_shortage_is_told_as_its_newest_short_sample():
    """Critical (9 GiB), then warning (6 GiB), then room to spare (2 GiB): the hold keeps the
    finding and its severity two minutes, told as the newest sample that showed them, not as a
    GPU no longer short (a newcomer's trial: "later warning ... the GPU is 50% used")."""
    cfg = ContentionConfig(window_seconds=300, hold_seconds=120)
    held = {0: 0, 1: 9, 2: 6}
    notebook = lambda e: [proc(555, held.get(int(e // 600), 2) * GiB, name="python3")] if e >= 600 else []  # noqa: E731
    per_tick = dict(zip(range(0, 2400, 30), run_detector(
        contention.DETECTOR, timeline(2370, 30, lambda e: budgeted(e, notebook)), cfg), strict=True))
    for e in (1200, 1290):  # 6 GiB now; 9 GiB within the hold
        (f,) = per_tick[e]
        assert f.severity == "critical" and "pid 555 (python3) 9.00 GiB" in f.summary, (e, f.summary)
    (f,) = per_tick[1350]
    assert f.severity == "warning" and "pid 555 (python3) 6.00 GiB" in f.summary
    for e in (1800, 1890):  # 2 GiB now, room to spare; 6 GiB within the hold
        (f,) = per_tick[e]
        assert f.severity == "warning" and "pid 555 (python3) 6.00 GiB" in f.summary, (e, f.summary)
        assert dict(f.evidence)["held_by_others_bytes"] == 6 * GiB
    assert per_tick[1950] == []
    # A notebook that exits takes the finding with it: nothing is held for a process gone.
    gone = lambda e: [proc(555, 9 * GiB, name="python3")] if 600 <= e < 1200 else []  # noqa: E731
    per_tick = run_detector(contention.DETECTOR, timeline(1230, 30, lambda e: budgeted(e, gone)), cfg)
    assert per_tick[-3] and per_tick[-2] == per_tick[-1] == []


def test_contention_says_how_long_the_memory_has_been_held_beyond_the_window():
    """From the trial: "pid 5230 (python3) 8.6 GiB, steady for 5 min" from 55 to 134 min read as a
    duration that never grew. A process that holds still is said to have held it for as long
    as it has (its per-minute minima), however long past the window."""
    cfg = ContentionConfig(window_seconds=300)
    notebook = lambda e: [proc(555, (0.6 if e < 25 * 60 else 8.6) * GiB, name="python3")] if e >= 600 else []  # noqa: E731
    per_tick = run_detector(contention.DETECTOR, timeline(134 * 60, 30, lambda e: budgeted(e, notebook)), cfg)
    last = per_tick[-1][0]
    # 109 min at 8.6 GiB; 124 min since it took its first 0.6 GiB (a newcomer's trial: "held for 7
    # min" read as if the notebook had just come, half an hour after it had).
    assert "pid 555 (python3) 8.60 GiB, held for 1.8 h at this size, 2.1 h in all" in last.summary, last.summary
    assert "steady" not in last.summary
    assert dict(last.evidence)["process_1_held_seconds"] == pytest.approx(109 * 60, abs=60)
    assert dict(last.evidence)["process_1_holding_seconds"] == pytest.approx(124 * 60, abs=60)
    # Held since before the history starts: a lower bound, said so.
    always = run_detector(contention.DETECTOR, timeline(2 * 3600, 30, lambda e: budgeted(e + 3600, notebook)), cfg)
    assert "8.60 GiB, held for at least 2.0 h" in always[-1][0].summary, always[-1][0].summary


def test_contention_says_growth_since_a_young_process_started_not_over_the_window():
    """From a trial: "+5.59 GiB in 5 min" of a notebook 3 minutes old read as a rate it never
    had. A process younger than the window grew that much since it started; an older one, in
    the window."""
    cfg = ContentionConfig(window_seconds=300)
    came = 600  # the notebook starts 10 min in, and takes 9 GiB at once
    young = lambda e: [proc(555, 9 * GiB, start=T0 + came)] if e >= came else []  # noqa: E731
    per_tick = run_detector(contention.DETECTOR, timeline(came + 180, 30, lambda e: budgeted(e, young)), cfg)
    assert "pid 555 (python3) 9.00 GiB, +9.00 GiB since it started 3 min ago" in per_tick[-1][0].summary, \
        per_tick[-1][0].summary
    grows = lambda e: [proc(555, (1 + 8 * (e >= came)) * GiB)]  # noqa: E731  (started an hour before)
    per_tick = run_detector(contention.DETECTOR, timeline(came + 180, 30, lambda e: budgeted(e, grows)), cfg)
    assert "pid 555 (python3) 9.00 GiB, +8.00 GiB in 5 min" in per_tick[-1][0].summary, per_tick[-1][0].summary


def test_contention_weighs_what_the_others_hold_against_the_vllm_budget():
    cfg = ContentionConfig()

    def verdict(other_bytes):
        findings = run_detector(contention.DETECTOR, timeline(
            600, 30, lambda e: budgeted(e, lambda _: [proc(555, other_bytes, name="embedder")])), cfg)[-1]
        return findings[0].severity if findings else None
    assert verdict(2 * GiB) is None  # 72 + 2 + 0.4 of 80 GiB: 5.6 GiB spare, room to spare
    assert verdict(6 * GiB) == "warning"  # 1.6 GiB spare: under 5 % of the GPU
    assert verdict(9 * GiB) == "critical"  # the vLLM budget does not fit beside the others


def test_contention_advice_gives_the_utilization_that_fits_beside_the_others():
    """What to change, with the figure: the largest --gpu-memory-utilization (two decimals) whose
    share of the total CUDA reports is free beside what the others hold (9 GiB, and the 0.4 GiB
    no process holds) once a restarted server's CUDA context is made, where one server's budget
    is a share of the GPU; the bytes to give up where two servers share it. A driver's reserve
    (memory info v2: outside `used`) is no part of the total the share is of."""
    cfg = ContentionConfig()
    notebook = lambda e: [proc(555, 9 * GiB, name="python3")] if e >= 120 else []  # noqa: E731
    others = 9 * GiB + BASE

    def finding_on(reserved):
        def make(e):
            return snap(T0 + e, [gpu([vllm_proc(10, 67 * GiB), *notebook(e)], reserved_bytes=reserved)],
                        vllm=[vllm_server(0, 0.4, util=0.9)])
        return run_detector(contention.DETECTOR, timeline(900, 30, make), cfg)[-1][0]

    for reserved in (None, 512 * MiB):
        found = finding_on(reserved)
        total = 80 * GiB - (reserved or 0)
        ev = dict(found.evidence)
        assert ev["vllm_budget_bytes"] == int(0.9 * total) and ev["spare_bytes"] == total - int(0.9 * total) - others
        said = re.search(r"--gpu-memory-utilization (\d\.\d\d) or less \(now 0\.90: its budget is ",
                         found.advice[2])
        assert said, found.advice
        share = float(said.group(1))
        room = total - others - contention.CUDA_CONTEXT_BYTES  # free once the new context is made
        assert share * total <= room < (share + 0.01) * total, (share, reserved)

    def two_servers(e):  # two servers at 0.45 each, 32 GiB used each, beside the notebook
        procs = [vllm_proc(10, 32 * GiB), vllm_proc(11, 32 * GiB, endpoint="http://127.0.0.1:8001"),
                 *notebook(e)]
        return snap(T0 + e, [gpu(procs)], vllm=[vllm_server(0, 0.4, util=0.45),
                                                vllm_server(0, 0.4, endpoint="http://127.0.0.1:8001", util=0.45,
                                                            pids=(11,))])
    advice = run_detector(contention.DETECTOR, timeline(900, 30, two_servers), cfg)[-1][0].advice
    assert "lower the vLLM budgets here by 1.39 GiB together" in advice[2], advice


def test_contention_at_start_names_a_process_already_holding_the_memory():
    """An exporter (re)started while a notebook holds the headroom raises at its first tick;
    growth is not known yet and is not made up."""
    cfg = ContentionConfig(window_seconds=300)
    per_tick = run_detector(contention.DETECTOR, timeline(
        120, 10, lambda e: budgeted(e, lambda _: [proc(555, 9 * GiB)])), cfg)
    assert all(per_tick)
    assert "process_1_grew_bytes" not in dict(per_tick[0][0].evidence)
    assert "in 5 min" not in per_tick[0][0].summary


def test_contention_holds_while_the_host_hovers_at_the_threshold():
    """Memory PSI hovering at 10 % (9.7, 10.3, ...) raised and cleared the finding every tick:
    short of memory within the last two minutes counts as short now."""
    cfg = ContentionConfig()

    def make(e):
        g = GpuSample(index="0", uuid="u", unified=True, total_bytes=128 * GiB,
                      processes=(vllm_proc(11, 59 * GiB, host_rss_bytes=GiB),))
        psi = 5.0 if e < 300 else 10.3 if (e // 10) % 2 else 9.7
        return Snapshot(timestamp=T0 + e, gpus=(g,), host=HostMemory(128 * GiB, 40 * GiB, psi),
                        host_processes=(proc(7300, None, name="chrome", host_rss_bytes=20 * GiB),))
    per_tick = run_detector(contention.DETECTOR, timeline(900, 10, make), cfg)
    first = next(i for i, found in enumerate(per_tick) if found)
    assert all(per_tick[first:])


def test_contention_names_nobody_on_a_gpu_without_a_serving_process():
    cfg = ContentionConfig()
    make = lambda e: snap(T0 + e, [gpu([proc(20, 40 * GiB), proc(21, 35 * GiB)])])  # noqa: E731
    assert not any(run_detector(contention.DETECTOR, timeline(900, 30, make), cfg))


def test_contention_on_unified_memory_names_the_host_process_that_holds_it():
    """On unified memory a browser that is no GPU process eats the GPU's memory: the host
    source lists the largest processes, and the finding names it with its growth (#19 item 1);
    the vLLM API server (a root process of the server) is not named."""
    cfg = ContentionConfig(window_seconds=300)
    total = 128 * GiB

    def make(e):
        chrome_rss = int(1.5 * GiB + e / 60 * 300 * MiB)
        g = GpuSample(index="0", uuid="GPU-gb10", unified=True, total_bytes=total,
                      processes=(vllm_proc(11, 59 * GiB, host_rss_bytes=int(1.5 * GiB), ppid=10),))
        hosts = (proc(7300, None, name="chrome", host_rss_bytes=chrome_rss, start=T0 - 60, ppid=1),
                 proc(10, None, name="vllm", host_rss_bytes=2 * GiB, ppid=1),
                 proc(11, None, name="VLLM::EngineCor", host_rss_bytes=int(1.5 * GiB), ppid=10))
        host = HostMemory(total_bytes=total, available_bytes=int(60 * GiB) - chrome_rss,
                          psi_some_avg10=12.0)
        return Snapshot(timestamp=T0 + e, gpus=(g,), host=host, host_processes=hosts,
                        vllm=(vllm_server(0, 0.3, util=0.5, pids=(10,)),))
    per_tick = run_detector(contention.DETECTOR, timeline(900, 30, make), cfg)
    f = per_tick[-1][0]
    assert "pid 7300 (chrome)" in f.summary and "pid 10 " not in f.summary and "VLLM" not in f.summary
    ev = dict(f.evidence)
    assert ev["process_1_pid"] == 7300 and "process_2_pid" not in ev
    assert ev["process_1_rss_grew_bytes"] == pytest.approx(1500 * MiB, rel=0.01)  # 300 MiB/min for 5 min


def test_contention_on_unified_memory_names_rss_growers_and_counts_oom_kills():
    cfg = ContentionConfig(window_seconds=300)
    total = 128 * GiB

    def make(e):
        grow = max(0, e - 300) * 60 * MiB  # a batch job eating host memory from t=300
        server = vllm_proc(10, None, host_rss_bytes=70 * GiB)
        job = proc(99, None, name="spark-job", host_rss_bytes=2 * GiB + grow)
        g = GpuSample(index="0", uuid="GPU-gb10", unified=True, processes=(server, job))
        host = HostMemory(total_bytes=total, available_bytes=int(50 * GiB - grow),
                          psi_some_avg10=min(40.0, grow / GiB), oom_kills=3 if e >= 700 else 0)
        return snap(T0 + e, [g], host=host)
    per_tick = run_detector(contention.DETECTOR, timeline(900, 10, make), cfg)
    assert not any(per_tick[:31])
    warn = next(f[0] for f in per_tick if f)
    assert warn.severity == "warning" and "spark-job" in warn.summary
    last = per_tick[-1][0]
    assert last.severity == "critical" and dict(last.evidence)["oom_kills_in_window"] == 3
    assert dict(last.evidence)["process_1_pid"] == 99


def test_contention_unified_silent_while_host_is_steady():
    cfg = ContentionConfig()

    def make(e):
        g = GpuSample(index="0", uuid="u", unified=True,
                      processes=(vllm_proc(10, None, host_rss_bytes=70 * GiB),))
        return snap(T0 + e, [g], host=HostMemory(128 * GiB, 40 * GiB, 0.5, 0.0, 7))
    assert not any(run_detector(contention.DETECTOR, timeline(900, 10, make), cfg))


def test_contention_on_the_cpu_backend_names_the_host_process_while_the_host_is_short():
    """vLLM's CPU backend (no GPU on the host: the model and its KV cache in host memory): a
    notebook growing beside the server is named while the host is short of memory, and for as
    long as it holds it; the server's own processes never are (#18 item 2g)."""
    cfg = ContentionConfig(window_seconds=300)
    total = 64 * GiB

    def make(e):
        notebook = int(1 * GiB + min(e, 600) / 60 * 600 * MiB)  # 600 MiB/min for 10 min, then held
        engine = proc(11, None, name="VLLM::EngineCor", host_rss_bytes=20 * GiB, ppid=10, role="vllm")
        hosts = (engine, proc(10, None, name="vllm", host_rss_bytes=2 * GiB, ppid=1),
                 proc(4200, None, name="jupyter", host_rss_bytes=notebook, start=T0 - 60, ppid=1))
        host = HostMemory(total_bytes=total, available_bytes=int(16 * GiB) - notebook)
        server = dataclasses.replace(vllm_server(0, 0.3, pids=(10,)), processes=(engine,))
        return Snapshot(timestamp=T0 + e, host=host, host_processes=hosts, vllm=(server,))
    per_tick = run_detector(contention.DETECTOR, timeline(1800, 30, make), cfg)
    short_from = next(i for i, e in enumerate(range(0, 1800, 30))
                      if (16 * GiB - (1 * GiB + min(e, 600) / 60 * 600 * MiB)) / total < 0.15)
    assert not any(per_tick[:short_from])
    assert all(per_tick[short_from:]), "named while the notebook holds the memory"
    f = per_tick[-1][0]
    assert f.gpu is None and f.severity == "warning" and dict(f.evidence)["cpu_backend"] == 1
    assert "CPU backend" in f.summary and "pid 4200 (jupyter)" in f.summary and "VLLM" not in f.summary
    assert dict(f.evidence)["process_1_pid"] == 4200 and "process_2_pid" not in dict(f.evidence)


def test_contention_on_a_host_with_gpus_never_judges_the_host_pool_for_a_loading_server():
    """A server no GPU lists yet (loading) on a host with discrete GPUs: its processes come from
    the host, but the host's memory is not the model's: no host-pool contention."""
    cfg = ContentionConfig(window_seconds=300)

    def make(e):
        engine = proc(11, None, name="VLLM::EngineCor", host_rss_bytes=20 * GiB, ppid=10, role="vllm")
        hosts = (proc(4200, None, name="jupyter", host_rss_bytes=30 * GiB, start=T0 - 60, ppid=1),)
        server = dataclasses.replace(vllm_server(0, 0.3, pids=(10,)), processes=(engine,))
        return Snapshot(timestamp=T0 + e, gpus=(gpu([]),), host=HostMemory(64 * GiB, 2 * GiB),
                        host_processes=hosts, vllm=(server,))
    assert not any(run_detector(contention.DETECTOR, timeline(900, 30, make), cfg))


# ------------------------------------------------------------------ fragmentation

def torch_oom(**kw) -> OomEvent:
    base = dict(kind="torch_cuda_oom", klass="shortage", line=120, source="/var/log/vllm.log",
                gpu="0", requested_bytes=2 * GiB, total_bytes=80 * GiB, free_bytes=1 * GiB)
    base.update(kw)
    return OomEvent(**base)


def test_fragmentation_from_oom_with_large_reserved_but_unallocated():
    cfg = FragmentationConfig()
    event = torch_oom(reserved_bytes=70 * GiB, reserved_unallocated_bytes=20 * GiB)
    snaps = [snap(T0, [gpu([vllm_proc(10, 75 * GiB)])]),
             snap(T0 + 10, [gpu([vllm_proc(10, 75 * GiB)])], events=[event])]
    per_tick = run_detector(fragmentation.DETECTOR, snaps, cfg)
    assert per_tick[0] == []
    f = per_tick[1][0]
    assert f.kind == "fragmentation" and f.severity == "critical" and f.gpu == "0"
    assert dict(f.evidence)["reserved_unallocated_bytes"] == 20 * GiB
    assert any("expandable_segments:True" in a for a in f.advice)


def test_fragmentation_silent_for_a_plain_shortage_oom():
    cfg = FragmentationConfig()
    event = torch_oom(reserved_bytes=76 * GiB, reserved_unallocated_bytes=100 * MiB,
                      free_bytes=300 * MiB)
    snaps = [snap(T0, [gpu([vllm_proc(10, 79 * GiB)], extra=0)], events=[event])]
    assert run_detector(fragmentation.DETECTOR, snaps, cfg) == [[]]


def test_fragmentation_when_oom_happens_with_free_memory_on_nvml():
    cfg = FragmentationConfig(free_ratio=0.2)
    event = torch_oom(free_bytes=None, total_bytes=None)  # the message did not say
    snaps = [snap(T0, [gpu([vllm_proc(10, 40 * GiB)])], events=[event])]
    (f,), = run_detector(fragmentation.DETECTOR, snaps, cfg)
    assert "free" in f.summary


def test_preemptions_while_sampled_kv_usage_looks_low_are_not_fragmentation():
    """vLLM preempts only when its KV cache has no free block: usage that looked low in the
    samples is sampling that missed the peak, never fragmentation (#18 defect 6)."""
    cfg = FragmentationConfig(window_seconds=300)

    def make(e):
        pre = 5 + (e >= 200) * 7  # seven preemptions at t=200
        return snap(T0 + e, [gpu([vllm_proc(10, 70 * GiB)])], vllm=[vllm_server(pre, 0.3)])
    assert not any(run_detector(fragmentation.DETECTOR, timeline(600, 10, make), cfg))


def test_fragmentation_silent_for_preemptions_with_a_full_kv_cache():
    cfg = FragmentationConfig()

    def make(e):  # KV cache full: preemptions are ordinary back-pressure
        return snap(T0 + e, [gpu([vllm_proc(10, 72 * GiB)])],
                    vllm=[vllm_server(e // 10, 0.97)])
    assert not any(run_detector(fragmentation.DETECTOR, timeline(600, 10, make), cfg))


def test_preemption_counter_reset_counts_as_restart_from_zero():
    cfg = FragmentationConfig(window_seconds=300)

    def make(e):
        # 50 preemptions before a server restart at t=100, then 3 more after it.
        pre = 50 if e < 100 else (0 if e < 150 else 3)
        return snap(T0 + e, [gpu([vllm_proc(10, 60 * GiB)])], vllm=[vllm_server(pre, 0.2)])
    per_tick = run_detector(fragmentation.DETECTOR, timeline(200, 10, make), cfg)
    assert not any(per_tick[:15])
    assert dict(per_tick[-1][0].evidence)["preemptions_in_window"] == 3


def test_fragmentation_server_far_above_budget_with_tensor_parallel_advice():
    cfg = FragmentationConfig(budget_sustain_seconds=60)
    ep = "http://127.0.0.1:8000"

    def make(e):
        over = 6 * GiB if e >= 100 else 0  # budget 0.5 x 80 = 40 GiB
        g0 = gpu([vllm_proc(10, 39 * GiB + over, endpoint=ep)], index="0")
        g1 = gpu([vllm_proc(11, 39 * GiB, endpoint=ep)], index="1")
        return snap(T0 + e, [g0, g1], vllm=[vllm_server(0, 0.5, util=0.5, pids=(10, 11))])
    per_tick = run_detector(fragmentation.DETECTOR, timeline(300, 10, make), cfg)
    first = next(i for i, f in enumerate(per_tick) if f)
    assert first * 10 == 160  # over from 100, sustained for 60 s
    (f,) = per_tick[-1]
    assert f.gpu == "0" and f.endpoint == ep
    ev = dict(f.evidence)
    assert ev["budget_bytes"] == 40 * GiB and ev["excess_bytes"] == 5 * GiB
    assert any("NCCL_CUMEM_ENABLE=0" in a for a in f.advice)


def test_fragmentation_silent_for_short_spike_above_budget():
    cfg = FragmentationConfig(budget_sustain_seconds=60)

    def make(e):
        over = 6 * GiB if 100 <= e < 140 else 0
        return snap(T0 + e, [gpu([vllm_proc(10, 39 * GiB + over)])],
                    vllm=[vllm_server(0, 0.5, util=0.5)])
    assert not any(run_detector(fragmentation.DETECTOR, timeline(300, 10, make), cfg))


# ------------------------------------------------------------------ leak (through the engine)

def test_leak_of_a_vllm_process_is_found_with_advice_and_time_to_full():
    analyzer, results = replay_all(leaking_server(3600, 8 * MiB, tp=True))
    leaks = [f for f in analyzer.all_findings if f.kind == "leak"]
    assert {f.pid for f in leaks} == {10, 11}
    f = next(f for f in leaks if f.pid == 10)
    assert f.gpu == "0" and f.role == "vllm" and f.first_detected_at > T0 + 600
    ev = dict(f.evidence)
    assert ev["slope_bytes_per_second"] == pytest.approx(8 * MiB / 60, rel=0.2)
    assert ev["time_to_full_seconds"] > 0
    assert any("NCCL_CUMEM_ENABLE=0" in a for a in f.advice)
    assert any("CUDA graph" in a for a in f.advice)
    trend = next(t for t in results[-1].process_trends if t.pid == 10)
    assert trend.leak_suspected and trend.growth_bytes_per_second > 0


def test_host_rss_leak_of_a_vllm_process_is_a_finding_without_gpu():
    analyzer, results = replay_all(leaking_server(3600, 0, rss_leak_per_min=16 * MiB))
    (f,) = [f for f in analyzer.all_findings if f.kind == "leak"]
    assert f.gpu is None and f.pid == 10 and "host memory" in f.summary
    trend = next(t for t in results[-1].process_trends if t.pid == 10)
    assert not trend.leak_suspected  # discrete GPU: its GPU memory does not leak
    assert trend.host_rss_growth_bytes_per_second > 0


def test_no_leak_for_startup_plateau_and_short_lived_processes():
    def make(e):
        procs = [vllm_proc(10, startup_used(e, 60, 30 * GiB), start=T0)]
        if 1200 <= e < 1500:  # a short job that allocates and exits
            procs.append(proc(50, (e - 1190) * 10 * MiB, start=T0 + 1200))
        return snap(T0 + e, [gpu(procs)])
    analyzer, results = replay_all(timeline(3600, 15, make))
    assert [f for f in analyzer.all_findings if f.kind == "leak"] == []
    assert not any(t.leak_suspected for r in results for t in r.process_trends)


def test_reused_pid_does_not_inherit_the_old_process_history():
    def make(e):
        if e < 1800:  # leaking process
            p = vllm_proc(10, 20 * GiB + e / 60 * 16 * MiB, start=T0 - 600)
        else:  # same PID, new process, flat
            p = vllm_proc(10, 20 * GiB, start=T0 + 1800)
        return snap(T0 + e, [gpu([p])])
    analyzer, results = replay_all(timeline(2400, 15, make))
    leak = [f for f in analyzer.all_findings if f.kind == "leak"]
    assert leak and all(f.first_detected_at < T0 + 1800 for f in leak)
    assert not any(f.kind == "leak" for f in results[-1].findings)
    assert not results[-1].process_trends[0].leak_suspected
