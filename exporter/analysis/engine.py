"""The analysis engine: one `Analyzer.update(snapshot)` per sampling tick.

A tick: compute the memory budgets once, feed the History, give the per-GPU verdicts, run every
detector (pure functions over history + snapshot; leak and admission keep a little state of
their own), then track episodes: the active findings are keyed by `Finding.key`, so a finding
keeps its first_detected_at while it stays active and is logged once when raised (WARNING) and
once when cleared (INFO) on the "exporter.findings" logger. The Analysis it returns carries
everything downstream needs (findings, trends, GPU verdicts, budgets, the tick's transitions),
so nothing after it recomputes any of it.

Time comes only from snapshot timestamps, never the wall clock, so a replay of a recorded trace
raises the same findings at the same moments as the live daemon did.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from ..model import Analysis, Finding, OomEvent, Snapshot
from .budget import memory_budgets
from .contention import ContentionConfig, detect_contention
from .fragmentation import FragmentationConfig, detect_fragmentation
from .gpu_verdicts import GpuVerdicts, detect_unavailable
from .history import History
from .kv_cache import KvSaturationConfig, detect_kv_saturation, kv_caches
from .leak import LeakConfig
from .leak_detector import LeakDetector
from .oom import classify
from .oom_findings import detect_ooms
from .pressure import PressureConfig, detect_pressure
from .sleep import SleepConfig, detect_sleep_leaks
from .stale import StaleConfig, detect_stale
from .transitions import transitions

findings_log = logging.getLogger("exporter.findings")
log = logging.getLogger(__name__)

_SEVERITY = {"info": 0, "warning": 1, "critical": 2}

_T = TypeVar("_T")
# Finding.key: (kind, gpu, pid, endpoint)
FindingKey = tuple[object, ...]


@dataclass(frozen=True)
class AnalysisConfig:
    admission_close_above: float = 0.90  # admission closes above this utilisation ...
    admission_open_below: float = 0.80  # ... and reopens only below this one
    history_raw_seconds: float = 3600.0
    history_retention_seconds: float = 6 * 3600.0
    history_dead_grace_seconds: float = 900.0
    history_max_raw_samples: int = 4096  # raw points per series (and snapshots) at most
    forecast_window_seconds: float = 3600.0  # GPU used trend window for time-to-full
    leak_critical_seconds: float = 3600.0  # a leak that fills the GPU sooner is critical
    oom_hold_seconds: float = 300.0  # an OOM finding stays active this long after the event
    max_recorded_findings: int = 10_000  # all_findings keeps at most this many (oldest go)
    leak: LeakConfig = field(default_factory=LeakConfig)
    pressure: PressureConfig = field(default_factory=PressureConfig)
    stale: StaleConfig = field(default_factory=StaleConfig)
    contention: ContentionConfig = field(default_factory=ContentionConfig)
    fragmentation: FragmentationConfig = field(default_factory=FragmentationConfig)
    sleep: SleepConfig = field(default_factory=SleepConfig)  # looks back as far as the history holds
    kv_saturation: KvSaturationConfig = field(default_factory=KvSaturationConfig)

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
            "fragmentation.inactive_split_sustain_seconds":
                self.fragmentation.inactive_split_sustain_seconds,
            "oom_hold_seconds": self.oom_hold_seconds,
            "2 x kv_saturation.window_seconds": 2 * self.kv_saturation.window_seconds,
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
                               dead_grace_seconds=self.config.history_dead_grace_seconds,
                               max_raw_samples=self.config.history_max_raw_samples)
        self.log_findings = log_findings
        self.detector_errors: Counter[str] = Counter()  # detector -> exceptions caught
        self.dropped_findings = 0  # episodes evicted from all_findings by the size bound
        self._active: dict[FindingKey, tuple[int, Finding]] = {}  # key -> (episode id, finding)
        self._episodes: OrderedDict[int, _Episode] = OrderedDict()
        self._next_episode = 0
        self._gpus = GpuVerdicts()
        self._leak = LeakDetector()
        self._previous: Snapshot | None = None

    # ------------------------------------------------------------------ public
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
                              history_dead_grace_seconds=self.config.history_dead_grace_seconds,
                              history_max_raw_samples=self.config.history_max_raw_samples)

    def update(self, snapshot: Snapshot) -> Analysis:
        # OOM messages arrive parsed; from here on every detector sees them classified (an event
        # classified before, e.g. by `explain` for a replay, keeps its verdict).
        events = tuple(m if isinstance(m, OomEvent) else classify(m) for m in snapshot.log_events)
        snapshot = replace(snapshot, log_events=events)
        now, cfg, history = snapshot.timestamp, self.config, self.history
        budgets = memory_budgets(snapshot)
        kv = kv_caches(snapshot)
        history.update(snapshot, budgets)
        gpus = self._gpus.update(snapshot, budgets, history, cfg.admission_close_above,
                                 cfg.admission_open_below, cfg.pressure.budget_slack_ratio,
                                 cfg.forecast_window_seconds, cfg.leak)
        raised = frozenset(f.uuid for _, f in self._active.values() if f.kind == "pressure" and f.uuid)
        leak = self._run("leak", lambda: self._leak.detect(history, snapshot, budgets, cfg.leak,
                                                          cfg.leak_critical_seconds))
        detectors: list[tuple[str, Callable[[], list[Finding]]]] = [  # name = the findings' kind
            ("fragmentation", lambda: detect_fragmentation(history, snapshot, cfg.fragmentation, budgets)),
            ("contention", lambda: detect_contention(history, snapshot, cfg.contention)),
            ("stale_memory", lambda: detect_stale(history, snapshot, cfg.stale)),
            ("pressure", lambda: detect_pressure(snapshot.gpus, list(gpus), now, cfg.pressure, raised,
                                                 snapshot.host_processes)),
            ("oom", lambda: detect_ooms(history, snapshot, cfg.oom_hold_seconds)),
            ("sleep_leak", lambda: detect_sleep_leaks(history, snapshot, cfg.sleep)),
            ("kv_saturation", lambda: detect_kv_saturation(history, snapshot, cfg.kv_saturation, kv)),
            ("gpu_unavailable", lambda: detect_unavailable(snapshot)),
        ]
        findings = list(leak.findings) if leak is not None else []
        failed = set() if leak is not None else {"leak"}
        for kind, run in detectors:
            found = self._run(kind, run)
            if found is None:
                failed.add(kind)
            else:
                findings.extend(found)
        before = tuple(f for _, f in self._active.values())
        active = self._track(findings, failed, now)
        changed = transitions(self._previous, snapshot, before, active)
        self._previous = snapshot
        return Analysis(timestamp=now, findings=active, gpus=gpus, budgets=budgets, kv_caches=kv,
                        process_trends=leak.trends if leak is not None else (),
                        transitions=changed, oom_events=events)

    # ------------------------------------------------------------------ internals
    def _run(self, name: str, fn: Callable[[], _T]) -> _T | None:
        """A bug in one detector must not silence the others; it is logged and counted, and
        None returned."""
        try:
            return fn()
        except Exception:
            self.detector_errors[name] += 1
            log.exception("detector %s failed", name)
            return None

    def _track(self, findings: list[Finding], failed: set[str], now: float) -> tuple[Finding, ...]:
        current: dict[FindingKey, Finding] = {}
        for f in findings:
            current.setdefault(f.key, f)
        for key, (_, f) in self._active.items():  # a failed detector's findings stay as they were
            if f.kind in failed and key not in current:
                current[key] = f
        active: dict[FindingKey, tuple[int, Finding]] = {}
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
