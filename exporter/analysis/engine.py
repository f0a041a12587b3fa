"""The analysis engine: one `Analyzer.update(snapshot)` per sampling tick.

A tick: compute the memory budgets and KV caches once, feed the History, give the per-GPU
verdicts, run every registered detector (analysis.registry) over the same Tick, then track
episodes: the active findings are keyed by `Finding.key`, so a finding keeps its
first_detected_at while it stays active and is logged once when raised (WARNING), once at each
change of severity (escalated: WARNING, de-escalated: INFO) and once when cleared (INFO) on the
"exporter.findings" logger; cleared once its detector has stopped reporting it for a while
(CLEAR_AFTER_SECONDS), so a condition at a threshold is one finding. The Analysis it returns carries everything
downstream needs (findings, trends, GPU verdicts, budgets, the tick's transitions), so nothing
after it recomputes any of it.

Time comes only from snapshot timestamps, never the wall clock, so a replay of a recorded trace
raises the same findings at the same moments as the live daemon did.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from .. import thresholds
from ..model import (
    NEUTRAL_TOOLS,
    RECENT_OOM_SECONDS,
    Analysis,
    Episode,
    Finding,
    GpuTools,
    OomEvent,
    ProcessTrend,
    Snapshot,
)
from . import leak_detector, pressure
from .budget import memory_budgets
from .detector import DetectorSpec, ReportsTrends, Tick
from .gpu_verdicts import GpuVerdicts
from .history import History
from .kv_cache import kv_caches
from .oom import classify
from .registry import DETECTORS
from .transitions import transitions

findings_log = logging.getLogger("exporter.findings")
log = logging.getLogger(__name__)

_SEVERITY = {"info": 0, "warning": 1, "critical": 2}
# A finding its detector stops reporting is cleared only once it has been absent for this long
# and this many ticks: a condition hovering at a threshold (memory PSI, a saw-tooth, a window with
# too few samples while sampling falls behind) keeps one finding instead of raising and clearing
# it every other tick, which would restart every alert's `for:`. Not for a finding about one
# process (its detector keeps its own latch, and a reused PID must not inherit it), nor for a kind
# declared without the hold (FindingKind.clear_hold).
CLEAR_AFTER_SECONDS = 30.0
CLEAR_AFTER_TICKS = 2
MAX_RECENT_OOMS = 16  # oom episodes the status page can list (within RECENT_OOM_SECONDS)

C = TypeVar("C")
# Finding.key: (kind, gpu, pid, endpoint)
FindingKey = tuple[object, ...]


@dataclass(frozen=True)
class AnalysisConfig:
    admission_close_above: float = thresholds.ADMISSION_CLOSE_ABOVE  # admission closes above this ...
    admission_open_below: float = thresholds.ADMISSION_OPEN_BELOW  # ... and reopens only below this
    history_raw_seconds: float = 3600.0
    history_retention_seconds: float = 6 * 3600.0
    history_dead_grace_seconds: float = 900.0
    history_max_raw_samples: int = 4096  # raw points per series (and snapshots) at most
    forecast_window_seconds: float = 3600.0  # GPU used trend window for time-to-full
    max_recorded_findings: int = 10_000  # all_findings keeps at most this many (oldest go)
    # The GPU backend's tools that advice names (sources/gpu.py); vendor-neutral words without one.
    gpu_tools: GpuTools = NEUTRAL_TOOLS
    # Each registered detector's settings, by its name (DetectorSpec.name); one left out runs
    # with its config's defaults. After construction every registered detector is present.
    detectors: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.admission_open_below <= self.admission_close_above <= 1:
            raise ValueError("analysis: need 0 < admission_open_below <= admission_close_above <= 1")
        if self.max_recorded_findings < 1 or self.forecast_window_seconds <= 0:
            raise ValueError("analysis: max_recorded_findings >= 1, forecast_window_seconds > 0")
        known = {spec.name: spec for spec in DETECTORS}
        unknown = sorted(set(self.detectors) - set(known))
        if unknown:
            raise ValueError(f"analysis: no detector named {', '.join(unknown)}")
        sections = {}
        for name, spec in known.items():
            section = self.detectors.get(name)
            if section is None:
                section = spec.config()
            elif not isinstance(section, spec.config):
                raise ValueError(f"analysis: detectors[{name!r}] must be a {spec.config.__name__}")
            sections[name] = section
            # Detectors look back through raw snapshots; the history must keep them that long.
            for key, factor, seconds in spec.history_needs(section):
                if seconds > self.history_raw_seconds:
                    times = f"{factor:g} x " if factor != 1 else ""
                    raise ValueError(f"analysis: history_raw_seconds ({self.history_raw_seconds:g}) "
                                     f"must cover {times}{name}.{key} ({seconds:g})")
        object.__setattr__(self, "detectors", sections)

    def section(self, spec: DetectorSpec[C]) -> C:
        """The settings of one detector (its config's defaults where it is not registered)."""
        section = self.detectors.get(spec.name)
        return cast(C, section) if section is not None else spec.config()


class Analyzer:
    def __init__(self, config: AnalysisConfig | None = None, log_findings: bool = True,
                 detectors: Sequence[DetectorSpec[Any]] = DETECTORS):
        self.config = config or AnalysisConfig()
        self.history = History(raw_seconds=self.config.history_raw_seconds,
                               retention_seconds=self.config.history_retention_seconds,
                               dead_grace_seconds=self.config.history_dead_grace_seconds,
                               max_raw_samples=self.config.history_max_raw_samples)
        self.log_findings = log_findings
        self.detector_errors: Counter[str] = Counter()  # detector -> exceptions caught
        self.dropped_findings = 0  # episodes evicted from all_findings by the size bound
        self._active: dict[FindingKey, tuple[int, Finding]] = {}  # key -> (episode id, finding)
        self._absent: dict[FindingKey, tuple[float, int]] = {}  # active, not reported: (since, ticks)
        self._episodes: OrderedDict[int, Episode] = OrderedDict()
        self._next_episode = 0
        self._oom_episodes: deque[int] = deque(maxlen=MAX_RECENT_OOMS)  # the latest oom episodes' ids
        self._gpus = GpuVerdicts()
        self._detectors = [(spec, spec.create()) for spec in detectors]  # stateful ones keep theirs
        self._unheld = {k.name for spec in detectors for k in spec.kinds if not k.clear_hold}
        self._previous: Snapshot | None = None

    # ------------------------------------------------------------------ public
    @property
    def all_findings(self) -> tuple[Finding, ...]:
        """Every finding raised (bounded), in the order raised, each in its worst version."""
        return tuple(e.finding for e in self._episodes.values())

    def episodes(self) -> list[tuple[Finding, float | None]]:
        """(finding, cleared_at) for every recorded finding; cleared_at None while active."""
        return [(e.finding, e.cleared_at) for e in self._episodes.values()]

    def records(self) -> list[Episode]:
        """Every recorded finding's episode in full (copies), in the order raised: what it said
        when raised, its worst (then latest) version and when that was reported."""
        return [replace(e) for e in self._episodes.values()]

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
                                 cfg.admission_open_below, cfg.section(pressure.DETECTOR).budget_slack_ratio,
                                 cfg.forecast_window_seconds, cfg.section(leak_detector.DETECTOR))
        before = tuple(f for _, f in self._active.values())
        tick = Tick(snapshot=snapshot, history=history, budgets=budgets, kv_caches=kv, gpus=gpus,
                    active=before, gpu_tools=cfg.gpu_tools)
        findings: list[Finding] = []
        trends: list[ProcessTrend] = []
        failed: set[str] = set()  # kinds of the detectors that failed this tick
        for spec, detector in self._detectors:
            found = self._run(spec.name, detector, tick, cfg.section(spec))
            if found is None:
                failed.update(k.name for k in spec.kinds)
                continue
            findings.extend(found)
            if isinstance(detector, ReportsTrends):
                trends.extend(detector.process_trends)
        active = self._track(findings, failed, now)
        changed = transitions(self._previous, snapshot, before, active)
        self._previous = snapshot
        return Analysis(timestamp=now, findings=active, gpus=gpus, budgets=budgets, kv_caches=kv,
                        process_trends=tuple(trends), transitions=changed, oom_events=events,
                        recent_ooms=self._recent_ooms(now))

    # ------------------------------------------------------------------ internals
    def _run(self, name: str, detector: Callable[[Tick, Any], Sequence[Finding]], tick: Tick,
             config: Any) -> Sequence[Finding] | None:
        """A bug in one detector must not silence the others; it is logged and counted, and
        None returned."""
        try:
            return detector(tick, config)
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
                if episode is None:
                    pass  # evicted by the size bound
                elif _SEVERITY.get(f.severity, 0) >= _SEVERITY.get(episode.finding.severity, 0):
                    episode.finding, episode.reported_at = f, now  # its worst, then newest, version
                    episode.eased = episode.eased_at = None
                else:
                    episode.eased, episode.eased_at = f, now
                if self.log_findings and f.severity != old.severity:
                    self._log_severity_change(old, f)
            else:
                episode_id = self._record(f, now)
                if self.log_findings:
                    findings_log.warning("finding raised: %s", _describe(f),
                                         extra={"finding": f.to_json()})
            active[key] = (episode_id, f)
        for key, (episode_id, f) in self._active.items():
            if key in active:
                self._absent.pop(key, None)
                continue
            since, ticks = self._absent.get(key, (now, 0))
            held = f.pid is None and f.kind not in self._unheld
            if held and (now - since < CLEAR_AFTER_SECONDS or ticks + 1 < CLEAR_AFTER_TICKS):
                self._absent[key] = (since, ticks + 1)
                active[key] = (episode_id, f)  # held as it was last reported
                continue
            self._absent.pop(key, None)
            episode = self._episodes.get(episode_id)
            if episode is not None:
                episode.cleared_at = now
            if self.log_findings:
                findings_log.info("finding cleared: %s (as last reported; its condition gone for %.0f s)",
                                  _describe(f), now - since, extra={"finding": f.to_json(), "cleared_at": now})
        self._active = active
        return tuple(f for _, f in active.values())

    @staticmethod
    def _log_severity_change(old: Finding, new: Finding) -> None:
        """Once per change: worse is a WARNING (on-call should look again), better an INFO."""
        worse = _SEVERITY.get(new.severity, 0) > _SEVERITY.get(old.severity, 0)
        findings_log.log(logging.WARNING if worse else logging.INFO,
                         "finding %s: %s", "escalated" if worse else "de-escalated",
                         _describe(new, f"{old.severity} -> {new.severity}"), extra={"finding": new.to_json()})

    def _recent_ooms(self, now: float) -> tuple[tuple[Finding, float | None], ...]:
        """The oom findings raised within RECENT_OOM_SECONDS, newest first, with when each cleared:
        the finding holds a few minutes, a person opening the status page later still sees it."""
        out = []
        for episode_id in reversed(self._oom_episodes):
            episode = self._episodes.get(episode_id)
            if episode is not None and now - episode.finding.first_detected_at <= RECENT_OOM_SECONDS:
                out.append((episode.finding, episode.cleared_at))
        return tuple(out)

    def _record(self, f: Finding, now: float) -> int:
        episode_id = self._next_episode
        self._next_episode += 1
        self._episodes[episode_id] = Episode(f, f, now)
        if f.kind == "oom":
            self._oom_episodes.append(episode_id)
        while len(self._episodes) > self.config.max_recorded_findings:
            self._episodes.popitem(last=False)
            self.dropped_findings += 1
        return episode_id


def _describe(f: Finding, severity: str = "") -> str:
    """One log line: kind, severity, where, summary; control characters from process names
    and log files are escaped so a finding cannot forge log lines."""
    where = " ".join(x for x in (
        f"gpu={f.gpu}" if f.gpu is not None else "",
        f"pid={f.pid}" if f.pid is not None else "",
        f"endpoint={f.endpoint}" if f.endpoint else "") if x)
    return sanitize(f"{f.kind} [{severity or f.severity}] {where}: {f.summary}")


def sanitize(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
