"""Offline replay: recorded samples through the live detectors, in time order.

`replay` feeds snapshots one by one to a fresh Analyzer, exactly as the daemon does, so each
finding's first_detected_at is the snapshot time at which the live daemon would have raised
it (causal: nothing later in the trace is looked at). `analyze` reads trace files and prints
the result as text or as JSON (`{"findings": [...]}`, described in README.md), with the flight
recorder's triggers where the trace marks them, the host and run that recorded it, its vLLM
servers' settings changes, and the out-of-memory events of the trace and of the `--log` files
(each with its class and time; those outside the trace's time are said to be).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from ..analysis.engine import AnalysisConfig, Analyzer, sanitize
from ..analysis.oom import classify
from ..model import Finding, OomEvent, Snapshot
from ..units import counted, format_bytes, format_time
from .report import dropped_text, eased_text, outside_text, said_text, span_text, split_events
from .trace import Trace, load_traces
from .vllm_servers import servers_in, settings_text


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


def analyze(paths: list[str], fmt: str = "text", config: AnalysisConfig | None = None,
            merge_runs: bool = False) -> str:
    """Read trace files (CSV or Prometheus range-query JSON), replay them, render the result.

    Raises trace.TraceError for unreadable input (and for files of different runs unless
    `merge_runs`) and ValueError for an unknown format."""
    return analyze_trace(load_traces(paths, merge_runs), fmt, config)


def read_log_events(paths: Iterable[str], reference: float | None = None) -> list[OomEvent]:
    """The classified OOM events of log files (`explain`'s), each with the time of its log
    line where the line (or the log line a traceback follows) states one; see logtime.py.
    `reference`: a time near the incident, for log formats without a year. Raises
    explain.ExplainError."""
    from ..boundedio import open_regular
    from ..sources.logs import iter_file_lines
    from .explain import MAX_FILE_BYTES, read_events
    from .logtime import times_of_lines

    out: list[OomEvent] = []
    for path in paths:
        events = read_events(path)[0]
        missing = [e.line for e in events if e.timestamp is None]
        if missing:
            try:
                ref = reference if reference is not None else os.stat(path).st_mtime
                with open_regular(path) as fh:
                    times = times_of_lines(iter_file_lines(fh, MAX_FILE_BYTES), missing, ref)
            except OSError:
                times = {}  # read_events could read it a moment ago; the times are a bonus
            events = [replace(e, timestamp=times.get(e.line)) if e.timestamp is None else e
                      for e in events]
        out.extend(events)
    return out


def trace_oom_events(snapshots: Iterable[Snapshot]) -> list[OomEvent]:
    """The OOM messages the trace recorded (the live daemon read them from its logs), each
    stamped with its tick and classified as the live analysis classified it."""
    out = []
    for snap in snapshots:
        for m in snap.log_events:
            event = m if isinstance(m, OomEvent) else classify(m)
            out.append(replace(event, timestamp=snap.timestamp) if event.timestamp is None else event)
    return out


def _merge_events(recorded: list[OomEvent], logged: list[OomEvent]) -> list[OomEvent]:
    """Both lists in time order (untimed last), an event in both (same file and line) once:
    the log's, which carries the whole message."""
    seen = {(e.source, e.line, e.kind) for e in logged}
    events = logged + [e for e in recorded if (e.source, e.line, e.kind) not in seen]
    return sorted(events, key=lambda e: (e.timestamp is None, e.timestamp or 0.0))


def analyze_snapshots(snapshots: list[Snapshot], fmt: str = "text", config: AnalysisConfig | None = None,
                      report_path: str | None = None, oom_events: Iterable[OomEvent] = (),
                      triggers: Sequence[tuple[float, str]] = (), logs: Sequence[str] = ()) -> str:
    """analyze_trace of bare snapshots (and the flight recorder's (tick time, trigger) marks)."""
    return analyze_trace(Trace(snapshots, list(triggers)), fmt, config, report_path, oom_events, logs)


def analyze_trace(trace: Trace, fmt: str = "text", config: AnalysisConfig | None = None,
                  report_path: str | None = None, oom_events: Iterable[OomEvent] = (),
                  logs: Sequence[str] = ()) -> str:
    """Replay the trace and render the findings as `fmt`; with `report_path`, also write the
    HTML incident report there (OSError when it cannot be written). oom_events: from the `logs`
    given (read_log_events); the trace's own are added."""
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown format {fmt!r} (text or json)")
    snapshots = trace.snapshots
    _, analyzer = replay_episodes(snapshots, config)
    events = _merge_events(trace_oom_events(snapshots), list(oom_events))
    if report_path:
        from .report import write_report

        write_report(snapshots, analyzer.records(), events, report_path, triggers=trace.triggers,
                     runs=trace.runs, logs=logs, dropped=trace.dropped)
    if fmt == "json":
        return render_json(trace, analyzer, events, logs) + "\n"
    return render_text(trace, analyzer, events, logs)


def _trace_summary(snapshots: list[Snapshot], analyzer: Analyzer) -> dict[str, Any]:
    gpus = sorted({g.index for s in snapshots for g in s.gpus})
    return {
        "samples": len(snapshots),
        "start": snapshots[0].timestamp if snapshots else None,
        "end": snapshots[-1].timestamp if snapshots else None,
        "gpus": gpus,
        "findings_dropped": analyzer.dropped_findings,
    }


def render_json(trace: Trace, analyzer: Analyzer, events: Sequence[OomEvent] = (), logs: Sequence[str] = ()) -> str:
    from .explain import event_to_dict

    snapshots = trace.snapshots
    findings = []
    for episode in analyzer.records():
        item: dict[str, Any] = {}
        for key, value in episode.finding.to_json().items():
            item[key] = value
            if key == "evidence":  # the two versions side by side
                item["evidence_when_raised"] = dict(episode.raised.evidence)
        item["reported_at"] = episode.reported_at
        eased = episode.eased
        item["eased"] = None if eased is None else {
            "severity": eased.severity, "summary": eased.summary, "evidence": dict(eased.evidence),
            "reported_at": episode.eased_at}
        item["cleared_at"] = episode.cleared_at
        findings.append(item)
    summary = _trace_summary(snapshots, analyzer)
    summary["triggers"] = [{"timestamp": t, "trigger": name} for t, name in trace.triggers]
    summary["runs"] = [{"hostname": r.hostname, "boot_id": r.boot_id, "exporter_run": r.exporter_run}
                       for r in trace.runs]
    summary["logs"] = list(logs)
    summary["dropped"] = [{"timestamp": t, "cell": name, "count": n} for t, name, n in trace.dropped]
    start, end = summary["start"], summary["end"]
    oom = []
    for e in events:
        item = event_to_dict(e)
        item["outside_trace"] = bool(outside_text(e.timestamp, start, end))
        oom.append(item)
    return json.dumps({"findings": findings, "oom_events": oom, "trace": summary}, indent=2)


def _evidence_text(f: Finding) -> str:
    return sanitize(", ".join(f"{k}={v}" for k, v in f.evidence))


def _event_lines(events: Sequence[OomEvent], start: float | None, end: float | None,
                 logs: Sequence[str]) -> list[str]:
    """The incident's events (within the trace's time), then apart those outside it: another
    incident's, not counted as this one's."""
    source = f"in the trace and the {'logs' if len(logs) > 1 else 'log'} given ({', '.join(logs)})" if logs \
        else "in the trace (no log given: add --log FILE for a server's own)"
    inside, outside = split_events(events, start, end)
    if not inside:
        lines = ["", sanitize(f"Within the trace's time, no out-of-memory event {source}.")]
    else:
        lines = ["", sanitize(f"Within the trace's time, {counted(len(inside), 'out-of-memory event')} {source}:")]
    lines += _event_list(inside, start, end)
    if outside:
        lines += ["", sanitize(f"{len(outside)} more outside the trace's time, not part of this incident:")]
        lines += _event_list(outside, start, end)
    return lines


def _event_list(events: Sequence[OomEvent], start: float | None, end: float | None) -> list[str]:
    lines = []
    for e in events:
        away = outside_text(e.timestamp, start, end)
        when = "time unknown" if e.timestamp is None else format_time(e.timestamp) + (
            f" (OUTSIDE THE TRACE: {away})" if away else
            f" (+{span_text(e.timestamp - start)})" if start is not None else "")
        numbers = ", ".join(f"{name} {format_bytes(v)}" for name, v in (
            ("requested", e.requested_bytes), ("free", e.free_bytes), ("total", e.total_bytes))
            if v is not None)
        where = f"{e.source}:{e.line}" if e.source else f"line {e.line}"
        lines.append(sanitize(f"  {where}: {e.kind}, class {e.klass}, {when}"
                              + (f"; {numbers}" if numbers else "")
                              + (f"; GPU {e.gpu}" if e.gpu else "")))
        if e.verdict:
            lines.append("    " + sanitize(e.verdict))
    return lines


def _context_lines(trace: Trace) -> list[str]:
    """Who recorded the trace, what did not fit in it, and its vLLM servers' settings changes."""
    lines = []
    for run in trace.runs:
        lines.append(sanitize(f"Recorded on host {run.hostname or 'unknown'} (boot "
                              f"{run.boot_id or 'unknown'}) by exporter run {run.exporter_run or 'unknown'}."))
    if len(trace.runs) > 1:
        lines.append(f"These traces come from {len(trace.runs)} runs, merged on request (--merge-runs).")
    if trace.dropped:
        lines.append(dropped_text(trace.dropped))
    for story in servers_in(trace.snapshots):
        for c in story.settings[1:]:
            lines.append(sanitize(f"vLLM {story.endpoint}: at {format_time(c.at)} "
                                  + ("restarted with " if c.restarted else "settings changed to ")
                                  + settings_text(c.config, c.previous) + "."))
    return lines


def render_text(trace: Trace, analyzer: Analyzer, events: Sequence[OomEvent] = (), logs: Sequence[str] = ()) -> str:
    snapshots = trace.snapshots
    if not snapshots:
        return "\n".join(["The trace holds no samples.", *_event_lines(events, None, None, logs)]) + "\n"
    start, end = snapshots[0].timestamp, snapshots[-1].timestamp
    gpus = sorted({g.index for s in snapshots for g in s.gpus})
    lines = [f"Replayed {len(snapshots)} samples of {counted(len(gpus), 'GPU')} from {format_time(start)} to "
             f"{format_time(end)} ({span_text(end - start)})."]
    lines += _context_lines(trace)
    for t, name in trace.triggers:
        lines.append(sanitize(f"Flight recorder trigger: {name} at {format_time(t)} (+{span_text(t - start)}; "
                              f"{span_text(end - t)} recorded after it)."))
    if analyzer.dropped_findings:
        lines.append(f"({analyzer.dropped_findings} early findings were dropped: too many to keep.)")
    episodes = analyzer.records()
    if not episodes:
        lines.append("No findings.")
        return "\n".join(lines + _event_lines(events, start, end, logs)) + "\n"
    lines.append(f"{counted(len(episodes), 'finding')}:")
    for episode in episodes:
        f, raised = episode.finding, episode.raised
        where = ", ".join(x for x in (
            f"GPU {f.gpu}" if f.gpu is not None else "",
            f"pid {f.pid}" + (f" ({f.process})" if f.process else "") if f.pid is not None else "",
            f.endpoint) if x)
        until = (f", cleared {format_time(episode.cleared_at)}" if episode.cleared_at is not None
                 else ", still active at the end")
        # A finding that goes on tells its worst, then newest, verdict; what raised it may have
        # said otherwise (a leak's rate, the bar it passed before the hold halved it). Each is
        # dated, so a cleared finding's words read as what was said then, not as the present.
        lines += ["",
                  sanitize(f"[{f.severity}] {f.kind}" + (f" - {where}" if where else "")),
                  f"  first detected {format_time(f.first_detected_at)} "
                  f"(+{span_text(f.first_detected_at - start)}){until}",
                  "  " + sanitize(said_text(episode))]
        if episode.eased is not None:
            lines.append("  " + sanitize(eased_text(episode)))
        if raised.evidence != f.evidence:
            lines.append(f"  evidence when raised {format_time(f.first_detected_at)}: " + _evidence_text(raised))
            lines.append(f"  evidence as last reported {format_time(episode.reported_at)}: " + _evidence_text(f))
        elif f.evidence:
            lines.append("  evidence: " + _evidence_text(f))
        if f.advice and episode.cleared_at is not None:
            lines.append("  what was advised while it lasted:")
        for advice in f.advice:
            lines.append("  - " + sanitize(advice))
    return "\n".join(lines + _event_lines(events, start, end, logs)) + "\n"
