"""OOM findings: every out-of-memory event read from the logs becomes a critical finding, one
per GPU (host-level events under gpu None), held for `hold_seconds` after the last event so
an alert has time to fire. The events are classified and advised where they are parsed; this
only gathers them per GPU.
"""
from __future__ import annotations

from ..model import Finding, OomEvent, Snapshot
from .history import History, recent_events


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
