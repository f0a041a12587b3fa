"""The status page at `/`: what a person opening the exporter in a browser wants to know first.
One self-contained HTML page, no script; every value from the host (process names from /proc,
vLLM model names, error messages) is escaped."""
from __future__ import annotations

from html import escape

from .. import __version__
from ..model import State
from ..units import format_bytes

_STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:70em}table{border-collapse:collapse;margin:.5em 0}"
          "th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left}.bad{color:#b00}.ok{color:#070}")
_LINKS = (("metrics", "Prometheus metrics"), ("healthz", "200, or 503 when the last sample is stale"),
          ("admission", "200, or 503 while a GPU's admission is closed"),
          ("api/findings", "active findings as JSON"))


def _table(headers: tuple[str, ...], rows: list[tuple[object, ...]], empty: str) -> str:
    if not rows:
        return f"<p>{escape(empty)}</p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _updown(up: bool, why: str = "") -> str:
    return '<span class="ok">up</span>' if up else f'<span class="bad">down</span> {escape(why)}'


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "not growing"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _count(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def _kv_use(ratio: float | None, used_tokens: int | None, capacity_tokens: int | None) -> str:
    if ratio is None:
        return ""
    tokens = f" ({used_tokens:,} of {capacity_tokens:,} tokens)" if used_tokens is not None and capacity_tokens else ""
    return f"{ratio:.0%}{tokens}"


def _vllm_rows(state: State) -> list[tuple[object, ...]]:
    """One row per engine of each vLLM server: what fills its KV cache and what waits for it."""
    caches = {(k.endpoint, k.model, k.engine): k for k in (state.analysis.kv_caches if state.analysis else ())}
    rows: list[tuple[object, ...]] = []
    for v in state.snapshot.vllm if state.snapshot else ():
        if not v.engines:
            rows.append((escape(v.endpoint), _updown(v.up, v.error_kind), "", "", "", "", ""))
        for e in v.engines:
            k = caches.get((v.endpoint, e.model, e.engine))
            rows.append((escape(v.endpoint), _updown(v.up, v.error_kind), escape(e.model),
                         escape(_kv_use(e.kv_cache_usage_ratio, k.used_tokens if k else None,
                                        k.capacity_tokens if k else None)),
                         _count(e.requests_running), _count(e.requests_waiting), _count(e.preemptions_total)))
    return rows


def _advice(advice: tuple[str, ...]) -> str:
    """On-call reads this page to decide what to do: the finding's advice, one item a line."""
    return "<br>".join(escape(a) for a in advice)


def render(state: State, host: str, sample_age: float | None, stale_after: float) -> str:
    """`host`: how the host is sampled ("real", or "simulated: scenario NAME")."""
    snap, analysis = state.snapshot, state.analysis
    if sample_age is None:
        freshness = '<span class="bad">no sample yet</span>'
    else:
        cls = "ok" if sample_age <= stale_after else "bad"
        freshness = f'<span class="{cls}">{sample_age:.1f} s ago</span> ({state.samples_total} samples)'
    driver = f", driver {escape(snap.driver_version)}" if snap and snap.driver_version else ""
    gpu_analysis = {g.gpu: g for g in analysis.gpus} if analysis else {}
    gpus: list[tuple[object, ...]] = []
    for g in snap.gpus if snap else ():
        a = gpu_analysis.get(g.index)
        use = (f"{format_bytes(g.used_bytes)} of {format_bytes(g.total_bytes)}"
               + (f" ({g.used_bytes / g.total_bytes:.0%})" if g.used_bytes is not None and g.total_bytes else ""))
        admission = "unknown" if a is None else ("open" if a.admission_open else '<span class="bad">closed</span>')
        gpus.append((escape(g.index), escape(g.name), _updown(g.up, g.error),
                     escape(use) if g.up else "", escape(format_bytes(g.free_bytes)) if g.up else "",
                     admission, escape(_duration(a.time_to_full_seconds)) if a else "", len(g.processes)))
    findings: list[tuple[object, ...]] = [(escape(f.severity), escape(f.kind), escape(f.gpu or ""),
                 escape(f"{f.pid} {f.process}" if f.pid is not None else f.process), escape(f.summary),
                 _advice(f.advice))
                for f in (analysis.findings if analysis else ())]
    sources: list[tuple[object, ...]] = [(escape(s.source), _updown(s.up, s.error))
                                         for s in (snap.sources if snap else ())]
    sources += [(escape(f"vllm {v.endpoint}"), _updown(v.up, v.error_kind)) for v in (snap.vllm if snap else ())]
    links = "".join(f'<li><a href="{path}">/{path}</a> &mdash; {escape(what)}</li>' for path, what in _LINKS)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>gpu-memory-exporter</title>'
            f"<style>{_STYLE}</style></head><body><h1>gpu-memory-exporter {escape(__version__)}</h1>"
            f"<p>Host: {escape(host)}{driver}. Last sample: {freshness}.</p>"
            "<h2>GPUs</h2>" + _table(("GPU", "name", "state", "used", "headroom (free)", "admission",
                                      "full in", "processes"), gpus, "No GPU sampled yet.")
            + "<h2>Findings</h2>" + _table(("severity", "kind", "GPU", "process", "why", "what to change"), findings,
                                           "No active findings.")
            + "<h2>vLLM servers</h2>" + _table(("endpoint", "state", "model", "KV cache in use", "running",
                                                "waiting", "preempted (total)"), _vllm_rows(state),
                                               "No vLLM endpoint configured.")
            + "<h2>Sources</h2>" + _table(("source", "state"), sources, "No source has reported yet.")
            + f"<h2>Endpoints</h2><ul>{links}</ul></body></html>\n")
