"""The status page at `/`: what a person opening the exporter in a browser wants to know first.
One self-contained HTML page, no script; every value from the host (process names from /proc,
vLLM model names, error messages) is escaped."""
from __future__ import annotations

from html import escape

from .. import __version__
from ..model import Budget, Finding, GpuAnalysis, GpuSample, Snapshot, State
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
        return "no clear trend"
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


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


LOADING_SHARE = 0.5  # a server holding less of its budget than this, awake, is still loading


def _loading(budgets: list[Budget], snap: Snapshot | None) -> list[Budget]:
    """The budgets whose server is still loading: it takes its whole budget up front (weights,
    then the KV cache), so awake and holding well under it, it has not finished starting."""
    asleep = {v.endpoint for v in (snap.vllm if snap else ())
              if any(e.sleep_state not in ("", "awake") for e in v.engines)}
    return [b for b in budgets if b.budget_bytes and b.endpoint not in asleep
            and (b.used_bytes or 0) < LOADING_SHARE * b.budget_bytes]


def _verdict(g: GpuSample, a: GpuAnalysis | None, budgets: list[Budget], findings: list[Finding],
             snap: Snapshot | None) -> str:
    """Why the GPU is in trouble (its findings), or why not, in its numbers: a vLLM server takes
    its whole budget up front, so a GPU far above 80 % used can be exactly as planned."""
    if findings:
        order = {"critical": 0, "warning": 1}
        kinds = ", ".join(f"{f.kind} ({f.severity})" for f in sorted(findings, key=lambda f: order.get(f.severity, 2)))
        return f'<span class="bad">{escape(kinds)}</span>: see Findings'
    if not g.up:
        return f'<span class="bad">{escape(g.error or "down")}</span>'
    if a is None or a.utilization_ratio is None:
        return "not known yet"
    used = f"{a.utilization_ratio:.0%} used"
    planned = [b for b in budgets if b.budget_bytes is not None]
    if not budgets:
        return escape(f"no finding: {used}, no vLLM server on this GPU")
    if not planned:
        return escape(f"no finding: {used}; the vLLM budget is not known yet, so all of it counts as planned")
    loading = _loading(planned, snap)
    if loading:
        return escape(f"no finding: {used}; loading: " + ", ".join(
            f"vLLM {b.endpoint} holds {_gib(b.used_bytes)} of its {_gib(b.budget_bytes)} budget so far"
            for b in loading))
    within = sum(min(b.used_bytes or 0, b.budget_bytes or 0) for b in planned)
    budget = sum(b.budget_bytes or 0 for b in planned)
    beyond = a.beyond_budget_bytes
    return escape(f"no finding: {used}; {_gib(within)} of it is vLLM inside its budget of {_gib(budget)} "
                  f"(taken up front, as planned), {_gib(beyond)} beyond it")


def _servers(state: State) -> list[tuple[object, ...]]:
    """One row per vLLM server: its model, budget per GPU against what it uses, KV cache use and
    requests."""
    snap, analysis = state.snapshot, state.analysis
    rows: list[tuple[object, ...]] = []
    for v in snap.vllm if snap else ():
        budgets = [b for b in (analysis.budgets if analysis else ()) if b.endpoint == v.endpoint]
        caches = [k for k in (analysis.kv_caches if analysis else ()) if k.endpoint == v.endpoint]
        models = ", ".join(sorted({e.model for e in v.engines if e.model})) or "?"
        config = v.cache_config
        if budgets and any(b.budget_bytes is not None for b in budgets):
            how = (f" ({config.gpu_memory_utilization:g} of the GPU)"
                   if config is not None and config.gpu_memory_utilization is not None
                   and budgets[0].basis == "gpu_memory_utilization" else
                   " (--kv-cache-memory + the rest)" if budgets[0].basis == "kv_cache_memory" else "")
            budget = "; ".join(f"GPU {b.gpu}: {_gib(b.used_bytes)} of {_gib(b.budget_bytes)}" for b in budgets) + how
        elif budgets:
            budget = "not known (no cache_config_info yet)"
        else:
            budget = "no GPU process found"
        kv = "; ".join(
            (f"{k.usage_ratio:.0%}" if k.usage_ratio is not None else "?")
            + (f" of {k.capacity_tokens:,} tokens" if k.capacity_tokens else "")
            + (f" ({_gib(k.capacity_bytes)} per GPU)" if k.capacity_bytes else "")
            for k in caches) or "?"
        running = sum(e.requests_running or 0 for e in v.engines)
        waiting = sum(e.requests_waiting or 0 for e in v.engines)
        state_ = _updown(v.up, v.error_kind) + (" loading" if v.up and _loading(budgets, snap) else "")
        rows.append((escape(v.endpoint), escape(models), state_, escape(budget),
                     escape(kv), escape(f"{running:.0f} running, {waiting:.0f} waiting") if v.up else ""))
    return rows


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
        budgets = [b for b in (analysis.budgets if analysis else ()) if b.uuid == g.uuid]
        on_gpu = [f for f in (analysis.findings if analysis else ()) if f.gpu == g.index]
        gpus.append((escape(g.index), escape(g.name), _updown(g.up, g.error),
                     escape(use) if g.up else "", escape(format_bytes(g.free_bytes)) if g.up else "",
                     admission, escape(_duration(a.time_to_full_seconds)) if a and g.up else "", len(g.processes),
                     _verdict(g, a, budgets, on_gpu, snap)))
    findings: list[tuple[object, ...]] = [(escape(f.severity), escape(f.kind), escape(f.gpu or ""),
                 escape(f"{f.pid} {f.process}" if f.pid is not None else f.process), escape(f.summary),
                 _advice(f.advice))
                for f in (analysis.findings if analysis else ())]
    sources: list[tuple[object, ...]] = [(escape(s.source), _updown(s.up, s.error) + (
        f' <span class="bad">{escape(s.error)}</span>' if s.up and s.error else ""))
                                         for s in (snap.sources if snap else ())]
    sources += [(escape(f"vllm {v.endpoint}"), _updown(v.up, v.error_kind)) for v in (snap.vllm if snap else ())]
    links = "".join(f'<li><a href="{path}">/{path}</a> &mdash; {escape(what)}</li>' for path, what in _LINKS)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>gpu-memory-exporter</title>'
            f"<style>{_STYLE}</style></head><body><h1>gpu-memory-exporter {escape(__version__)}</h1>"
            f"<p>Host: {escape(host)}{driver}. Last sample: {freshness}.</p>"
            "<h2>GPUs</h2>" + _table(("GPU", "name", "state", "used", "headroom (free)", "admission",
                                      "full in", "processes", "in trouble?"), gpus, "No GPU sampled yet.")
            + "<h2>vLLM servers</h2>" + _table(("endpoint", "model", "state", "memory used of its budget",
                                                "KV cache in use", "requests"), _servers(state),
                                               "No vLLM server configured.")
            + "<h2>Findings</h2>" + _table(("severity", "kind", "GPU", "process", "why", "what to change"), findings,
                                           "No active findings.")
            + "<h2>vLLM servers</h2>" + _table(("endpoint", "state", "model", "KV cache in use", "running",
                                                "waiting", "preempted (total)"), _vllm_rows(state),
                                               "No vLLM endpoint configured.")
            + "<h2>Sources</h2>" + _table(("source", "state"), sources, "No source has reported yet.")
            + f"<h2>Endpoints</h2><ul>{links}</ul></body></html>\n")
