"""OOM findings: every out-of-memory event read from the logs becomes a critical finding, one
per GPU (host-level events under gpu None), held for `hold_seconds` after the last event so
an alert has time to fire. The events are classified and advised where they are parsed; this
only gathers them per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Finding, OomEvent, Snapshot
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History, recent_events


@dataclass(frozen=True)
class OomConfig:
    hold_seconds: float = 300.0  # a finding stays active this long after the last event

    def __post_init__(self) -> None:
        if self.hold_seconds < 0:
            raise ValueError("oom: hold_seconds must not be negative")


def detect_ooms(history: History, snapshot: Snapshot, hold_seconds: float) -> list[Finding]:
    per_gpu: dict[str | None, list[OomEvent]] = {}
    for _, event in recent_events(history, snapshot, hold_seconds):
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


def _detect(tick: Tick, config: OomConfig) -> list[Finding]:
    return detect_ooms(tick.history, tick.snapshot, config.hold_seconds)


DETECTOR = DetectorSpec(
    name="oom", config=OomConfig, create=lambda: _detect,
    help="Out-of-memory events read from the watched logs, classified (docs/oom-diagnosis.md).",
    history_needed={"hold_seconds": 1},
    kinds=(FindingKind(
        "oom", scenario="oom",
        help="out-of-memory events read from the logs in the last few minutes, per GPU",
        alert=FindingAlert(
            "GpuOutOfMemoryEvent", severity="ticket", for_="0s",
            comment=("A fact read from a log, no threshold: it fires at once, and the finding holds "
                     "(detectors.oom.hold_seconds) long enough for the rule to see it."),
            summary=("Out-of-memory in the logs watched on {{ $labels.instance }}{{ with $labels.gpu }} (GPU "
                     "{{ . }}){{ end }}."),
            description=(
                "The exporter on {{ $labels.instance }} found out-of-memory events in the logs it watches"
                "{{ with $labels.gpu }} for GPU {{ . }}{{ end }} in the last few minutes (counted so far, by "
                'kind and class:{{ range printf "gpumem_oom_events_total{instance=%q} > 0" $labels.instance '
                '| query }} {{ .Labels.kind }}/{{ .Labels.class }} {{ .Value | printf "%.0f" }};{{ end }}). '
                "Run `gpu-memory-exporter explain <log>` on the server's log for the requested, free and "
                "reserved bytes and the advice for its class. If the server died, VllmEndpointDown follows.")
        )),),
    settings={"hold_seconds": ("An out-of-memory finding stays active this long after the last event, so an "
                              "alert sees it.")})
