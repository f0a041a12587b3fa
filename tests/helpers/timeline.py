"""Snapshot timelines for detector, engine and analyze tests: processes, GPUs and vLLM servers
built in a line each, and the replays that run the detectors over them causally."""
from __future__ import annotations

from exporter import thresholds
from exporter.analysis.budget import memory_budgets
from exporter.analysis.detector import DetectorSpec, Tick
from exporter.analysis.engine import Analyzer
from exporter.analysis.gpu_verdicts import GpuVerdicts
from exporter.analysis.history import History
from exporter.analysis.kv_cache import kv_caches
from exporter.analysis.leak import LeakConfig
from exporter.model import (
    CacheConfig,
    Episode,
    Finding,
    GpuSample,
    HostMemory,
    ProcessSample,
    Snapshot,
    VllmEngineStats,
    VllmSample,
)

GiB = 1 << 30
MiB = 1 << 20
T0 = 1_700_000_000.0
BASE = 400 * MiB  # driver/context memory NVML counts as used but no process owns


def proc(pid, used, name="python3", role="other", start=T0 - 3600, **kw) -> ProcessSample:
    return ProcessSample(pid=pid, used_bytes=None if used is None else int(used), name=name,
                         role=role, start_time=start, **kw)


def vllm_proc(pid, used, endpoint="http://127.0.0.1:8000", **kw) -> ProcessSample:
    return proc(pid, used, name="VLLM::EngineCor", role="vllm", endpoint=endpoint, **kw)


def gpu(procs=(), used=None, total=80 * GiB, index="0", uuid=None, extra=BASE, **kw) -> GpuSample:
    if used is None:
        used = sum(p.used_bytes or 0 for p in procs) + extra
    return GpuSample(index=index, uuid=uuid or f"GPU-{index}", total_bytes=total,
                     used_bytes=int(used), free_bytes=total - int(used), processes=tuple(procs),
                     **kw)


def snap(t, gpus=(), host=None, vllm=(), events=()) -> Snapshot:
    return Snapshot(timestamp=t, gpus=tuple(gpus), host=host, vllm=tuple(vllm),
                    log_events=tuple(events))


def timeline(seconds, step, make) -> list[Snapshot]:
    """make(elapsed_seconds) -> Snapshot at T0 + elapsed, every `step` seconds."""
    return [make(i * step) for i in range(int(seconds // step) + 1)]


def feed(snapshots, history=None) -> History:
    history = history or History()
    for s in snapshots:
        history.update(s)
    return history


def run_detector(spec: DetectorSpec, snapshots, config=None) -> list[list[Finding]]:
    """Run one registered detector causally after every snapshot through the one detector
    interface, `detector(tick, config)`, as the engine does: a Tick per snapshot with the memory
    budgets, KV caches and GPU verdicts computed once, the snapshot in the history, and the
    findings this detector returned at the tick before as the active ones. Returns its findings
    per tick. `config` None: the detector's defaults."""
    detector = spec.create()
    config = spec.config() if config is None else config
    history, verdicts, leak = History(), GpuVerdicts(), LeakConfig()
    active: tuple[Finding, ...] = ()
    out = []
    for s in snapshots:
        budgets = memory_budgets(s)
        history.update(s, budgets)
        gpus = verdicts.update(s, budgets, history, thresholds.ADMISSION_CLOSE_ABOVE, thresholds.ADMISSION_OPEN_BELOW,
                               thresholds.VLLM_BUDGET_SLACK.value, 3600.0, leak)
        tick = Tick(snapshot=s, history=history, budgets=budgets, kv_caches=kv_caches(s), gpus=gpus, active=active)
        found = list(detector(tick, config))
        active = tuple(found)
        out.append(found)
    return out


def replay_all(snapshots, config=None):
    analyzer = Analyzer(config, log_findings=False)
    results = [analyzer.update(s) for s in snapshots]
    return analyzer, results


def startup_used(elapsed, start_at, level, ramp=90):
    """vLLM start-up: nothing, then weights + KV cache allocated within `ramp` seconds."""
    if elapsed < start_at:
        return 0
    return level * min(1.0, (elapsed - start_at + 10) / ramp)


def just_raised(finding: Finding) -> Episode:
    """The episode of a finding just raised: one version, still active."""
    return Episode(finding, finding, finding.first_detected_at)


def kinds(findings):
    return sorted({f.kind for f in findings})


def vllm_server(preemptions, kv, endpoint="http://127.0.0.1:8000", util=0.9, pids=(10,)):
    return VllmSample(endpoint=endpoint, up=True, pids=pids,
                      engines=(VllmEngineStats(model="m", engine="0", kv_cache_usage_ratio=kv,
                                               preemptions_total=preemptions),),
                      cache_config=CacheConfig(gpu_memory_utilization=util))


def leaking_server(seconds, leak_per_min, step=15, pid=10, tp=False, rss_leak_per_min=0):
    def make(e):
        used = startup_used(e, 0, 30 * GiB) + max(0, e - 600) / 60 * leak_per_min
        rss = 6 * GiB + max(0, e - 600) / 60 * rss_leak_per_min
        gpus = [gpu([vllm_proc(pid, used, start=T0, host_rss_bytes=int(rss))]),
                ]
        if tp:
            gpus.append(gpu([vllm_proc(pid + 1, used, start=T0, host_rss_bytes=int(rss))],
                            index="1"))
        return snap(T0 + e, gpus, host=HostMemory(512 * GiB, 400 * GiB),
                    vllm=[vllm_server(0, 0.5, util=0.9, pids=(pid, pid + 1))])
    return timeline(seconds, step, make)
