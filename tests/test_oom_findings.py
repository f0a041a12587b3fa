"""The `oom` finding: out-of-memory events from the logs, and the kernel's OOM killer on a host where
it takes GPU memory (unified memory) or serves vLLM: critical, held for hold_seconds, naming what
was killed, and logged (#19: the unified-memory scenario's kill was never surfaced)."""
from __future__ import annotations

import logging

from exporter.analysis import oom_findings
from exporter.analysis.engine import Analyzer
from exporter.analysis.oom_findings import OomConfig
from exporter.model import GpuSample, HostMemory, Snapshot
from helpers.timeline import T0, GiB, gpu, proc, run_detector, timeline, vllm_proc, vllm_server

KILL_AT = 600


def unified(e: float, kill_at: float = KILL_AT) -> Snapshot:
    """A GB10: vLLM and a browser share its 128 GiB; the kernel kills the browser at `kill_at`."""
    killed = e >= kill_at
    g = GpuSample(index="0", uuid="GPU-gb10", unified=True, total_bytes=128 * GiB,
                  processes=(vllm_proc(11, 59 * GiB, host_rss_bytes=int(1.5 * GiB), ppid=10),))
    hosts = (proc(10, None, name="vllm", host_rss_bytes=2 * GiB, ppid=1),
             *(() if killed else (proc(7300, None, name="chrome", host_rss_bytes=48 * GiB, ppid=1),)))
    host = HostMemory(total_bytes=128 * GiB, available_bytes=(60 if killed else 10) * GiB, psi_some_avg10=30.0,
                      oom_kills=4 if killed else 3)
    return Snapshot(timestamp=T0 + e, gpus=(g,), host=host, host_processes=hosts,
                    vllm=(vllm_server(0, 0.3, util=0.5, pids=(10,)),))


def test_a_kernel_oom_kill_on_unified_memory_is_a_critical_finding_on_the_gpu_naming_the_victim():
    per_tick = run_detector(oom_findings.DETECTOR, timeline(1200, 10, unified), OomConfig(hold_seconds=300))
    active = [bool(found) for found in per_tick]
    assert active.index(True) == KILL_AT // 10 and active.count(True) == 300 // 10 + 1  # held 5 min
    (f,) = per_tick[KILL_AT // 10 + 5]
    assert (f.kind, f.severity, f.gpu) == ("oom", "critical", "0")
    assert "the kernel OOM killer ran 1 time " in f.summary
    assert "pid 7300 (chrome, 48.00 GiB resident)" in f.summary
    ev = dict(f.evidence)
    assert ev["kernel_oom_kills"] == 1 and ev["process_1_pid"] == 7300 and ev["last_kill_at"] == T0 + KILL_AT
    assert any("journalctl -k" in a for a in f.advice)


def test_the_kill_is_logged_when_raised(caplog):
    analyzer = Analyzer(detectors=[oom_findings.DETECTOR])
    with caplog.at_level(logging.WARNING, logger="exporter.findings"):
        for s in timeline(700, 10, unified):
            analyzer.update(s)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "exporter.findings"]
    assert line.startswith("finding raised: oom [critical] gpu=0:") and "chrome" in line


def test_a_kernel_kill_on_a_host_serving_vllm_is_a_host_finding():
    def make(e):
        workers = [vllm_proc(11, 70 * GiB, host_rss_bytes=4 * GiB)] + (
            [] if e >= KILL_AT else [proc(50, None, name="etl", host_rss_bytes=300 * GiB)])
        return Snapshot(timestamp=T0 + e, gpus=(gpu(workers[:1]),), vllm=(vllm_server(0, 0.3),),
                        host=HostMemory(512 * GiB, 20 * GiB, oom_kills=int(e >= KILL_AT)))
    per_tick = run_detector(oom_findings.DETECTOR, timeline(900, 10, make))
    (f,) = per_tick[KILL_AT // 10]
    assert f.gpu is None and f.summary.startswith("host: the kernel OOM killer ran 1 time ")


def test_a_kernel_kill_on_a_host_without_vllm_or_unified_memory_is_none_of_its_business():
    def make(e):
        return Snapshot(timestamp=T0 + e, gpus=(gpu([proc(20, 10 * GiB)]),),
                        host=HostMemory(512 * GiB, 20 * GiB, oom_kills=int(e >= KILL_AT)))
    assert not any(run_detector(oom_findings.DETECTOR, timeline(900, 10, make)))


def test_a_counter_that_restarts_is_no_kill():
    def make(e):
        snap = unified(e, kill_at=10**9)
        return Snapshot(timestamp=snap.timestamp, gpus=snap.gpus, host_processes=snap.host_processes,
                        vllm=snap.vllm, host=HostMemory(128 * GiB, 60 * GiB, oom_kills=0 if e >= KILL_AT else 9))
    assert not any(run_detector(oom_findings.DETECTOR, timeline(900, 10, make)))
