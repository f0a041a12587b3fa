"""The one detector interface, and what each detector declares about itself.

A detector is called once per sampling tick as `detector(tick, config) -> findings`: `tick` holds
everything the engine decided once for that tick (snapshot, history, budgets, KV caches, GPU
verdicts, the findings active before it), `config` is the detector's own section of the
configuration. A detector that keeps state from tick to tick (leak) is an object with the same
call; the engine creates one per Analyzer.

Each detector is registered once (registry.py) with a DetectorSpec that declares:
- its name: the section `detectors.<name>` of the configuration file, and the `kind` label its
  failures are counted under (gpumem_exporter_errors_total{source="analysis"});
- its config type (a frozen dataclass that checks itself in __post_init__) and the keys of it
  the configuration file may set, each with its meaning (docs/configuration.md);
- how much raw history it looks back, so a history too short for it is a configuration error;
- its finding kinds, and for each the alert that fires on it (docs/runbooks/<alert>.md is the
  runbook) and the built-in scenario that shows it.

The alert rules and the runbook index (with the list of finding kinds) are generated from these
declarations (alerts/generate.py), so adding a detector edits no engine code and no rule file.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

from ..model import NEUTRAL_TOOLS, Budget, Finding, GpuAnalysis, GpuTools, KvCache, ProcessTrend, Snapshot
from .history import History

C = TypeVar("C")
C_contra = TypeVar("C_contra", contravariant=True)


@dataclass(frozen=True)
class Tick:
    """One sampling tick, as every detector sees it. Everything here is computed once by the
    engine before the detectors run; detectors only read it."""

    snapshot: Snapshot
    history: History  # already holds this tick's snapshot
    budgets: tuple[Budget, ...]  # the vLLM servers' memory budgets (analysis.budget)
    kv_caches: tuple[KvCache, ...]  # capacity and use of each engine's KV cache (analysis.kv_cache)
    gpus: tuple[GpuAnalysis, ...]  # per-GPU verdicts: utilisation, beyond budget, admission, ...
    active: tuple[Finding, ...] = ()  # the findings active after the tick before this one
    gpu_tools: GpuTools = NEUTRAL_TOOLS  # the GPU backend's tools, for advice (vendor-neutral words without)

    @property
    def now(self) -> float:
        return self.snapshot.timestamp


class Detector(Protocol[C_contra]):
    """Findings for one tick. Pure but for the detector's own state; no I/O, no wall clock."""

    def __call__(self, tick: Tick, config: C_contra, /) -> Sequence[Finding]: ...


@runtime_checkable
class ReportsTrends(Protocol):
    """A detector that also publishes per-process trends (gpumem_process_memory_growth_*,
    gpumem_leak_suspected) for the tick it last judged."""

    @property
    def process_trends(self) -> tuple[ProcessTrend, ...]: ...


Routing = Literal["page", "ticket"]


@dataclass(frozen=True)
class FindingAlert:
    """The alert that fires while a finding of the kind is active:
    `max without (severity) (gpumem_finding_active{kind="<kind>"}) == 1` held for `for_`.
    `summary` and `description` are Prometheus alert templates ($labels: instance, job, kind,
    and the finding's gpu, pid, process, role, endpoint where it has them)."""

    name: str  # also the runbook: docs/runbooks/<name>.md
    severity: Routing
    for_: str  # a Prometheus duration; "0s": fire at the first evaluation that sees it
    summary: str
    description: str
    comment: str = ""  # why it is built this way, written above the rule


@dataclass(frozen=True)
class FindingKind:
    name: str  # Finding.kind
    help: str  # one line for the finding kinds' table in docs/runbooks/README.md
    scenario: str  # the built-in scenario that shows it (exporter/sim/scenarios/<scenario>.yaml)
    alert: FindingAlert | None = None  # fires from the finding ...
    # ... or, for a kind whose condition a rule over the raw series judges with the same
    # thresholds (exporter/thresholds.py), the names of those alerts (pressure: the 85 % page).
    raw_alerts: tuple[str, ...] = ()
    # Held by the engine for a while after its detector stops reporting it (engine.CLEAR_AFTER_*),
    # so a condition at a threshold is one finding. False for a plain fact that a raw rule
    # alerts on as well (a GPU that answers again is back, for the finding as for its alert).
    clear_hold: bool = True

    @property
    def alerts(self) -> tuple[str, ...]:
        return (self.alert.name,) if self.alert is not None else self.raw_alerts


@dataclass(frozen=True)
class DetectorSpec(Generic[C]):
    """What the engine, the configuration and the alert generator know about one detector."""

    name: str
    help: str  # the configuration section's description
    config: type[C]
    create: Callable[[], Detector[C]]  # a fresh detector, for each Analyzer
    kinds: tuple[FindingKind, ...]
    # The keys of `config` the configuration file may set, and what each means. Keys left out
    # keep the dataclass's default (statistical constants nobody should need to tune).
    settings: Mapping[str, str] = field(default_factory=dict)
    # Raw history it looks back, as multiples of its settings: {"window_seconds": 2} needs
    # 2 x window_seconds of history.raw_seconds.
    history_needed: Mapping[str, float] = field(default_factory=dict)

    def history_needs(self, config: C) -> list[tuple[str, float, float]]:
        """(key, factor, seconds) for each look back: factor x the key's value is needed."""
        return [(key, factor, factor * float(getattr(config, key))) for key, factor in self.history_needed.items()]

    def __post_init__(self) -> None:
        if not self.kinds:
            raise ValueError(f"detector {self.name}: declares no finding kind")
        if not all(k.alert is not None or k.raw_alerts for k in self.kinds):
            raise ValueError(f"detector {self.name}: every finding kind needs an alert")
