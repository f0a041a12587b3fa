"""The report's charts: matplotlib (the `report` extra), imported only here, drawn with the Agg
canvas into PNGs that the page embeds as data URIs.

Each chart is built as a Figure first (so what it shows can be checked), then turned into a
PNG. Every chart marks the flight recorder's trigger(s), so each one shows where the incident
was declared: a purple dash-dot line per trigger, named in the legend.
"""
from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from itertools import pairwise
from statistics import median
from typing import TYPE_CHECKING, Any

from ..model import Episode, Finding, OomEvent
from ..units import GiB, MiB
from .tracerow import clean_text

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (Figure, FigureCanvasAgg, matplotlib.dates), as load() returns them
    Mpl = tuple[type[Figure], type[FigureCanvasAgg], ModuleType]

# (tick time, `+`-joined triggers), as trace.Trace gives them
Triggers = Sequence[tuple[float, str]]
# The plots' Axes: they are given datetimes, which matplotlib converts through its units
# registry; its type hints admit only floats and arrays there, so the axes are left untyped.
_DateAxes = Any

MAX_PLOT_POINTS = 2000  # per series: more does not show on a 1000-pixel plot
GAP_STEPS = 5  # a step this many times the usual one is a gap in the trace, drawn as one
SEVERITY_COLOUR = {"critical": "#c62828", "warning": "#ef8f00", "info": "#1565c0"}
TRIGGER_COLOUR = "#6a1b9a"
TRIGGER_GID = "trigger"  # the trigger lines' id in a Figure, for whoever checks one


def load() -> Mpl | None:
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


def png(mpl: Mpl, fig: Figure) -> str:
    """The figure as a data URI."""
    _, canvas_class, _ = mpl
    canvas_class(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def rate_text(bytes_per_second: float) -> str:
    return f"{float(bytes_per_second) * 60 / MiB:.1f} MiB/min"


def _dt(ts: Iterable[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t, timezone.utc) for t in ts]


def _time_axis(mpl: Mpl, ax: _DateAxes) -> None:
    dates = mpl[2]
    ax.xaxis.set_major_formatter(dates.DateFormatter("%H:%M", tz=timezone.utc))
    ax.set_xlabel("time (UTC)")
    ax.grid(True, alpha=0.3)


def _legend_below(ax: _DateAxes) -> None:
    """The legend under the time axis, outside the plot: inside it, it hid the start-up ramp
    (bottom left) or the growth it explains. png() saves the whole figure, legend included."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)


def _mark_triggers(ax: _DateAxes, triggers: Triggers) -> None:
    for i, (t, name) in enumerate(triggers):
        line = ax.axvline(_dt([t])[0], color=TRIGGER_COLOUR, linestyle="-.", linewidth=1.6,
                          label=f"trigger: {clean_text(name)}" if i < 3 else None)
        line.set_gid(TRIGGER_GID)


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """At most MAX_PLOT_POINTS points, with a NaN wherever the trace has a gap: the daemon was
    down (or the recorder kept nothing) there, and a line drawn across it would show memory
    nobody measured."""
    if len(xs) > MAX_PLOT_POINTS:
        stride = -(-len(xs) // MAX_PLOT_POINTS)
        xs, ys = xs[::stride], ys[::stride]
    if len(xs) < 3:
        return list(xs), list(ys)
    gap = GAP_STEPS * median(b - a for a, b in pairwise(xs))
    out_x, out_y = [xs[0]], [ys[0]]
    for (a, b), y in zip(pairwise(xs), ys[1:], strict=True):
        if b - a > gap:
            out_x.append((a + b) / 2)
            out_y.append(float("nan"))
        out_x.append(b)
        out_y.append(y)
    return out_x, out_y


def _where(f: Finding) -> str:
    parts = [f"GPU {f.gpu}" if f.gpu is not None else ""]
    if f.pid is not None:
        parts.append(f"pid {f.pid}" + (f" ({f.process})" if f.process else ""))
    return clean_text(", ".join(p for p in parts + [f.endpoint] if p))


def timeline(mpl: Mpl, episodes: Sequence[Episode], start: float, end: float,
             triggers: Triggers = ()) -> Figure:
    Figure = mpl[0]
    shown = episodes[:40]
    fig = Figure(figsize=(10, 0.45 * len(shown) + 1.2))
    ax: _DateAxes = fig.add_subplot()
    for i, (f, cleared) in enumerate((e.finding, e.cleared_at) for e in shown):
        a, b = f.first_detected_at, cleared if cleared is not None else end
        # Date axes count days: a bar of at least 1/400 of the range so a short one shows.
        ax.barh(i, max(b - a, (end - start) / 400) / 86400, left=mpl[2].date2num(_dt([a])[0]),
                color=SEVERITY_COLOUR.get(f.severity, "#777"), height=0.6)
        ax.text(_dt([a])[0], i, f" {f.kind} {_where(f)}", va="center", fontsize=8)
    _mark_triggers(ax, triggers)
    ax.set_yticks([])
    ax.set_ylim(-0.7, len(shown) - 0.3)
    ax.invert_yaxis()
    ax.set_xlim(_dt([start])[0], _dt([end])[0])
    ax.set_title("Findings: raised to cleared (red critical, orange warning)")
    if triggers:
        ax.legend(loc="best", fontsize=8, framealpha=0.8)
    _time_axis(mpl, ax)
    return fig


def gpu(mpl: Mpl, index: str, t: list[float], parts: Sequence[Sequence[int]],
        ooms: Iterable[OomEvent], findings: Iterable[Episode], triggers: Triggers = ()) -> Figure:
    """The GPU's memory stacked by owner: parts are (serving, other, unattributed, free)."""
    Figure = mpl[0]
    fig = Figure(figsize=(10, 3.6))
    ax: _DateAxes = fig.add_subplot()
    thinned = [_thin(t, [v / GiB for v in part]) for part in parts]
    ax.stackplot(_dt(thinned[0][0]), *[y for _, y in thinned],
                 labels=["serving (vLLM) processes", "other processes",
                         "unattributed (no live process)", "free"],
                 colors=["#1976d2", "#ffa726", "#8e24aa", "#c8e6c9"], alpha=0.9)
    for ev in ooms:
        if ev.timestamp is not None and ev.gpu in (None, index) and t[0] <= ev.timestamp <= t[-1]:
            ax.axvline(_dt([ev.timestamp])[0], color="#c62828", linestyle="--", linewidth=1.2)
    for f in (e.finding for e in findings):
        if f.gpu == index:
            ax.axvline(_dt([f.first_detected_at])[0], color=SEVERITY_COLOUR.get(f.severity, "#777"),
                       linestyle=":", linewidth=1)
    _mark_triggers(ax, triggers)
    ax.set_ylabel("GiB")
    ax.set_title(f"GPU {index}: memory by owner (dotted: finding raised, dashed red: OOM)")
    _legend_below(ax)
    marks = [at for at, _ in triggers]
    ax.set_xlim(_dt([min([t[0], *marks])])[0], _dt([max([t[-1], *marks])])[0])
    _time_axis(mpl, ax)
    return fig


def growth_start(ts: Sequence[float], vs: Sequence[int], f: Finding) -> float:
    """Where the finding's growth is drawn from: its window's start, or later, after the last
    jump between two samples bigger than all the growth it found (a start-up, a model loaded:
    the window may reach back before them, which the detector's models set apart)."""
    ev = dict(f.evidence)
    window = ev.get("window_seconds")
    window = float(window) if isinstance(window, (int, float)) and window > 0 else 3600.0
    start = f.first_detected_at - window
    growth = ev.get("growth_bytes")
    if isinstance(growth, (int, float)) and growth > 0:
        for (t, v), (t2, v2) in pairwise(zip(ts, vs, strict=True)):
            if start <= t and t2 <= f.first_detected_at and abs(v2 - v) > growth:
                start = t2
    return start


def fitted_line(ts: list[float], vs: list[int], f: Finding, end: float,
                since: float | None = None) -> tuple[float, tuple[float, float], tuple[float, float]] | None:
    """The detector's growth line: its slope, through the samples of its growth before
    detection (intercept = median residual), drawn from the growth's start (`since`, computed
    when not given) to the end. (slope, (t_start, t_end), (v_start, v_end)), or None without a
    slope in the evidence."""
    slope = dict(f.evidence).get("slope_bytes_per_second")
    if not isinstance(slope, (int, float)) or not ts:
        return None
    t0 = f.first_detected_at
    since = growth_start(ts, vs, f) if since is None else since
    inside = [(t, v) for t, v in zip(ts, vs, strict=True) if since <= t <= t0] or list(zip(ts, vs, strict=True))
    level = median(v - slope * (t - t0) for t, v in inside)
    a = max(ts[0], since)
    return slope, (a, end), (level + slope * (a - t0), level + slope * (end - t0))


def process(mpl: Mpl, f: Finding, ts: list[float], vs: list[int], end: float,
            triggers: Triggers = ()) -> Figure:
    """One process's memory with the detector's fitted growth and the moment of detection."""
    Figure = mpl[0]
    fig = Figure(figsize=(10, 3.2))
    ax: _DateAxes = fig.add_subplot()
    what = "GPU memory" if f.gpu is not None else "host RSS"
    xs, ys = _thin(ts, [v / GiB for v in vs])
    ax.plot(_dt(xs), ys, color="#1976d2", linewidth=1, label=what)
    since = growth_start(ts, vs, f)
    line = fitted_line(ts, vs, f, end, since)
    if line is not None:
        slope, (a, b), (va, vb) = line
        ax.plot(_dt([a, b]), [va / GiB, vb / GiB], color="#c62828", linewidth=2,
                label=f"fitted growth {rate_text(slope)}")
    ax.axvline(_dt([f.first_detected_at])[0], color="#c62828", linestyle="--", linewidth=1)
    at = min(range(len(ts)), key=lambda i: abs(ts[i] - f.first_detected_at))
    detected = datetime.fromtimestamp(f.first_detected_at, timezone.utc).strftime("%H:%M:%S")
    ax.plot(_dt([ts[at]]), [vs[at] / GiB], marker="v", markersize=10, color="#c62828",
            linestyle="none", label=f"{f.kind} first detected {detected} UTC")
    _mark_triggers(ax, triggers)
    # Zoom on the growth: a start-up ramp of tens of GiB would flatten a leak of MiB/min.
    recent = [v / GiB for t, v in zip(ts, vs, strict=True) if t >= since] or [v / GiB for v in vs]
    low, high = min(recent), max(recent)
    if line is not None:
        low, high = min(low, va / GiB, vb / GiB), max(high, va / GiB, vb / GiB)
    pad = max((high - low) * 0.15, 0.01)
    zoomed = low - pad > min(ys)
    ax.set_ylim(low - pad, high + pad)
    ax.set_ylabel("GiB")
    ax.set_title(f"pid {f.pid} {clean_text(f.process)} on {'GPU ' + f.gpu if f.gpu is not None else 'host'}: "
                 f"{what}" + (" (y axis zoomed on the growth)" if zoomed else ""))
    _legend_below(ax)
    _time_axis(mpl, ax)
    return fig


__all__ = ["TRIGGER_GID", "fitted_line", "gpu", "load", "png", "process",
           "rate_text", "timeline"]
