"""The analysis engine: one `Analyzer.update(snapshot)` per sampling tick.

It feeds the bounded History, runs every detector (pure functions over history + snapshot),
and keeps the active findings keyed by `Finding.key`, so a finding keeps its
first_detected_at while it stays active and is logged once when raised (WARNING) and once
when cleared (INFO) on the "exporter.findings" logger. Time comes only from snapshot
timestamps, never the wall clock, so a replay of a recorded trace raises the same findings
at the same moments as the live daemon did.

Detectors that live here because they are thin wrappers: leak (over D1's leak.assess) and
oom (each OOM event from the logs becomes a finding, held for `oom_hold_seconds`).
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from ..model import (Analysis, Finding, GpuAnalysis, GpuSample, OomEvent, ProcessSample,
                     ProcessTrend, Snapshot)
from .budget import memory_budgets
from .contention import ContentionConfig, detect_contention
from .fragmentation import FragmentationConfig, detect_fragmentation, recent_events
from .history import History
from .leak import LeakAssessment, LeakConfig, LeakLatch, assess
from .leak import time_to_full as forecast_time_to_full
from .pressure import (PressureConfig, admission_open, beyond_budget_bytes, detect_pressure,
                       memory_ratio)
from .stale import StaleConfig, detect_stale, unattributed_bytes

findings_log = logging.getLogger("exporter.findings")
log = logging.getLogger(__name__)

GIB = 1 << 30
_SEVERITY = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class AnalysisConfig:
    admission_close_above: float = 0.90  # admission closes above this utilisation ...
    admission_open_below: float = 0.80  # ... and reopens only below this one
    history_raw_seconds: float = 3600.0
    history_retention_seconds: float = 6 * 3600.0
    history_dead_grace_seconds: float = 900.0
    forecast_window_seconds: float = 3600.0  # GPU used trend window for time-to-full
    leak_critical_seconds: float = 3600.0  # a leak that fills the GPU sooner is critical
    oom_hold_seconds: float = 300.0  # an OOM finding stays active this long after the event
    max_recorded_findings: int = 10_000  # all_findings keeps at most this many (oldest go)
    leak: LeakConfig = field(default_factory=LeakConfig)
    pressure: PressureConfig = field(default_factory=PressureConfig)
    stale: StaleConfig = field(default_factory=StaleConfig)
    contention: ContentionConfig = field(default_factory=ContentionConfig)
    fragmentation: FragmentationConfig = field(default_factory=FragmentationConfig)

    def __post_init__(self) -> None:
        if not 0 < self.admission_open_below <= self.admission_close_above <= 1:
            raise ValueError("analysis: need 0 < admission_open_below <= admission_close_above <= 1")
        if self.max_recorded_findings < 1 or self.forecast_window_seconds <= 0:
            raise ValueError("analysis: max_recorded_findings >= 1, forecast_window_seconds > 0")
        # Detectors look back through raw snapshots; the history must keep them that long.
        needed = {
            "stale.lookback_seconds": self.stale.lookback_seconds,
            "2 x contention.window_seconds": 2 * self.contention.window_seconds,
            "fragmentation.window_seconds": self.fragmentation.window_seconds,
            "2 x fragmentation.budget_sustain_seconds":
                2 * self.fragmentation.budget_sustain_seconds,
            "oom_hold_seconds": self.oom_hold_seconds,
        }
        for name, seconds in needed.items():
            if seconds > self.history_raw_seconds:
                raise ValueError(f"analysis: history_raw_seconds ({self.history_raw_seconds:g}) "
                                 f"must cover {name} ({seconds:g})")


@dataclass
class _Episode:
    """One finding from raise to clear; `finding` is its worst (then latest) version."""

    finding: Finding
    cleared_at: float | None = None


class Analyzer:
    def __init__(self, config: AnalysisConfig | None = None, log_findings: bool = True):
        self.config = config or AnalysisConfig()
        self.history = History(raw_seconds=self.config.history_raw_seconds,
                               retention_seconds=self.config.history_retention_seconds,
                               dead_grace_seconds=self.config.history_dead_grace_seconds)
        self.log_findings = log_findings
        self.detector_errors: Counter[str] = Counter()  # detector -> exceptions caught
        self.dropped_findings = 0  # episodes evicted from all_findings by the size bound
        self._active: dict[tuple, tuple[int, Finding]] = {}  # key -> (episode id, finding)
        self._episodes: OrderedDict[int, _Episode] = OrderedDict()
        self._next_episode = 0
        self._admission: dict[str, bool] = {}  # GPU uuid -> open
        self._latch = LeakLatch()

    # ------------------------------------------------------------------ public
    @property
    def active_findings(self) -> tuple[Finding, ...]:
        return tuple(f for _, f in self._active.values())

    @property
    def all_findings(self) -> tuple[Finding, ...]:
        """Every finding raised (bounded), in the order raised, each in its worst version."""
        return tuple(e.finding for e in self._episodes.values())

    def episodes(self) -> list[tuple[Finding, float | None]]:
        """(finding, cleared_at) for every recorded finding; cleared_at None while active."""
        return [(e.finding, e.cleared_at) for e in self._episodes.values()]

    def reconfigure(self, config: AnalysisConfig) -> None:
        """Take new thresholds (a configuration reload) from the next tick on. The history's
        sizes stay: they change only on restart, as resizing would drop what it holds."""
        self.config = replace(config, history_raw_seconds=self.config.history_raw_seconds,
                              history_retention_seconds=self.config.history_retention_seconds,
                              history_dead_grace_seconds=self.config.history_dead_grace_seconds)

    def update(self, snapshot: Snapshot) -> Analysis:
        self.history.update(snapshot)
        now = snapshot.timestamp
        budgets = memory_budgets(snapshot)
        gpus = [self._gpu_analysis(g, snapshot, budgets) for g in snapshot.gpus]
        trends, leak_findings = self._run("leak", lambda: self._leaks(snapshot), (None, None))
        cfg, history = self.config, self.history
        detectors: list[tuple[str, str, Callable[[], list[Finding]]]] = [
            ("fragmentation", "fragmentation",
             lambda: detect_fragmentation(history, snapshot, cfg.fragmentation)),
            ("contention", "contention",
             lambda: detect_contention(history, snapshot, cfg.contention)),
            ("stale_memory", "stale_memory", lambda: detect_stale(history, snapshot, cfg.stale)),
            ("pressure", "pressure",
             lambda: detect_pressure(snapshot.gpus, gpus, now, cfg.pressure, self._raised("pressure"))),
            ("oom", "oom", lambda: self._ooms(snapshot)),
        ]
        findings = list(leak_findings or [])
        failed = {"leak"} if leak_findings is None else set()
        for name, kind, run in detectors:
            result = self._run(name, run, None)
            if result is None:
                failed.add(kind)
            else:
                findings.extend(result)
        active = self._track(findings, failed, now)
        return Analysis(timestamp=now, findings=active, process_trends=tuple(trends or ()),
                        gpus=tuple(gpus))

    # ------------------------------------------------------------------ internals
    def _raised(self, kind: str) -> frozenset[str]:
        """UUIDs of the GPUs with an active finding of this kind."""
        return frozenset(f.uuid for _, f in self._active.values() if f.kind == kind and f.uuid)

    def _run(self, name: str, fn, on_error):
        """A bug in one detector must not silence the others; it is logged and counted."""
        try:
            return fn()
        except Exception:
            self.detector_errors[name] += 1
            log.exception("detector %s failed", name)
            return on_error

    def _track(self, findings: list[Finding], failed: set[str], now: float) -> tuple[Finding, ...]:
        current: dict[tuple, Finding] = {}
        for f in findings:
            current.setdefault(f.key, f)
        for key, (_, f) in self._active.items():  # a failed detector's findings stay as they were
            if f.kind in failed and key not in current:
                current[key] = f
        active: dict[tuple, tuple[int, Finding]] = {}
        for key, f in current.items():
            if key in self._active:
                episode_id, old = self._active[key]
                f = replace(f, first_detected_at=old.first_detected_at)
                episode = self._episodes.get(episode_id)
                if episode is not None and \
                        _SEVERITY.get(f.severity, 0) >= _SEVERITY.get(episode.finding.severity, 0):
                    episode.finding = f
            else:
                episode_id = self._record(f)
                if self.log_findings:
                    findings_log.warning("finding raised: %s", _describe(f),
                                         extra={"finding": f.to_json()})
            active[key] = (episode_id, f)
        for key, (episode_id, f) in self._active.items():
            if key not in active:
                episode = self._episodes.get(episode_id)
                if episode is not None:
                    episode.cleared_at = now
                if self.log_findings:
                    findings_log.info("finding cleared: %s", _describe(f),
                                      extra={"finding": f.to_json(), "cleared_at": now})
        self._active = active
        return tuple(f for _, f in active.values())

    def _record(self, f: Finding) -> int:
        episode_id = self._next_episode
        self._next_episode += 1
        self._episodes[episode_id] = _Episode(f)
        while len(self._episodes) > self.config.max_recorded_findings:
            self._episodes.popitem(last=False)
            self.dropped_findings += 1
        return episode_id

    def _gpu_analysis(self, gpu: GpuSample, snapshot: Snapshot, budgets) -> GpuAnalysis:
        ratio = memory_ratio(gpu, snapshot.host) if gpu.up else None
        beyond = beyond_budget_bytes(gpu, budgets) if gpu.up else None
        if not gpu.up:
            is_open = False  # a lost GPU takes no work
        else:
            beyond_ratio = beyond / gpu.total_bytes if beyond is not None and gpu.total_bytes else None
            is_open = admission_open(self._admission.get(gpu.uuid), ratio, beyond_ratio,
                                     self.config.admission_close_above,
                                     self.config.admission_open_below,
                                     self.config.pressure.budget_slack_ratio)
        self._admission[gpu.uuid] = is_open
        if len(self._admission) > 4096:  # GPUs come and go rarely; bound it anyway
            self._admission.pop(next(iter(self._admission)))
        return GpuAnalysis(gpu=gpu.index, uuid=gpu.uuid, utilization_ratio=ratio,
                           admission_open=is_open, beyond_budget_bytes=beyond,
                           time_to_full_seconds=self._time_to_full(gpu, snapshot.timestamp),
                           unattributed_bytes=unattributed_bytes(gpu) if gpu.up else None)

    def _time_to_full(self, gpu: GpuSample, now: float) -> float | None:
        """Forecast from the GPU's used trend (bucket medians; start-up steps ignored)."""
        if not gpu.up or gpu.used_bytes is None:
            return None
        return forecast_time_to_full(self.history.gpu_used(gpu.uuid), gpu.total_bytes, now,
                                     window_seconds=self.config.forecast_window_seconds,
                                     config=self.config.leak)

    # -- leak ------------------------------------------------------------------------
    def _leaks(self, snapshot: Snapshot) -> tuple[list[ProcessTrend], list[Finding]]:
        now, cfg = snapshot.timestamp, self.config
        host_total = snapshot.host.total_bytes if snapshot.host else None
        tensor_parallel = _tensor_parallel_endpoints(snapshot)
        rss: dict[tuple, tuple[LeakAssessment, bool]] = {}  # identity -> (assessment, latched)
        trends, findings = [], []
        for gpu in snapshot.gpus:
            for p in gpu.processes:
                mem = assess(self.history.process_memory(gpu.uuid, p.identity),
                             gpu.total_bytes, now, cfg.leak)
                # assess() can pass and fail on consecutive minutes (between staircase steps,
                # under a sawtooth): the latch keeps a raised leak until it stays quiet a while.
                leaking = self._latch.update((gpu.uuid, p.identity), mem.suspected, now)
                if p.host_rss_bytes is not None and p.identity not in rss:
                    a = assess(self.history.process_rss(p.identity), host_total, now, cfg.leak)
                    rss[p.identity] = (a, self._latch.update(("rss", p.identity), a.suspected, now))
                host, host_leaking = rss.get(p.identity, (None, False))
                # Host RSS is the serving process's second leak signal; on unified memory it
                # is GPU memory, so it also counts for the per-GPU verdict there.
                rss_leak = p.role == "vllm" and host_leaking
                trends.append(ProcessTrend(
                    gpu=gpu.index, uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role,
                    growth_bytes_per_second=mem.slope_bytes_per_second,
                    leak_suspected=leaking or (rss_leak and gpu.unified),
                    host_rss_growth_bytes_per_second=host.slope_bytes_per_second if host else None))
                tp = p.endpoint in tensor_parallel
                if leaking:
                    findings.append(self._gpu_leak(gpu, p, mem, now, tp))
                if rss_leak and not any(f.pid == p.pid and f.gpu is None for f in findings):
                    findings.append(self._rss_leak(gpu, p, host, snapshot, tp))
        self._latch.prune(now)
        return trends, findings

    def _severity(self, seconds_to_full: float | None) -> str:
        critical = seconds_to_full is not None and seconds_to_full < self.config.leak_critical_seconds
        return "critical" if critical else "warning"

    def _gpu_leak(self, gpu: GpuSample, p: ProcessSample, a: LeakAssessment, now: float,
                  tp: bool) -> Finding:
        slope = a.slope_bytes_per_second or 0.0
        left = None
        if gpu.total_bytes is not None and gpu.used_bytes is not None and slope > 0:
            left = max(0.0, (gpu.total_bytes - gpu.used_bytes) / slope)
        evidence = [("slope_bytes_per_second", round(slope, 1)),
                    ("used_bytes", p.used_bytes or 0)]
        if gpu.total_bytes is not None:
            evidence.append(("total_bytes", gpu.total_bytes))
        if left is not None:
            evidence.append(("time_to_full_seconds", round(left, 1)))
        evidence += [(k, v) for k, v in a.evidence if k not in dict(evidence)]
        return Finding(
            kind="leak", severity=self._severity(left), first_detected_at=now, gpu=gpu.index,
            uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role, endpoint=p.endpoint,
            summary=(f"{p.name or 'pid ' + str(p.pid)} (pid {p.pid}) GPU {gpu.index} memory grows "
                     f"{slope * 60 / (1 << 20):.1f} MiB/min" + _full_in(left)),
            evidence=tuple(evidence), advice=_leak_advice(p, left, tp, host=False))

    def _rss_leak(self, gpu: GpuSample, p: ProcessSample, a: LeakAssessment, snapshot: Snapshot,
                  tp: bool) -> Finding:
        slope = a.slope_bytes_per_second or 0.0
        host = snapshot.host
        left = host.available_bytes / slope if host is not None and slope > 0 else None
        evidence = [("slope_bytes_per_second", round(slope, 1)),
                    ("host_rss_bytes", p.host_rss_bytes or 0)]
        if host is not None:
            evidence.append(("host_available_bytes", host.available_bytes))
        if left is not None:
            evidence.append(("time_to_full_seconds", round(left, 1)))
        evidence.append(("unified_memory", int(gpu.unified)))
        evidence += [(k, v) for k, v in a.evidence if k not in dict(evidence)]
        where = " (unified memory: this is GPU memory)" if gpu.unified else ""
        return Finding(
            kind="leak", severity=self._severity(left), first_detected_at=snapshot.timestamp,
            gpu=None, uuid="", pid=p.pid, process=p.name, role=p.role, endpoint=p.endpoint,
            summary=(f"{p.name or 'pid ' + str(p.pid)} (pid {p.pid}) host memory grows "
                     f"{slope * 60 / (1 << 20):.1f} MiB/min{where}" + _full_in(left)),
            evidence=tuple(evidence), advice=_leak_advice(p, left, tp, host=True))

    # -- oom -------------------------------------------------------------------------
    def _ooms(self, snapshot: Snapshot) -> list[Finding]:
        """Every OOM event from the logs becomes a finding (one per GPU, events counted)."""
        per_gpu: dict[str | None, list[OomEvent]] = {}
        for _, event in recent_events(self.history, snapshot, self.config.oom_hold_seconds):
            per_gpu.setdefault(event.gpu, []).append(event)
        uuids = {g.index: g.uuid for g in snapshot.gpus}
        findings = []
        for gpu_index, events in per_gpu.items():
            last = events[-1]
            evidence: list[tuple[str, float | int | str]] = [
                ("events", len(events)), ("oom_kind", last.kind), ("class", last.klass),
                ("log", f"{last.source}:{last.line}")]
            for name in ("requested_bytes", "free_bytes", "total_bytes", "reserved_bytes",
                         "reserved_unallocated_bytes", "process_bytes"):
                if getattr(last, name) is not None:
                    evidence.append((name, getattr(last, name)))
            advice = tuple(dict.fromkeys(a for e in events for a in e.advice))[:8]
            where = f"GPU {gpu_index}" if gpu_index is not None else "host"
            findings.append(Finding(
                kind="oom", severity="critical", first_detected_at=snapshot.timestamp,
                gpu=gpu_index, uuid=uuids.get(gpu_index, "") if gpu_index is not None else "",
                summary=(f"{where}: {len(events)} out-of-memory event(s) in the logs, last "
                         f"{last.kind} ({last.klass}) at {last.source}:{last.line}"),
                evidence=tuple(evidence),
                advice=advice or ("Run `gpu-memory-exporter explain` on the log for details.",)))
        return findings


def _tensor_parallel_endpoints(snapshot: Snapshot) -> set[str]:
    gpus: dict[str, set[str]] = {}
    for b in memory_budgets(snapshot):
        gpus.setdefault(b.endpoint, set()).add(b.gpu)
    return {endpoint for endpoint, g in gpus.items() if len(g) > 1}


def _full_in(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"; full in about {seconds / 3600:.1f} h at this rate" if seconds >= 3600 \
        else f"; full in about {seconds / 60:.0f} min at this rate"


def _leak_advice(p: ProcessSample, left: float | None, tp: bool, host: bool) -> tuple[str, ...]:
    advice = []
    if p.role == "vllm":
        if tp:
            advice.append("Tensor parallelism: set NCCL_CUMEM_ENABLE=0 in the server's "
                          "environment (NCCL's cuMem allocations have leaked in several "
                          "NCCL/vLLM versions).")
        if host:
            advice.append("Host memory of the server grows: check multimodal/processor caches "
                          "and the CPU KV offload or swap space settings; on unified memory "
                          "this takes GPU memory directly.")
        advice += [
            "Check CUDA graph capture sizes (--cuda-graph-sizes / compilation_config "
            "cudagraph_capture_sizes): growth with new batch shapes points at graph capture; "
            "--enforce-eager confirms it.",
            "If sleep mode is on (--enable-sleep-mode), check that each sleep/wake cycle "
            "gives the memory back.",
            "Upgrade vLLM, PyTorch and NCCL: several leaks were fixed in recent releases.",
        ]
    else:
        advice.append("Profile the process (torch.cuda.memory_summary(), "
                      "torch.cuda.memory._record_memory_history) for tensors kept alive.")
    if left is not None:
        advice.append(f"At this rate memory runs out in about {left / 3600:.1f} h: plan a "
                      "restart of the process before then.")
    return tuple(advice)


def _describe(f: Finding) -> str:
    """One log line: kind, severity, where, summary; control characters from process names
    and log files are escaped so a finding cannot forge log lines."""
    where = " ".join(x for x in (
        f"gpu={f.gpu}" if f.gpu is not None else "",
        f"pid={f.pid}" if f.pid is not None else "",
        f"endpoint={f.endpoint}" if f.endpoint else "") if x)
    return sanitize(f"{f.kind} [{f.severity}] {where}: {f.summary}")


def sanitize(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
