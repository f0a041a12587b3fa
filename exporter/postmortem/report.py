"""`analyze --report FILE.html`: one self-contained HTML page for the post-mortem.

Sections: a summary, the timeline of findings, per GPU the stacked memory picture over time
(serving processes, other processes, memory no live process accounts for, free), per process
with a finding its memory curve with the fitted growth (the detector's slope) and a marker
where the finding was first raised, the OOM events from the logs with their numbers, and the
advice. Plots need matplotlib (the `report` extra), imported only here and drawn with the Agg
canvas into PNGs embedded as data URIs; without it the tables and text are still complete.
All text from outside (process names, log lines, evidence) is escaped.
"""
from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timezone
from statistics import median
from typing import TYPE_CHECKING, Any, TypedDict

from ..model import Finding, OomEvent, Snapshot
from ..units import GiB, MiB, format_bytes

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (Figure, FigureCanvasAgg, matplotlib.dates), as _matplotlib() returns them
    _Mpl = tuple[type[Figure], type[FigureCanvasAgg], ModuleType]

# (finding, cleared_at or None), as Analyzer.episodes() gives them
_Episode = tuple[Finding, float | None]
# The plots' Axes: they are given datetimes, which matplotlib converts through its units
# registry; its type hints admit only floats and arrays there, so the axes are left untyped.
_DateAxes = Any

MAX_PLOT_POINTS = 2000  # per series: more does not show on a 1000-pixel plot
MAX_PROCESS_PLOTS = 24
MAX_GPU_PLOTS = 16
_SEVERITY_COLOUR = {"critical": "#c62828", "warning": "#ef8f00", "info": "#1565c0"}
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}

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
"""


# ---------------------------------------------------------------- small formatting helpers

def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _span(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(abs(whole), 3600)
    minutes, secs = divmod(rest, 60)
    sign = "-" if whole < 0 else ""
    return f"{sign}{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{sign}{minutes}m{secs:02d}s"


def _bytes(n: float | None) -> str:
    return "" if n is None else format_bytes(n)


def _rate(bytes_per_second: float) -> str:
    return f"{float(bytes_per_second) * 60 / MiB:.1f} MiB/min"


def _evidence_value(name: str, value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("bytes_per_second"):
            return f"{_rate(value)} ({value:g} B/s)"
        if name.endswith("_bytes"):
            return f"{_bytes(value)} ({int(value)} B)"
        if name.endswith("_seconds"):
            return f"{_span(value)} ({value:g} s)"
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


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= MAX_PLOT_POINTS:
        return list(xs), list(ys)
    stride = -(-len(xs) // MAX_PLOT_POINTS)
    return list(xs[::stride]), list(ys[::stride])


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


def _fitted_line(ts: list[float], vs: list[int], f: Finding,
                 end: float) -> tuple[float, tuple[float, float], tuple[float, float]] | None:
    """The detector's growth line: its slope, through the samples of its window before
    detection (intercept = median residual), drawn from the window's start to the end.
    (slope, (t_start, t_end), (v_start, v_end)), or None without a slope in the evidence."""
    ev = dict(f.evidence)
    slope = ev.get("slope_bytes_per_second")
    if not isinstance(slope, (int, float)) or not ts:
        return None
    window = ev.get("window_seconds")
    window = float(window) if isinstance(window, (int, float)) and window > 0 else 3600.0
    t0 = f.first_detected_at
    inside = [(t, v) for t, v in zip(ts, vs, strict=True) if t0 - window <= t <= t0] or list(zip(ts, vs, strict=True))
    level = median(v - slope * (t - t0) for t, v in inside)
    a = max(ts[0], t0 - window)
    return slope, (a, end), (level + slope * (a - t0), level + slope * (end - t0))


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


# ---------------------------------------------------------------- plotting (optional)

def _matplotlib() -> _Mpl | None:
    """(Figure, FigureCanvasAgg, dates) or None when the `report` extra is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a server; a no-op when already Agg
        from matplotlib import dates
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg, dates


def _png(mpl: _Mpl, fig: Figure) -> str:
    _, canvas_class, _ = mpl
    canvas_class(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _dt(ts: Iterable[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, timezone.utc) for t in ts]


def _time_axis(mpl: _Mpl, ax: _DateAxes) -> None:
    dates = mpl[2]
    ax.xaxis.set_major_formatter(dates.DateFormatter("%H:%M", tz=timezone.utc))
    ax.set_xlabel("time (UTC)")
    ax.grid(True, alpha=0.3)


def _timeline_plot(mpl: _Mpl, episodes: Sequence[_Episode], start: float, end: float) -> str:
    Figure = mpl[0]
    shown = episodes[:40]
    fig = Figure(figsize=(10, 0.45 * len(shown) + 1.2))
    ax: _DateAxes = fig.add_subplot()
    for i, (f, cleared) in enumerate(shown):
        a, b = f.first_detected_at, cleared if cleared is not None else end
        # Date axes count days: a bar of at least 1/400 of the range so a short one shows.
        ax.barh(i, max(b - a, (end - start) / 400) / 86400, left=mpl[2].date2num(_dt([a])[0]),
                color=_SEVERITY_COLOUR.get(f.severity, "#777"), height=0.6)
        ax.text(_dt([a])[0], i, f" {f.kind} {_where(f)}", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.7, len(shown) - 0.3)
    ax.invert_yaxis()
    ax.set_xlim(_dt([start])[0], _dt([end])[0])
    ax.set_title("Findings: raised to cleared (red critical, orange warning)")
    _time_axis(mpl, ax)
    return _png(mpl, fig)


def _gpu_plot(mpl: _Mpl, index: str, d: _GpuSeries, ooms: list[OomEvent],
              findings: Iterable[_Episode]) -> str:
    Figure = mpl[0]
    fig = Figure(figsize=(10, 3.6))
    ax: _DateAxes = fig.add_subplot()
    t, parts = d["t"], (d["serving"], d["other"], d["unattributed"], d["free"])
    thinned = [_thin(t, [v / GiB for v in part]) for part in parts]
    ax.stackplot(_dt(thinned[0][0]), *[y for _, y in thinned],
                 labels=["serving (vLLM) processes", "other processes",
                         "unattributed (no live process)", "free"],
                 colors=["#1976d2", "#ffa726", "#8e24aa", "#c8e6c9"], alpha=0.9)
    for ev in ooms:
        if ev.timestamp is not None and ev.gpu in (None, index):
            ax.axvline(_dt([ev.timestamp])[0], color="#c62828", linestyle="--", linewidth=1.2)
    for f, _ in findings:
        if f.gpu == index:
            ax.axvline(_dt([f.first_detected_at])[0], color=_SEVERITY_COLOUR.get(f.severity, "#777"),
                       linestyle=":", linewidth=1)
    ax.set_ylabel("GiB")
    ax.set_title(f"GPU {index}: memory by owner (dotted: finding raised, dashed red: OOM)")
    ax.legend(loc="lower left", fontsize=8, framealpha=0.8)
    ax.set_xlim(_dt([t[0]])[0], _dt([t[-1]])[0])
    _time_axis(mpl, ax)
    return _png(mpl, fig)


def _process_plot(mpl: _Mpl, f: Finding, ts: list[float], vs: list[int], end: float) -> str:
    Figure = mpl[0]
    fig = Figure(figsize=(10, 3.2))
    ax: _DateAxes = fig.add_subplot()
    what = "GPU memory" if f.gpu is not None else "host RSS"
    xs, ys = _thin(ts, [v / GiB for v in vs])
    ax.plot(_dt(xs), ys, color="#1976d2", linewidth=1, label=what)
    line = _fitted_line(ts, vs, f, end)
    if line is not None:
        slope, (a, b), (va, vb) = line
        ax.plot(_dt([a, b]), [va / GiB, vb / GiB], color="#c62828", linewidth=2,
                label=f"fitted growth {_rate(slope)}")
    ax.axvline(_dt([f.first_detected_at])[0], color="#c62828", linestyle="--", linewidth=1)
    at = min(range(len(ts)), key=lambda i: abs(ts[i] - f.first_detected_at))
    ax.plot(_dt([ts[at]]), [vs[at] / GiB], marker="v", markersize=10, color="#c62828",
            linestyle="none", label=f"{f.kind} first detected {_when(f.first_detected_at)[11:]}")
    # Zoom on the growth: a start-up ramp of tens of GiB would flatten a leak of MiB/min.
    window = dict(f.evidence).get("window_seconds")
    since = f.first_detected_at - (float(window) if isinstance(window, (int, float)) else 3600.0)
    recent = [v / GiB for t, v in zip(ts, vs, strict=True) if t >= since] or [v / GiB for v in vs]
    low, high = min(recent), max(recent)
    if line is not None:
        low, high = min(low, va / GiB, vb / GiB), max(high, va / GiB, vb / GiB)
    pad = max((high - low) * 0.15, 0.01)
    zoomed = low - pad > min(ys)
    ax.set_ylim(low - pad, high + pad)
    ax.set_ylabel("GiB")
    ax.set_title(f"pid {f.pid} {f.process} on {'GPU ' + f.gpu if f.gpu is not None else 'host'}: "
                 f"{what}" + (" (y axis zoomed on the growth)" if zoomed else ""))
    ax.legend(loc="upper left", fontsize=8, framealpha=0.8)
    _time_axis(mpl, ax)
    return _png(mpl, fig)


def _img(src: str, alt: str) -> str:
    return f'<p><img src="{src}" alt="{_e(alt)}"></p>'


# ---------------------------------------------------------------- HTML sections

def _table(headers: Sequence[str], rows: Iterable[Sequence[object]],
           numeric: AbstractSet[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(
            f'<td class="num">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"
            for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _finding_detail(f: Finding, cleared: float | None, start: float, plot: str | None) -> str:
    sev = _e(f.severity)
    out = [f'<div class="finding {sev}"><h3><span class="sev-{sev}">[{sev}]</span> '
           f"{_e(f.kind)} &mdash; {_e(_where(f))}</h3>",
           f"<p>{_e(f.summary)}</p>",
           f"<p>First detected {_e(_when(f.first_detected_at))} (+{_e(_span(f.first_detected_at - start))})"
           + (f", cleared {_e(_when(cleared))}" if cleared is not None else ", still active at the end")
           + ".</p>"]
    if plot:
        out.append(_img(plot, f"memory of pid {f.pid}"))
    if f.evidence:
        out.append(_table(("evidence", "value"), ((k, _evidence_value(k, v)) for k, v in f.evidence)))
    if f.advice:
        out.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in f.advice) + "</ul>")
    out.append("</div>")
    return "\n".join(out)


def _oom_section(events: Sequence[OomEvent]) -> str:
    if not events:
        return "<p>No out-of-memory events were found in the logs.</p>"
    rows = [(f"{ev.source}:{ev.line}", _when(ev.timestamp), ev.gpu or "", ev.kind, ev.klass,
             _bytes(ev.requested_bytes), _bytes(ev.free_bytes), _bytes(ev.total_bytes),
             _bytes(ev.reserved_unallocated_bytes), _bytes(ev.process_bytes),
             ", ".join(f"pid {pid}: {_bytes(b)}" for pid, b in ev.other_processes))
            for ev in events]
    out = [f"<p>{len(events)} event(s).</p>",
           _table(("log", "time", "GPU", "kind", "class", "requested", "free", "total",
                   "reserved, unallocated", "this process", "other processes"), rows,
                  numeric={5, 6, 7, 8, 9})]
    for ev in events:
        out.append(f"<p><code>{_e(ev.source)}:{ev.line}</code> <b>{_e(ev.kind)}</b> "
                   f"({_e(ev.klass)}): <code>{_e(ev.message[:500])}</code></p>")
        if ev.advice:
            out.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in ev.advice) + "</ul>")
    return "\n".join(out)


def _advice_section(episodes: Iterable[_Episode], events: Sequence[OomEvent]) -> str:
    advice: dict[str, list[str]] = {}
    for f, _ in episodes:
        for a in f.advice:
            advice.setdefault(a, []).append(f"{f.kind} ({_where(f)})")
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
    trace (docs/probe.md), the last one reported per process and file."""
    dumps: dict[tuple[str, int, str], tuple[str, int, str, str, int | None]] = {}
    for snap in snapshots:
        for g in snap.gpus:
            for p in g.processes:
                a = p.allocator
                if a is not None and a.history_file:
                    dumps[(g.index, p.pid, a.history_file)] = (g.index, p.pid, p.name, a.history_file,
                                                               a.history_bytes)
    return list(dumps.values())


def _history_section(dumps: Sequence[tuple[str, int, str, str, int | None]], probe_dir: str) -> str:
    out = []
    for gpu, pid, process, name, size in dumps:
        path = os.path.join(probe_dir, name) if probe_dir else name
        where = "" if probe_dir else " in the probe directory (<code>allocator.probe_dir</code>)"
        out.append(f'<p class="alloc-history">Allocation history of pid {pid}'
                   + (f" ({_e(process)})" if process else "") + f" on GPU {_e(gpu)}: "
                   f'<a href="{_e(path)}"><code>{_e(path)}</code></a>'
                   + (f" ({_e(_bytes(size))})" if size is not None else "") + f"{where}; open it in "
                   '<a href="https://pytorch.org/memory_viz">pytorch.org/memory_viz</a> to see the stacks '
                   "that allocated the memory.</p>")
    return "\n".join(out)


def render_report(snapshots: Sequence[Snapshot], findings_with_clearing: Iterable[_Episode],
                  oom_events: Iterable[OomEvent], title: str = "GPU memory post-mortem",
                  triggers: Sequence[tuple[float, str]] = (), probe_dir: str = "") -> str:
    """The report as one HTML string (see write_report)."""
    snapshots = sorted(snapshots, key=lambda s: s.timestamp)
    episodes = sorted(findings_with_clearing,
                      key=lambda fc: (fc[0].first_detected_at, _SEVERITY_RANK.get(fc[0].severity, 3)))
    events = list(oom_events)
    mpl = _matplotlib()
    start = snapshots[0].timestamp if snapshots else min(
        [f.first_detected_at for f, _ in episodes] or [0.0])
    end = snapshots[-1].timestamp if snapshots else start
    gpus = _gpu_series(snapshots)

    body = [f"<h1>{_e(title)}</h1>"]
    if snapshots:
        body.append(f"<p>{len(snapshots)} samples of {len(gpus)} GPU(s) from {_e(_when(start))} to "
                    f"{_e(_when(end))} ({_e(_span(end - start))}). {len(episodes)} finding(s), "
                    f"{len(events)} out-of-memory event(s).</p>")
    else:
        body.append("<p>The trace holds no samples.</p>")
    for t, name in triggers:
        body.append(f"<p class=\"trigger\">Flight recorder trigger: <b>{_e(name)}</b> at "
                    f"{_e(_when(t))} (+{_e(_span(t - start))}; {_e(_span(end - t))} recorded "
                    "after it).</p>")
    if mpl is None:
        body.append('<p class="note">Plots are left out: matplotlib is not installed where this report '
                    "was written (the <code>report</code> extra).</p>")

    body.append("<h2>Findings</h2>")
    if episodes:
        if mpl is not None and snapshots:
            body.append(_img(_timeline_plot(mpl, episodes, start, end), "timeline of findings"))
        body.append(_table(("severity", "kind", "where", "first detected", "cleared", "summary"), (
            (f.severity, f.kind, _where(f), f"{_when(f.first_detected_at)} (+{_span(f.first_detected_at - start)})",
             _when(c) if c is not None else "active at the end", f.summary) for f, c in episodes)))
    else:
        body.append("<p>No findings.</p>")
    body.append(_history_section(_history_dumps(snapshots), probe_dir))

    body.append("<h2>GPU memory</h2>")
    rows = []
    for index, d in gpus.items():
        rows.append((index, _bytes(d["total"][-1]), _bytes(max(d["used"])), _bytes(d["used"][-1]),
                     _bytes(max(d["unattributed"])), _bytes(min(d["free"]))))
    if rows:
        body.append(_table(("GPU", "total", "peak used", "used at the end", "peak unattributed",
                            "least free"), rows, numeric={1, 2, 3, 4, 5}))
    if mpl is not None:
        for index in list(gpus)[:MAX_GPU_PLOTS]:
            body.append(_img(_gpu_plot(mpl, index, gpus[index], events, episodes),
                             f"GPU {index} memory by owner"))

    body.append("<h2>Processes</h2>")
    with_pid = [(f, c) for f, c in episodes if f.pid is not None]
    for i, (f, c) in enumerate(with_pid):
        plot = None
        if mpl is not None and i < MAX_PROCESS_PLOTS and f.pid is not None:
            ts, vs = _process_series(snapshots, f.gpu, f.pid)
            if ts:
                plot = _process_plot(mpl, f, ts, vs, end)
        body.append(_finding_detail(f, c, start, plot))
    for f, c in episodes:
        if f.pid is None:
            body.append(_finding_detail(f, c, start, None))
    summaries = _process_summaries(snapshots)
    if summaries:
        body.append("<h3>All processes seen</h3>")
        # No average rate here: a start-up ramp would dwarf any leak; the findings give rates.
        body.append(_table(("GPU", "pid", "process", "role", "first seen", "first", "last", "peak",
                            "change"), (
            (r["gpu"], r["pid"], r["process"], r["role"], _when(r["t0"]), _bytes(r["first"]),
             _bytes(r["last"]), _bytes(r["peak"]), _bytes(r["last"] - r["first"]))
            for r in summaries[:500]), numeric={5, 6, 7, 8}))

    body.append("<h2>Out-of-memory events</h2>")
    body.append(_oom_section(events))
    body.append("<h2>Advice</h2>")
    body.append(_advice_section(episodes, events))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report(snapshots: Sequence[Snapshot], findings_with_clearing: Iterable[_Episode],
                 oom_events: Iterable[OomEvent], path: str, title: str = "GPU memory post-mortem",
                 triggers: Sequence[tuple[float, str]] = (), probe_dir: str = "") -> None:
    """Write the report to `path` as one self-contained HTML file (temporary file + rename).

    findings_with_clearing: (Finding, cleared_at or None) pairs, as Analyzer.episodes() or
    analyze.replay_episodes() give them. oom_events: OomEvents (from `explain` of the logs,
    and the trace's own). triggers: the flight recorder's (tick time, trigger) marks.
    probe_dir: where the probes' allocation-history dumps are, for their links (else the
    bare file name)."""
    text = render_report(snapshots, findings_with_clearing, oom_events, title, triggers, probe_dir)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


__all__ = ["render_report", "write_report"]
