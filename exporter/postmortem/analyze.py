"""Offline replay: recorded samples through the live detectors, in time order.

`replay` feeds snapshots one by one to a fresh Analyzer, exactly as the daemon does, so each
finding's first_detected_at is the snapshot time at which the live daemon would have raised
it (causal: nothing later in the trace is looked at). `analyze` reads trace files and prints
the result as text or as the JSON of DESIGN.md (`{"findings": [...]}`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from ..analysis.engine import AnalysisConfig, Analyzer, sanitize
from ..model import Finding, OomEvent, Snapshot
from .trace import read_traces


def replay_episodes(snapshots: Iterable[Snapshot], config: AnalysisConfig | None = None
                    ) -> tuple[list[tuple[Finding, float | None]], Analyzer]:
    """(finding, cleared_at) pairs in the order raised, and the analyzer (for its counters)."""
    analyzer = Analyzer(config, log_findings=False)
    for snap in sorted(snapshots, key=lambda s: s.timestamp):
        analyzer.update(snap)
    return analyzer.episodes(), analyzer


def replay(snapshots: Iterable[Snapshot], config: AnalysisConfig | None = None) -> list[Finding]:
    """Every finding the live daemon would have raised over these snapshots, in time order."""
    episodes, _ = replay_episodes(snapshots, config)
    return [f for f, _ in episodes]


def analyze(paths: list[str], fmt: str = "text", config: AnalysisConfig | None = None) -> str:
    """Read trace files (CSV or Prometheus range-query JSON), replay them, render the result.

    Raises trace.TraceError for unreadable input and ValueError for an unknown format."""
    return analyze_snapshots(read_traces(paths), fmt, config)


def analyze_snapshots(snapshots: list[Snapshot], fmt: str = "text", config: AnalysisConfig | None = None,
                      report_path: str | None = None, oom_events: Iterable[OomEvent] = ()) -> str:
    """Replay `snapshots` and render the findings as `fmt`; with `report_path`, also write the
    HTML incident report there (OSError when it cannot be written)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown format {fmt!r} (text or json)")
    episodes, analyzer = replay_episodes(snapshots, config)
    if report_path:
        from .report import write_report

        write_report(snapshots, episodes, list(oom_events), report_path)
    if fmt == "json":
        return render_json(snapshots, episodes, analyzer) + "\n"
    return render_text(snapshots, episodes, analyzer)


def _trace_summary(snapshots: list[Snapshot], analyzer: Analyzer) -> dict[str, Any]:
    gpus = sorted({g.index for s in snapshots for g in s.gpus})
    return {
        "samples": len(snapshots),
        "start": snapshots[0].timestamp if snapshots else None,
        "end": snapshots[-1].timestamp if snapshots else None,
        "gpus": gpus,
        "findings_dropped": analyzer.dropped_findings,
    }


def render_json(snapshots: list[Snapshot], episodes: list[tuple[Finding, float | None]],
                analyzer: Analyzer) -> str:
    findings = []
    for finding, cleared_at in episodes:
        item = finding.to_json()
        item["cleared_at"] = cleared_at
        findings.append(item)
    return json.dumps({"findings": findings, "trace": _trace_summary(snapshots, analyzer)},
                      indent=2)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _span(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def render_text(snapshots: list[Snapshot], episodes: list[tuple[Finding, float | None]],
                analyzer: Analyzer) -> str:
    if not snapshots:
        return "The trace holds no samples.\n"
    start, end = snapshots[0].timestamp, snapshots[-1].timestamp
    gpus = sorted({g.index for s in snapshots for g in s.gpus})
    lines = [f"Replayed {len(snapshots)} samples of {len(gpus)} GPU(s) from {_when(start)} to "
             f"{_when(end)} ({_span(end - start)})."]
    if analyzer.dropped_findings:
        lines.append(f"({analyzer.dropped_findings} early findings were dropped: too many to keep.)")
    if not episodes:
        lines.append("No findings.")
        return "\n".join(lines) + "\n"
    lines.append(f"{len(episodes)} finding(s):")
    for f, cleared_at in episodes:
        where = ", ".join(x for x in (
            f"GPU {f.gpu}" if f.gpu is not None else "",
            f"pid {f.pid}" + (f" ({f.process})" if f.process else "") if f.pid is not None else "",
            f.endpoint) if x)
        until = (f", cleared {_when(cleared_at)}" if cleared_at is not None
                 else ", still active at the end")
        lines += ["",
                  sanitize(f"[{f.severity}] {f.kind}" + (f" - {where}" if where else "")),
                  f"  first detected {_when(f.first_detected_at)} "
                  f"(+{_span(f.first_detected_at - start)}){until}",
                  "  " + sanitize(f.summary)]
        if f.evidence:
            lines.append("  evidence: " + sanitize(", ".join(f"{k}={v}" for k, v in f.evidence)))
        for advice in f.advice:
            lines.append("  - " + sanitize(advice))
    return "\n".join(lines) + "\n"
