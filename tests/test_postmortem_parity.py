"""Post-mortem parity: `analyze` on a flight-recorder trace raises what the live daemon raised.

The scenarios run through the real daemon tick (simulated NVML, host, vLLM server and log →
sampler → analysis → flight recorder) on a virtual clock; the recorder's file is then replayed
by `analyze` and its findings compared with the live daemon's, kind and first_detected_at.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exporter.config import build as build_config
from exporter.daemon import Daemon
from exporter.model import (
    AllocatorStats,
    CacheConfig,
    GpuSample,
    HostMemory,
    MemoryProfile,
    OomMessage,
    ProcessSample,
    Snapshot,
    VllmEngineStats,
    VllmSample,
)
from exporter.postmortem.analyze import analyze, read_log_events, replay, replay_episodes
from exporter.postmortem.logtime import line_time
from exporter.postmortem.trace import TraceError, load_traces, read_trace, write_csv
from exporter.reactions.recorder import FlightRecorder
from exporter.runtime import build as build_runtime
from exporter.service import make_analyzer, make_recorder

GiB = 1 << 30
STEP = 10.0
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# What PyTorch raises when the leaking EngineCore finally runs out (one vLLM worker log line).
OOM_LINE = ("(EngineCore_DP0 pid=3150) ERROR 11-22 10:05:14 [core.py:710] torch.OutOfMemoryError: "
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
            "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB "
            "memory in use. Of the allocated memory 74.88 GiB is allocated by PyTorch, and 612.04 MiB "
            "is reserved by PyTorch but unallocated.\n")


class Live:
    """A scenario played through Daemon.tick with a virtual clock, the flight recorder on."""

    def __init__(self, name, directory, tail_seconds=300.0, log_file=None, detectors=None, **recorder):
        overrides: dict = {"recorder": {"directory": str(directory), "tail_seconds": tail_seconds, **recorder}}
        if detectors:
            overrides["detectors"] = detectors
        if recorder.get("window_seconds", 0) > 3600:
            overrides["history"] = {"raw_seconds": recorder["window_seconds"]}
        if log_file:
            overrides["logs"] = {"files": [str(log_file)]}
        self.config = build_config(overrides)
        self.runtime = build_runtime(self.config, simulate=name, at=0.0)
        self.clock = self.runtime.clock
        self.analyzer = make_analyzer(self.config)
        self.recorder = make_recorder(self.config, self.clock)
        self.daemon = Daemon(self.runtime.sampler, self.clock, STEP, analyzer=self.analyzer,
                             recorder=self.recorder)
        self.directory = str(directory)

    def run_until(self, elapsed):
        while self.clock.elapsed() < elapsed:
            self.daemon.tick()
            self.clock.advance(STEP)

    def stop(self):
        self.daemon.stop()  # closes the recorder: what is pending is written
        self.runtime.close()

    def files(self):
        return sorted(os.path.join(self.directory, n) for n in os.listdir(self.directory)
                      if n.endswith(".csv")) if os.path.isdir(self.directory) else []


def kinds_and_times(episodes, start, end):
    """(kind, gpu, pid, first_detected_at) of the findings raised between start and end."""
    return sorted(((f.kind, f.gpu, f.pid, f.first_detected_at) for f, _ in episodes
                   if start <= f.first_detected_at <= end), key=repr)


def analyze_json(path, *extra):
    out = subprocess.run([sys.executable, "-m", "exporter", "analyze", path, "--format", "json", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stale_memory_trace_holds_the_aftermath_and_replays_the_live_finding(tmp_path):
    live = Live("stale-memory", tmp_path / "rec")
    try:
        live.run_until(600 + STEP)  # the server exits at 600 s: the vllm_exit trigger
        assert live.files() == []  # recording the aftermath, not written at the trigger
        assert live.recorder.recording
        live.run_until(1200)
    finally:
        live.stop()
    [path] = live.files()
    start = live.clock.start
    assert "vllm_exit" in os.path.basename(path)

    trace = load_traces([path])
    # The file states its trigger and when; the tail after it is tail_seconds long.
    assert trace.triggers == [(start + 600, "vllm_exit")]
    assert trace.snapshots[0].timestamp == start  # the window before: from the start here
    assert trace.snapshots[-1].timestamp == start + 900

    live_found = kinds_and_times(live.analyzer.episodes(), start, start + 900)
    assert [k for k, *_ in live_found] == ["stale_memory"]
    replayed = replay_episodes(trace.snapshots)[0]
    assert kinds_and_times(replayed, start, start + 900) == live_found  # same kind, same moment

    out = analyze_json(path)
    assert [(f["kind"], f["first_detected_at"]) for f in out["findings"]] == \
        [("stale_memory", start + 720)]
    assert out["trace"]["triggers"] == [{"timestamp": start + 600, "trigger": "vllm_exit"}]
    # The vLLM servers' samples travelled with the trace (cache config, KV usage).
    servers = [v for s in trace.snapshots for v in s.vllm if v.up]
    assert servers and servers[0].cache_config.gpu_memory_utilization == 0.9
    assert servers[0].engines[0].kv_cache_usage_ratio is not None


def test_analyze_replays_with_the_daemons_detector_settings_given_its_config(tmp_path):
    # The daemon ran with stale memory judged after 240 s, not 120: a replay with the built-in
    # settings would date the finding two minutes early (the trial of 5d3e341: a leak critical
    # live, only a warning in the replay).
    # The daemon's file, copied from its host: the listener's web config (TLS) and the kubelet's
    # token are files of that host, which a replay neither has nor needs.
    config = tmp_path / "exporter.yml"
    config.write_text("detectors:\n  stale_memory: {seconds: 240}\n"
                      f"web_config_file: {tmp_path / 'absent' / 'web.yml'}\n"
                      f"kubelet: {{enabled: 'true', token_file: {tmp_path / 'absent' / 'token'}}}\n")
    live = Live("stale-memory", tmp_path / "rec", detectors={"stale_memory": {"seconds": 240}})
    try:
        live.run_until(1200)
    finally:
        live.stop()
    [path] = live.files()
    start = live.clock.start
    assert [(f.kind, f.first_detected_at) for f, _ in live.analyzer.episodes()] == [("stale_memory", start + 840)]
    assert [(f["kind"], f["first_detected_at"]) for f in analyze_json(path, "--config", str(config))["findings"]] \
        == [("stale_memory", start + 840)]
    assert [(f["kind"], f["first_detected_at"]) for f in analyze_json(path)["findings"]] == \
        [("stale_memory", start + 720)]
    # The sections the replay uses are checked as the daemon checks them.
    config.write_text("detectors:\n  stale_memory: {seconds: -1}\n")
    out = subprocess.run([sys.executable, "-m", "exporter", "analyze", path, "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "detectors.stale_memory.seconds" in out.stderr, out.stderr


def test_without_a_tail_the_trace_ends_at_the_exit_and_misses_the_stale_memory(tmp_path):
    """Why the tail exists: written at the trigger, the trace cannot show what followed."""
    live = Live("stale-memory", tmp_path / "rec", tail_seconds=0)
    try:
        live.run_until(1200)
    finally:
        live.stop()
    [path] = live.files()
    assert read_trace(path)[-1].timestamp == live.clock.start + 600
    assert [f.kind for f in replay(read_trace(path))] == []
    assert any(f.kind == "stale_memory" for f, _ in live.analyzer.episodes())


def test_leak_then_oom_trace_replays_the_leak_and_the_oom(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO 11-22 09:00:00 [api_server.py:1043] vLLM API server version 0.11.0\n")
    # The window holds the whole run, so the replay starts where the live daemon started.
    live = Live("leak", tmp_path / "rec", log_file=log, window_seconds=7200)
    try:
        while not any(f.kind == "leak" and f.gpu == "0" for f, _ in live.analyzer.episodes()):
            assert live.clock.elapsed() < 6000, "the GPU leak was never raised"  # about 1 h
            live.run_until(live.clock.elapsed() + STEP)
        live.run_until(live.clock.elapsed() + 120)
        oom_elapsed = live.clock.elapsed()
        with open(log, "a") as fh:
            fh.write(OOM_LINE)
        # The log source finishes a message when the log goes quiet: the tick after next.
        while not live.recorder.recording:
            assert live.clock.elapsed() < oom_elapsed + 3 * STEP, "the OOM never triggered"
            live.run_until(live.clock.elapsed() + STEP)
        oom_at = live.clock.start + live.clock.elapsed() - STEP  # the tick that read it
        assert live.files() == []
        live.run_until(oom_at - live.clock.start + 600)
    finally:
        live.stop()
    [path] = live.files()
    start = live.clock.start
    trace = load_traces([path])
    assert trace.triggers == [(oom_at, "oom+critical")]  # the OOM finding is critical at once
    assert trace.snapshots[-1].timestamp >= oom_at + 300  # the aftermath is in the file
    [recorded] = [e for s in trace.snapshots for e in s.log_events]
    assert recorded.kind == "torch_cuda_oom" and recorded.requested_bytes == 2 * GiB

    end = trace.snapshots[-1].timestamp
    live_found = kinds_and_times(live.analyzer.episodes(), start, end)
    assert {"leak", "oom"} <= {k for k, *_ in live_found}
    replayed = replay_episodes(trace.snapshots)[0]
    assert kinds_and_times(replayed, start, end) == live_found

    # analyze: the findings, the OOM event with its class, the trigger; the report states them.
    report = tmp_path / "incident.html"
    out = analyze_json(path, "--report", str(report))
    assert {"leak", "oom"} <= {f["kind"] for f in out["findings"]}
    [event] = out["oom_events"]
    assert event["kind"] == "torch_cuda_oom" and event["class"] and event["timestamp"] == oom_at
    html = report.read_text()
    assert "Flight recorder trigger: <b>oom+critical</b>" in html


def test_shutdown_writes_a_recording_still_in_its_tail(tmp_path):
    live = Live("stale-memory", tmp_path / "rec", tail_seconds=3600)
    try:
        live.run_until(800)
        assert live.files() == []
    finally:
        live.stop()
    [path] = live.files()
    snaps = read_trace(path)
    assert snaps[-1].timestamp == live.clock.start + 790  # everything up to the last tick


def _snap(t, events=(), procs_gb=10):
    proc = ProcessSample(pid=7, used_bytes=procs_gb * GiB, name="VLLM::EngineCor", role="vllm",
                         endpoint="e", start_time=1.0,
                         allocator=AllocatorStats(allocated_bytes=5 * GiB, reserved_bytes=8 * GiB,
                                                  alloc_conf=(("PYTORCH_CUDA_ALLOC_CONF", "x"),)))
    gpus = (GpuSample(index="0", uuid="GPU-a", total_bytes=80 * GiB, used_bytes=11 * GiB,
                      free_bytes=69 * GiB, processes=(proc,)),
            GpuSample(index="1", uuid="GPU-b", up=False, error="gpu_lost"))
    vllm = (VllmSample(endpoint="e", up=True, pids=(7,),
                       engines=(VllmEngineStats(model="m", engine="0", kv_cache_usage_ratio=0.97,
                                                requests_running=12.0, requests_waiting=40.0,
                                                preemptions_total=3.0, sleep_state="awake"),),
                       cache_config=CacheConfig(gpu_memory_utilization=0.6, kv_cache_memory_bytes=20 * GiB,
                                                num_gpu_blocks=100, block_size=16,
                                                kv_cache_size_tokens=1600),
                       memory_profile=(("weights", 15 * GiB),),
                       startup=MemoryProfile(weights_bytes=15 * GiB, kv_cache_memory_flag_bytes=20 * GiB)),
            VllmSample(endpoint="down", up=False, error_kind="refused"))
    return Snapshot(timestamp=t, gpus=gpus, host=HostMemory(512 * GiB, 400 * GiB), vllm=vllm,
                    log_events=tuple(events))


def test_the_trace_carries_what_the_detectors_read(tmp_path):
    oom = OomMessage(kind="torch_cuda_oom", line=4, source="/var/log/vllm.log", message="CUDA out of memory",
                     gpu="0", timestamp=1000.0, requested_bytes=GiB, free_bytes=GiB // 2,
                     other_processes=((99, 3 * GiB),), processes_listed=True)
    snaps = [_snap(1000.0 + 10 * i, events=(oom,) if i == 2 else ()) for i in range(4)]
    path = str(tmp_path / "t.csv")
    write_csv(snaps, path, triggers={1020.0: ["oom", "critical"]})
    trace = load_traces([path])
    assert trace.snapshots == snaps  # every field the analysis reads comes back equal
    assert trace.triggers == [(1020.0, "oom+critical")]
    # Extra columns only: the contract's first five stay where a reader expects them.
    with open(path) as fh:
        assert fh.readline().startswith("timestamp,gpu,pid,process,used_bytes,")


def test_the_fragmentation_scenario_replays_from_its_trace(tmp_path):
    """Preemption-based fragmentation needs the vLLM columns: without them it is not raised."""
    config = build_config()
    runtime = build_runtime(config, simulate="fragmentation", at=0.0)
    analyzer = make_analyzer(config)
    daemon = Daemon(runtime.sampler, runtime.clock, STEP, analyzer=analyzer)
    try:
        while runtime.clock.elapsed() < 1800:
            daemon.tick()
            runtime.clock.advance(STEP)
    finally:
        runtime.close()
    path = str(tmp_path / "frag.csv")
    write_csv(analyzer.history.recent(runtime.clock.start), path)
    live_found = sorted((f.kind, f.first_detected_at) for f, _ in analyzer.episodes())
    assert ("fragmentation" in {k for k, _ in live_found})
    assert sorted((f.kind, f.first_detected_at) for f in replay(read_trace(path))) == live_found


def test_a_minimal_five_column_trace_still_analyzes(tmp_path):
    path = tmp_path / "min.csv"
    rows = ["timestamp,gpu,pid,process,used_bytes"]
    for i in range(200):  # 80 GiB card implied by nothing: memory only, no totals
        rows.append(f"{1_700_000_000 + 15 * i},0,42,python,{GiB + i * 8 * (1 << 20)}")
    path.write_text("\n".join(rows) + "\n")
    out = json.loads(analyze([str(path)], "json"))
    assert out["trace"]["samples"] == 200 and out["trace"]["triggers"] == []
    assert out["oom_events"] == []
    assert isinstance(out["findings"], list)


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(FIXTURES, "traces"))))
def test_old_traces_keep_loading(name):
    assert read_trace(os.path.join(FIXTURES, "traces", name))


def test_a_bad_json_cell_is_a_trace_error_naming_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('timestamp,gpu,pid,process,used_bytes,vllm\n1,0,,,5,"[{""endpoint"": 3}]"\n')
    with pytest.raises(TraceError, match=r"bad.csv:2: .*endpoint"):
        read_trace(str(path))


def test_log_line_times():
    ref = 1_763_800_000.0  # 2025-11-22
    assert line_time("(VllmWorker rank=0 pid=4711) ERROR 11-22 10:05:14 [x.py:1] boom", ref) == 1_763_805_914.0
    assert line_time("2025-11-22 10:20:00,100 - vllm.worker - ERROR - x", ref) == pytest.approx(1_763_806_800.1)
    assert line_time("2025-11-22T11:20:00+01:00 x", ref) == 1_763_806_800.0
    assert line_time("Nov 22 10:30:01 host kernel: [812345.1] Out of memory", ref) == 1_763_807_401.0
    assert line_time("[812345.100231] Out of memory: Killed process 4711", ref) is None


def test_analyze_lists_the_logs_oom_events_with_class_and_time(tmp_path):
    log = os.path.join(FIXTURES, "logs", "vllm_v1_worker_oom.log")
    [event] = read_log_events([log], reference=1_763_800_000.0)
    # the traceback's line has no time; the log line it follows does
    assert event.timestamp == 1_763_805_914.0 and event.klass
    trace = os.path.join(FIXTURES, "traces", "normal.csv")
    out = subprocess.run([sys.executable, "-m", "exporter", "analyze", trace, "--log", log,
                          "--report", str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The only event is before the trace: listed apart, not counted as the incident's (#19).
    assert "Within the trace's time, no out-of-memory event in the trace and the log given" in out.stdout
    assert "1 more outside the trace's time, not part of this incident:" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "vllm_v1_worker_oom.log:" in ln)
    assert f"torch_cuda_oom, class {event.klass}, 2024-11-22 10:05:14 UTC" in line  # the trace's year
    # The trace runs 13:00 to 14:30: the event is before it, and said to be (#19).
    assert "OUTSIDE THE TRACE: 2h54m46s before the trace starts" in line
    assert "2024-11-22 10:05:14 UTC" in (tmp_path / "r.html").read_text()


def test_a_flapping_trigger_cannot_postpone_the_file_forever(tmp_path):
    from exporter.model import Analysis, State

    rec = FlightRecorder(str(tmp_path), window_seconds=600, tail_seconds=300, debounce_seconds=0)
    history: list[Snapshot] = []
    still = {}
    try:
        for i in range(70):  # a trigger on every tick, 10 s apart
            t = 1000.0 + 10 * i
            history.append(_snap(t))
            state = State(snapshot=history[-1], analysis=Analysis(t, transitions=("oom",)))
            rec.observe(state, lambda since: [s for s in history if s.timestamp >= since])
            still[t] = rec.recording
    finally:
        rec.close()
    # Each trigger extends the tail, up to max(tail, window) after the first one: 1600.
    assert still[1590.0] and not still[1600.0]


def _series(name, labels, values):
    return {"metric": {"__name__": name, **labels}, "values": [[t, str(v)] for t, v in values]}


def test_a_prometheus_range_carries_the_vllm_series_the_findings_need(tmp_path):
    """Budget inputs, KV usage and preemptions come back from a range query, and a serving
    process is tied to its server through the server's per-GPU memory series."""
    from exporter.analysis.budget import memory_budgets

    ts = [1000, 1015]
    gpu = {"gpu": "0", "uuid": "GPU-a"}
    proc = {**gpu, "pid": "7", "process": "VLLM::EngineCor", "role": "vllm"}
    ep = {"endpoint": "llama"}
    eng = {**ep, "model": "m", "engine": "0"}
    result = [
        _series("gpumem_process_memory_used_bytes", proc, [(t, 60 * GiB) for t in ts]),
        _series("gpumem_gpu_memory_total_bytes", gpu, [(t, 80 * GiB) for t in ts]),
        _series("gpumem_gpu_memory_used_bytes", gpu, [(t, 61 * GiB) for t in ts]),
        _series("gpumem_vllm_up", ep, [(t, 1) for t in ts]),
        _series("gpumem_vllm_kv_cache_usage_ratio", eng, [(1000, 0.5), (1015, 0.97)]),
        _series("gpumem_vllm_requests_waiting", eng, [(t, 40) for t in ts]),
        _series("gpumem_vllm_preemptions_total", eng, [(1000, 2), (1015, 9)]),
        _series("gpumem_vllm_cache_config_info",
                {**ep, "block_size": "16", "cache_dtype": "auto", "gpu_memory_utilization": "0.9",
                 "num_gpu_blocks": "1000"}, [(t, 1) for t in ts]),
        _series("gpumem_vllm_memory_used_bytes", {**ep, **gpu}, [(t, 60 * GiB) for t in ts]),
        # The exporter's level per {endpoint, engine}, with no model label: 0 awake, 1 level 1.
        _series("gpumem_vllm_engine_sleep_state", {**ep, "engine": "0"}, [(1000, 0), (1015, 1)]),
    ]
    path = tmp_path / "range.json"
    path.write_text(json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}))
    snaps = read_trace(str(path))
    [server] = snaps[1].vllm
    assert server.up and server.cache_config.gpu_memory_utilization == 0.9
    assert server.cache_config.num_gpu_blocks == 1000
    [engine] = server.engines
    assert (engine.kv_cache_usage_ratio, engine.requests_waiting, engine.preemptions_total) == (0.97, 40, 9)
    assert engine.model == "m" and engine.sleep_state == "weights_offloaded"
    assert [e.sleep_state for e in snaps[0].vllm[0].engines] == ["awake"]
    assert snaps[1].gpus[0].processes[0].endpoint == "llama"
    [budget] = memory_budgets(snaps[1])
    assert budget.endpoint == "llama" and budget.budget_bytes == int(0.9 * 80 * GiB)
