"""`analyze --report FILE.html`: one self-contained HTML page for the post-mortem.

Sections, each under the heading that names it: a summary (with the flight recorder's
triggers); the host (its name, boot and the exporter run that recorded the trace, and its
GPUs); the findings (timeline and table); each finding's details (for a process, its memory
curve with the fitted growth and a marker where the finding was first raised); per GPU the
stacked memory picture over time (serving processes, other processes, memory no live process
accounts for, free); the vLLM servers (model, settings and every change of them, budget against
use, KV cache); every process seen (and the allocation-history dumps); the OOM events (from the
logs given, and those the trace recorded; those of the logs outside the trace's time apart, as
another incident's: not counted, charted or advised); the advice. Every chart marks the trigger(s).
Charts need matplotlib (the `report` extra, reportplots.py); without it the tables and text are
still complete.

Safe to open: all text from outside (process names, log lines, evidence) is escaped with its
control characters removed; every link goes through `_link`, which allows only ALLOWED_URLS and
an allocation-history dump's file name (the probe's own pattern, as the live reader checks it);
the file is written like the recorder's (a new temporary file, O_EXCL|O_NOFOLLOW, then renamed).
"""
from __future__ import annotations

import html
import os
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypedDict
from urllib.parse import quote, urlsplit

from gpumem_probe.schema import DUMP_NAME

from ..model import Episode, Finding, OomEvent, Snapshot
from ..units import counted, format_bytes, format_time
from . import reportplots as plots
from .atomic import atomic_file
from .runs import RunIdentity
from .tracerow import clean_text
from .vllm_servers import ServerStory, servers_in, settings_text, startup_text

MAX_PROCESS_PLOTS = 24
MAX_GPU_PLOTS = 16
MAX_PROCESS_ROWS = 500
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
# The only places outside the page a link may lead; anything else is shown as text.
ALLOWED_URLS = frozenset({"https://pytorch.org/memory_viz"})

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;
color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .5em;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.sev-critical{color:#c62828;font-weight:bold}.sev-warning{color:#b26a00;font-weight:bold}.sev-info{color:#1565c0}
img{max-width:100%;border:1px solid #eee}.note{color:#666;font-style:italic}code{background:#f5f5f5;padding:0 .2em}
.finding{border-left:4px solid #ccc;padding:.2em .8em;margin:1em 0}
.finding.critical{border-color:#c62828}.finding.warning{border-color:#ef8f00}
.trigger{color:#6a1b9a}.outside{color:#b26a00}
td.wrap{max-width:16em;overflow-wrap:anywhere}
"""


# ---------------------------------------------------------------- small formatting helpers

def _e(value: object) -> str:
    return html.escape(clean_text(str(value)), quote=True)


def _link(href: str, text: str) -> str:
    """An <a> when `href` is allowed (ALLOWED_URLS, or a path on this machine, with neither
    scheme nor host, to an allocation-history dump), else the text alone."""
    try:
        parts = urlsplit(href)
    except ValueError:
        return text
    local = (not parts.scheme and not parts.netloc and "\\" not in href
             and DUMP_NAME.fullmatch(href.rsplit("/", 1)[-1]) is not None)
    if href not in ALLOWED_URLS and not local:
        return text
    return f'<a href="{_e(href)}">{text}</a>'


def span_text(seconds: float) -> str:
    """A span as `12m05s`, `5h04m03s`, or from a day on `368 days 17h04m` (seconds no longer
    matter, and 8849 hours read as nothing at all)."""
    whole = round(seconds)
    sign = "-" if whole < 0 else ""
    days, rest = divmod(abs(whole), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days} day{'s' if days > 1 else ''} {hours}h{minutes:02d}m"
    return f"{sign}{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{sign}{minutes}m{secs:02d}s"


def _bytes(n: float | None) -> str:
    return "" if n is None else format_bytes(n)


def _evidence_value(name: str, value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("bytes_per_second"):
            return f"{plots.rate_text(value)} ({value:g} B/s)"
        if name.endswith("_bytes"):
            return f"{_bytes(value)} ({int(value)} B)"
        if name.endswith("_seconds"):
            return f"{span_text(value)} ({value:g} s)"
    return str(value)


def _where(f: Finding) -> str:
    parts = []
    if f.gpu is not None:
        parts.append(f"GPU {f.gpu}")
    elif f.pid is not None:
        parts.append("host memory")
    if f.pid is not None:
        parts.append(f"pid {f.pid}" + (f" ({f.process})" if f.process else ""))
    if f.endpoint:
        parts.append(f.endpoint)
    return ", ".join(parts)


def outside_text(ts: float | None, start: float | None, end: float | None) -> str:
    """'' when `ts` lies within the trace (or either is unknown), else how far outside it is."""
    if ts is None or start is None or end is None:
        return ""
    if ts < start:
        return f"{span_text(start - ts)} before the trace starts"
    if ts > end:
        return f"{span_text(ts - end)} after the trace ends"
    return ""


# ---------------------------------------------------------------- data extraction

class _GpuSeries(TypedDict):
    t: list[float]
    serving: list[int]
    other: list[int]
    unattributed: list[int]
    free: list[int]
    total: list[int | None]
    used: list[int]


def _gpu_series(snapshots: Sequence[Snapshot]) -> dict[str, _GpuSeries]:
    """Per GPU index: times and the four stacked parts (bytes), for the samples where it was up."""
    out: dict[str, _GpuSeries] = {}
    for s in snapshots:
        for g in s.gpus:
            if not g.up or g.used_bytes is None:
                continue
            d = out.setdefault(g.index, _GpuSeries(t=[], serving=[], other=[], unattributed=[],
                                                   free=[], total=[], used=[]))
            serving = sum(p.used_bytes or 0 for p in g.processes if p.role == "vllm")
            other = sum(p.used_bytes or 0 for p in g.processes if p.role != "vllm")
            d["t"].append(s.timestamp)
            d["serving"].append(serving)
            d["other"].append(other)
            d["unattributed"].append(max(0, g.used_bytes - serving - other))
            d["free"].append(max(0, g.total_bytes - g.used_bytes) if g.total_bytes else 0)
            d["total"].append(g.total_bytes)
            d["used"].append(g.used_bytes)
    return out


def _process_series(snapshots: Sequence[Snapshot], gpu: str | None,
                    pid: int) -> tuple[list[float], list[int]]:
    """GPU memory of pid on gpu over time; gpu None: the process's host RSS."""
    ts: list[float] = []
    vs: list[int] = []
    for s in snapshots:
        for g in s.gpus:
            if gpu is not None and g.index != gpu:
                continue
            p = next((p for p in g.processes if p.pid == pid), None)
            value = None if p is None else (p.used_bytes if gpu is not None else p.host_rss_bytes)
            if value is not None:
                ts.append(s.timestamp)
                vs.append(value)
                break
    return ts, vs


def _process_summaries(snapshots: Sequence[Snapshot]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for s in snapshots:
        for g in s.gpus:
            for p in g.processes:
                if p.used_bytes is None:
                    continue
                r = rows.setdefault((g.index, p.pid), {
                    "gpu": g.index, "pid": p.pid, "process": p.name, "role": p.role,
                    "t0": s.timestamp, "first": p.used_bytes, "peak": 0})
                r["t1"], r["last"] = s.timestamp, p.used_bytes
                r["peak"] = max(r["peak"], p.used_bytes)
    return sorted(rows.values(), key=lambda r: -r["peak"])


# ---------------------------------------------------------------- HTML sections

def _img(src: str, alt: str) -> str:
    return f'<p><img src="{src}" alt="{_e(alt)}"></p>'


def _chart(mpl: plots.Mpl, fig: Any, alt: str, triggers: plots.Triggers) -> str:
    marks = "; ".join(f"trigger {name} at {format_time(t)}" for t, name in triggers)
    return _img(plots.png(mpl, fig), alt + (f" ({marks} marked)" if marks else ""))


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]],
           numeric: AbstractSet[int] = frozenset(), wrap: AbstractSet[int] = frozenset()) -> str:
    """`wrap`: columns of long values (paths, lists), kept narrow: they break anywhere and each
    line of the value ("\n") starts a new line."""
    def cell(i: int, c: object) -> str:
        if i in wrap:
            return '<td class="wrap">' + "<br>".join(_e(line) for line in str(c).split("\n")) + "</td>"
        return f'<td class="num">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"

    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(cell(i, c) for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def said_text(episode: Episode) -> str:
    """The finding's summary, dated where it says something else than the version that raised
    it, or where it eased after (when its worst ended): a cleared finding's words are what was
    said then."""
    f = episode.finding
    dated = episode.updated or episode.eased is not None
    return (f"as last reported {format_time(episode.reported_at)}: " if dated else "") + f.summary


def eased_text(episode: Episode) -> str:
    """The newest version of a finding that went on less severe than its worst ("" if none):
    the worst is what is shown, and on-call should know it eased before it cleared."""
    eased = episode.eased
    if eased is None:
        return ""
    return f"later {eased.severity}, as last reported {format_time(episode.eased_at)}: {eased.summary}"


def _evidence_table(episode: Episode) -> str:
    """The evidence; where the version shown is not the one that raised the finding, both, each
    under its time (a leak's rate, the bar it passed, move while the finding lasts)."""
    f, raised = episode.finding, episode.raised
    if raised.evidence == f.evidence:
        return _table(("evidence", "value"), ((k, _evidence_value(k, v)) for k, v in f.evidence))
    then, now = dict(raised.evidence), dict(f.evidence)
    names = list(dict.fromkeys([*then, *now]))
    return _table(("evidence", f"when raised, {format_time(raised.first_detected_at)}",
                   f"as last reported, {format_time(episode.reported_at)}"),
                  ((k, _evidence_value(k, then[k]) if k in then else "",
                    _evidence_value(k, now[k]) if k in now else "") for k in names))


def _finding_row(episode: Episode, start: float) -> tuple[str, ...]:
    f, cleared = episode.finding, episode.cleared_at
    return (f.severity, f.kind, _where(f),
            f"{format_time(f.first_detected_at)} (+{span_text(f.first_detected_at - start)})",
            format_time(cleared) if cleared is not None else "active at the end", said_text(episode))


def _finding_detail(episode: Episode, start: float, plot: str | None) -> str:
    f, cleared = episode.finding, episode.cleared_at
    sev = _e(f.severity)
    out = [f'<div class="finding {sev}"><h3><span class="sev-{sev}">[{sev}]</span> '
           f"{_e(f.kind)} &mdash; {_e(_where(f))}</h3>",
           f"<p>{_e(said_text(episode))}</p>",
           *([f"<p>{_e(eased_text(episode))}</p>"] if episode.eased is not None else []),
           f"<p>First detected {_e(format_time(f.first_detected_at))} (+{_e(span_text(f.first_detected_at - start))})"
           + (f", cleared {_e(format_time(cleared))}" if cleared is not None else ", still active at the end")
           + ".</p>"]
    if plot:
        out.append(plot)
    if f.evidence or episode.raised.evidence:
        out.append(_evidence_table(episode))
    if f.advice:
        if cleared is not None:
            out.append("<p>What was advised while it lasted:</p>")
        out.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in f.advice) + "</ul>")
    out.append("</div>")
    return "\n".join(out)


def _host_section(snapshots: Sequence[Snapshot], runs: Sequence[RunIdentity]) -> str:
    out = []
    if not runs:
        out.append("<p>The trace does not name its host (a trace of an older exporter, or of "
                   "Prometheus).</p>")
    for run in runs:
        out.append(f'<p class="identity">Host <b>{_e(run.hostname or "unknown")}</b>, boot '
                   f"<code>{_e(run.boot_id or 'unknown')}</code>, recorded by exporter run "
                   f"<code>{_e(run.exporter_run or 'unknown')}</code>.</p>")
    if len(runs) > 1:
        out.append(f"<p class=\"outside\">These traces come from {len(runs)} runs, merged on "
                   "request (<code>--merge-runs</code>): read the replay with that in mind.</p>")
    host = next((s.host for s in reversed(snapshots) if s.host is not None), None)
    if host is not None:
        out.append(f"<p>Host memory: {_e(_bytes(host.total_bytes))}.</p>")
    gpus: dict[str, tuple[str, str, str]] = {}
    for s in snapshots:
        for g in s.gpus:
            gpus[g.index] = (g.uuid, _bytes(g.total_bytes) if g.total_bytes else gpus.get(
                g.index, ("", "", ""))[1], "unified (the host's)" if g.unified else
                "MIG instance" if g.mig else "its own (discrete)")
    if gpus:
        out.append(_table(("GPU", "UUID", "total", "memory"),
                          ((i, *v) for i, v in gpus.items()), numeric={2}))
    return "\n".join(out)


def _vllm_section(stories: Sequence[ServerStory]) -> str:
    if not stories:
        return "<p>The trace names no vLLM server.</p>"
    out = []
    for s in stories:
        seen = (f"seen from {format_time(s.first_seen)} to {format_time(s.last_seen)} in {s.samples} samples"
                + (f", down in {s.down_samples} of them (first at {format_time(s.first_down)})"
                   if s.down_samples else ""))
        out += [f'<div class="vllm"><h3>{_e(s.endpoint)}</h3>',
                f"<p>Model: <b>{_e(', '.join(s.models) or 'not reported')}</b>; {_e(seen)}.</p>"]
        # Each start's log figures go with the settings they came under (a restart's smaller KV
        # cache was shown beside the first start's settings).
        starts = [c.at for c in s.settings[1:]]
        logged: list[list[str]] = [[] for _ in range(len(starts) + 1)]
        for at, profile in s.startups:
            if text := startup_text(profile):
                logged[bisect_right(starts, at)].append(text)
        log_text = ["".join(f"; start-up log: {text}" for text in texts) for texts in logged]
        if s.settings:
            first = s.settings[0]
            out.append(f"<p>Settings from {_e(format_time(first.at))}: "
                       f"{_e(settings_text(first.config) + log_text[0])}.</p>")
            changes = [f"<li><b>{_e(format_time(c.at))}</b>: "
                       f"{'restarted with' if c.restarted else 'settings changed to'} "
                       f"{_e(settings_text(c.config, c.previous) + log_text[i])}</li>"
                       for i, c in enumerate(s.settings[1:], 1)]
            if changes:
                out.append('<ul class="vllm-changes">' + "".join(changes) + "</ul>")
        else:
            out.append("<p>Settings: not reported (no <code>vllm:cache_config_info</code>).</p>")
            out += [f"<p>Its start-up log: {_e(text)}.</p>" for text in logged[0]]
        if s.gpus:
            out.append(_table(("GPU", "budget", "basis", "peak used", "at", "most over budget"), (
                (g, ", then ".join(_bytes(b) for b in u.budgets) or "unknown", u.basis,
                 _bytes(u.peak_used_bytes), format_time(u.peak_at),
                 f"{_bytes(u.over_bytes)} ({format_time(u.over_at)})" if u.over_bytes else "never over")
                for g, u in sorted(s.gpus.items())), numeric={3}))
        kv = []
        if s.kv_peak is not None:
            kv.append(f"KV cache usage peaked at {s.kv_peak:.0%} ({format_time(s.kv_peak_at)})")
        if s.config is not None and s.config.kv_capacity_tokens is not None:
            kv.append(f"capacity {s.config.kv_capacity_tokens:,} tokens"
                      + (f" since {format_time(s.settings[-1].at)}" if len(s.settings) > 1 else ""))
        if s.running_peak is not None or s.waiting_peak is not None:
            kv.append(f"at most {s.running_peak or 0:g} requests running and "
                      f"{s.waiting_peak or 0:g} waiting")
        if s.preemptions:
            kv.append(f"{s.preemptions:g} preemptions over the trace")
        if s.sleep_states:
            kv.append("sleep states seen: " + ", ".join(s.sleep_states))
        if kv:
            out.append(f"<p>{_e('; '.join(kv))}.</p>")
        out.append("</div>")
    return "\n".join(out)


def split_events(events: Iterable[OomEvent], start: float | None,
                 end: float | None) -> tuple[list[OomEvent], list[OomEvent]]:
    """(within the trace's time or of unknown time, outside it): only the first are the
    incident's, counted and advised as part of it."""
    inside: list[OomEvent] = []
    outside: list[OomEvent] = []
    for e in events:
        (outside if outside_text(e.timestamp, start, end) else inside).append(e)
    return inside, outside


def _oom_section(events: Sequence[OomEvent], outside: Sequence[OomEvent], logs: Sequence[str],
                 start: float | None, end: float | None) -> str:
    given = (f"From the trace and the {'logs' if len(logs) > 1 else 'log'} given ({_e(', '.join(logs))})" if logs
             else "No log was given (<code>analyze --log FILE</code>); from the trace")
    out = [f"<p>{given}: {counted(len(events), 'event')} within the trace's time.</p>" if events else
           f"<p>{given}: no out-of-memory event within the trace's time.</p>"]
    out += _oom_events(events, start, end)
    if outside:
        out += ['<h3 class="outside">Outside the trace\'s time</h3>',
                f'<p class="outside">{counted(len(outside), "event")} from the logs fall outside the trace\'s time: '
                "not part of this incident, not counted above, and their advice is not under Advice.</p>",
                *_oom_events(outside, start, end)]
    return "\n".join(out)


def _oom_events(events: Sequence[OomEvent], start: float | None, end: float | None) -> list[str]:
    if not events:
        return []
    rows = [(f"{ev.source}:{ev.line}", format_time(ev.timestamp)
             + (f" ({outside_text(ev.timestamp, start, end)})" if outside_text(ev.timestamp, start, end) else ""),
             ev.gpu or "", ev.kind, ev.klass,
             _bytes(ev.requested_bytes), _bytes(ev.free_bytes), _bytes(ev.total_bytes),
             _bytes(ev.reserved_unallocated_bytes), _bytes(ev.process_bytes),
             "\n".join(f"pid {pid}: {_bytes(b)}" for pid, b in ev.other_processes))
            for ev in events]
    out = [_table(("log", "time", "GPU", "kind", "class", "requested", "free", "total",
                   "reserved, unallocated", "this process", "other processes"), rows,
                  numeric={5, 6, 7, 8, 9}, wrap={0, 10})]
    for ev in events:
        out.append(f"<p><code>{_e(ev.source)}:{ev.line}</code> <b>{_e(ev.kind)}</b> "
                   f"({_e(ev.klass)}): <code>{_e(ev.message[:500])}</code></p>")
        if ev.advice:
            out.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in ev.advice) + "</ul>")
    return out


def _advice_section(episodes: Iterable[Episode], events: Sequence[OomEvent]) -> str:
    advice: dict[str, list[str]] = {}
    for e in episodes:
        f = e.finding
        cleared = ", cleared" if e.cleared_at is not None else ""  # what was advised while it lasted
        for a in f.advice:
            advice.setdefault(a, []).append(f"{f.kind} ({_where(f)}{cleared})")
    for ev in events:
        for a in ev.advice:
            advice.setdefault(a, []).append(f"OOM {ev.source}:{ev.line}")
    if not advice:
        return "<p>Nothing to change: no finding and no OOM event.</p>"
    return "<ol>" + "".join(
        f"<li>{_e(a)} <span class=\"note\">&mdash; for {_e('; '.join(dict.fromkeys(why)))}</span></li>"
        for a, why in advice.items()) + "</ol>"


def _history_dumps(snapshots: Sequence[Snapshot]) -> list[tuple[str, int, str, str, int | None]]:
    """(gpu, pid, process, file, bytes) of each allocation-history dump a probe reported in the
    trace (docs/probe.md), the last one reported per process and file. A file name that is not
    a dump's (the probe's pattern, as sources/allocator.py checks it live) is left out."""
    dumps: dict[tuple[str, int, str], tuple[str, int, str, str, int | None]] = {}
    for snap in snapshots:
        for g in snap.gpus:
            for p in g.processes:
                a = p.allocator
                if a is not None and a.history_file and DUMP_NAME.fullmatch(a.history_file):
                    dumps[(g.index, p.pid, a.history_file)] = (g.index, p.pid, p.name, a.history_file,
                                                               a.history_bytes)
    return list(dumps.values())


def _history_section(dumps: Sequence[tuple[str, int, str, str, int | None]], probe_dir: str) -> str:
    out = []
    viz = _link("https://pytorch.org/memory_viz", "pytorch.org/memory_viz")
    for gpu, pid, process, name, size in dumps:
        path = os.path.join(probe_dir, name) if probe_dir else name
        where = "" if probe_dir else " in the probe directory (<code>allocator.probe_dir</code>)"
        out.append(f'<p class="alloc-history">Allocation history of pid {pid}'
                   + (f" ({_e(process)})" if process else "") + f" on GPU {_e(gpu)}: "
                   + _link(quote(path, safe="/"), f"<code>{_e(path)}</code>")
                   + (f" ({_e(_bytes(size))})" if size is not None else "") + f"{where}; open it in "
                   f"{viz} to see the stacks that allocated the memory.</p>")
    return "\n".join(out)


def render_report(snapshots: Sequence[Snapshot], records: Iterable[Episode],
                  oom_events: Iterable[OomEvent], title: str = "GPU memory post-mortem",
                  triggers: Sequence[tuple[float, str]] = (), probe_dir: str = "", *,
                  runs: Sequence[RunIdentity] = (), logs: Sequence[str] = (),
                  dropped: Sequence[tuple[float, str, int]] = ()) -> str:
    """The report as one HTML string (see write_report)."""
    snapshots = sorted(snapshots, key=lambda s: s.timestamp)
    episodes = sorted(records, key=lambda e: (e.finding.first_detected_at,
                                              _SEVERITY_RANK.get(e.finding.severity, 3)))
    mpl = plots.load()
    start = snapshots[0].timestamp if snapshots else min(
        [e.finding.first_detected_at for e in episodes] or [0.0])
    end = snapshots[-1].timestamp if snapshots else start
    # Log events outside the trace's time are another incident's: shown apart, never counted,
    # charted or advised as this one's.
    events, outside = split_events(oom_events, start if snapshots else None, end if snapshots else None)
    gpus = _gpu_series(snapshots)

    body = [f"<h1>{_e(title)}</h1>"]
    if snapshots:
        seen = {g.index for s in snapshots for g in s.gpus}  # charted or not (a trace of process bytes only)
        body.append(f"<p>{len(snapshots)} samples of {counted(len(seen), 'GPU')} from {_e(format_time(start))} to "
                    f"{_e(format_time(end))} ({_e(span_text(end - start))}). {counted(len(episodes), 'finding')}, "
                    f"{counted(len(events), 'out-of-memory event')}"
                    + (f' <span class="outside">({len(outside)} more in the logs outside the trace\'s '
                       "time, listed apart)</span>" if outside else "") + ".</p>")
    else:
        body.append("<p>The trace holds no samples.</p>")
    for t, name in triggers:
        body.append(f"<p class=\"trigger\">Flight recorder trigger: <b>{_e(name)}</b> at "
                    f"{_e(format_time(t))} (+{_e(span_text(t - start))}; {_e(span_text(end - t))} recorded "
                    "after it). Every chart marks it with a purple dash-dot line.</p>")
    if dropped:
        body.append(f"<p class=\"outside\">{_e(dropped_text(dropped))}</p>")
    if mpl is None:
        body.append('<p class="note">Plots are left out: matplotlib is not installed where this report '
                    "was written (the <code>report</code> extra).</p>")

    body += ["<h2>Host</h2>", _host_section(snapshots, runs), "<h2>Findings</h2>"]
    if episodes:
        if mpl is not None and snapshots:
            body.append(_chart(mpl, plots.timeline(mpl, episodes, start, end, triggers),
                               "timeline of findings", triggers))
        body.append(_table(("severity", "kind", "where", "first detected", "cleared", "summary"),
                           (_finding_row(e, start) for e in episodes)))
        body += ["<h2>Finding details</h2>", *_details(snapshots, episodes, start, end, triggers, mpl)]
    else:
        body.append("<p>No findings.</p>")

    body.append("<h2>GPU memory</h2>")
    rows = [(index, _bytes(d["total"][-1]), _bytes(max(d["used"])), _bytes(d["used"][-1]),
             _bytes(max(d["unattributed"])), _bytes(min(d["free"]))) for index, d in gpus.items()]
    if rows:
        body.append(_table(("GPU", "total", "peak used", "used at the end", "peak unattributed",
                            "least free"), rows, numeric={1, 2, 3, 4, 5}))
    else:
        body.append("<p>No GPU memory was recorded.</p>")
    if mpl is not None:
        for index in list(gpus)[:MAX_GPU_PLOTS]:
            d = gpus[index]
            fig = plots.gpu(mpl, index, d["t"], (d["serving"], d["other"], d["unattributed"], d["free"]),
                            events, episodes, triggers)
            body.append(_chart(mpl, fig, f"GPU {index} memory by owner", triggers))

    body += ["<h2>vLLM servers</h2>", _vllm_section(servers_in(snapshots)), "<h2>Processes</h2>"]
    summaries = _process_summaries(snapshots)
    if summaries:
        # No average rate here: a start-up ramp would dwarf any leak; the findings give rates.
        # "last seen": a process that exited (a server restarted under a new pid) is told from
        # one still running at the end, whose "last" is the end's.
        body.append(_table(("GPU", "pid", "process", "role", "first seen", "last seen", "first", "last",
                            "peak", "change"), (
            (r["gpu"], r["pid"], r["process"], r["role"], format_time(r["t0"]),
             "at the end" if r["t1"] >= end else format_time(r["t1"]), _bytes(r["first"]),
             _bytes(r["last"]), _bytes(r["peak"]), _bytes(r["last"] - r["first"]))
            for r in summaries[:MAX_PROCESS_ROWS]), numeric={6, 7, 8, 9}))
    else:
        body.append("<p>No process was recorded.</p>")
    body.append(_history_section(_history_dumps(snapshots), probe_dir))

    body += ["<h2>Out-of-memory events</h2>",
             _oom_section(events, outside, logs, start if snapshots else None, end if snapshots else None),
             "<h2>Advice</h2>", _advice_section(episodes, events)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _details(snapshots: Sequence[Snapshot], episodes: Sequence[Episode], start: float,
             end: float, triggers: plots.Triggers, mpl: plots.Mpl | None) -> list[str]:
    """Each finding's block: those of a process first (with its memory curve), then the rest."""
    out = []
    with_pid = [e for e in episodes if e.finding.pid is not None]
    for i, episode in enumerate(with_pid):
        f, chart = episode.finding, None
        if mpl is not None and i < MAX_PROCESS_PLOTS and f.pid is not None:
            ts, vs = _process_series(snapshots, f.gpu, f.pid)
            if ts:
                chart = _chart(mpl, plots.process(mpl, f, ts, vs, end, triggers),
                               f"memory of pid {f.pid}", triggers)
        out.append(_finding_detail(episode, start, chart))
    out += [_finding_detail(e, start, None) for e in episodes if e.finding.pid is None]
    return out


def dropped_text(dropped: Sequence[tuple[float, str, int]]) -> str:
    """'The trace left out what did not fit in its cells: 312 oom_events (in 1 tick).'"""
    totals: dict[str, tuple[int, set[float]]] = {}
    for ts, name, count in dropped:
        have, ticks = totals.get(name, (0, set()))
        totals[name] = (have + count, ticks | {ts})
    return ("The trace left out what did not fit in its cells: "
            + ", ".join(f"{n:,} {name} (in {len(ticks)} tick{'s' if len(ticks) > 1 else ''})"
                        for name, (n, ticks) in sorted(totals.items())) + ".")


def write_report(snapshots: Sequence[Snapshot], records: Iterable[Episode],
                 oom_events: Iterable[OomEvent], path: str, title: str = "GPU memory post-mortem",
                 triggers: Sequence[tuple[float, str]] = (), probe_dir: str = "", *,
                 runs: Sequence[RunIdentity] = (), logs: Sequence[str] = (),
                 dropped: Sequence[tuple[float, str, int]] = ()) -> None:
    """Write the report to `path` as one self-contained HTML file, mode 0600, through a new
    temporary file of an unpredictable name (O_CREAT|O_EXCL|O_NOFOLLOW) renamed over `path`:
    a link planted where the report goes is replaced, never written through (atomic.py).

    records: every finding's Episode, as Analyzer.records() gives them. oom_events:
    OomEvents (from `explain` of the logs, and the trace's own). triggers: the flight
    recorder's (tick time, trigger) marks.
    probe_dir: where the probes' allocation-history dumps are, for their links (else the
    bare file name). runs: who recorded the trace (trace.Trace.runs). logs: the log files
    given. dropped: what the trace's writer left out (trace.Trace.dropped)."""
    text = render_report(snapshots, records, oom_events, title, triggers, probe_dir,
                         runs=runs, logs=logs, dropped=dropped)
    with atomic_file(path, encoding="utf-8") as handle:
        handle.write(text)


__all__ = ["ALLOWED_URLS", "dropped_text", "eased_text", "outside_text", "render_report", "said_text", "span_text",
           "split_events", "write_report"]
