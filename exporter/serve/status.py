"""The status page at `/`: what a person opening the exporter in a browser wants to know first.
One self-contained HTML page, no script; every value from the host (process names from /proc,
vLLM model names, error messages) is escaped.

Each GPU row says why it is in trouble, with the findings about it and about the vLLM servers
that run on it (a KV cache full, a sleep leak, a lost GPU the same tensor-parallel server spans),
or why not; the last out-of-memory on it stays in view for a day after its finding's hold ends.
One table for the vLLM servers; the findings' processes are those the finding names."""
from __future__ import annotations

from html import escape

from .. import __version__
from ..model import Budget, Finding, GpuAnalysis, GpuSample, KvCache, Snapshot, State, VllmEngineStats
from ..sources import gpu as gpu_backends
from ..units import counted, format_bytes, format_duration

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
    return "no clear trend" if seconds is None else format_duration(seconds)


def _advice(advice: tuple[str, ...]) -> str:
    """On-call reads this page to decide what to do: the finding's advice, one item a line."""
    return "<br>".join(escape(a) for a in advice)


LOADING_SHARE = 0.5  # a server holding less of its budget than this, awake, is still loading


def _loading(budgets: list[Budget], snap: Snapshot | None) -> list[Budget]:
    """The budgets whose server is still loading: it takes its whole budget up front (weights,
    then the KV cache), so awake and holding well under it, it has not finished starting."""
    asleep = {v.endpoint for v in (snap.vllm if snap else ())
              if any(e.sleep_state not in ("", "awake") for e in v.engines)}
    return [b for b in budgets if b.budget_bytes and b.endpoint not in asleep
            and (b.used_bytes or 0) < LOADING_SHARE * b.budget_bytes]


def _related(g: GpuSample, a: GpuAnalysis | None, findings: tuple[Finding, ...]) -> list[tuple[Finding, str]]:
    """The findings that concern a GPU, each with how: its own (""), or through a vLLM server that
    runs on it: a finding about the server (kv_saturation, sleep_leak: no GPU of their own), or
    about another GPU that server also spans (a lost GPU names its servers)."""
    servers = set(a.servers if a is not None else ()) | {
        p.endpoint for p in g.processes if p.role == "vllm" and p.endpoint}
    out = []
    for f in findings:
        if f.gpu == g.index:
            out.append((f, ""))
            continue
        named = sorted(servers & ({f.endpoint} | {str(v) for k, v in f.evidence
                                                  if k.startswith("server_") and k.endswith("_endpoint")}))
        if named:
            where = f" on GPU {f.gpu}" if f.gpu is not None else ""
            out.append((f, f"{where} of vLLM {', '.join(named)}, which runs here"))
    return out


def _last_oom(g: GpuSample, recent: tuple[tuple[Finding, float | None], ...], now: float | None) -> str:
    """The last out-of-memory finding on this GPU, once its hold is over: when, and of what class."""
    for f, cleared in recent:
        if f.gpu == g.index and cleared is not None and now is not None:
            ev = dict(f.evidence)
            what = str(ev["class"]) if "class" in ev else "kernel OOM kill" if "kernel_oom_kills" in ev else "?"
            return f"; last out-of-memory {_ago(now - f.first_detected_at)} ({what}): see Recent out-of-memory"
    return ""


def _ago(seconds: float) -> str:
    return f"{format_duration(seconds)} ago"


def _verdict(g: GpuSample, a: GpuAnalysis | None, budgets: list[Budget], related: list[tuple[Finding, str]],
             snap: Snapshot | None, last_oom: str = "") -> str:
    """Why the GPU is in trouble (its findings, and those of the servers on it), or why not, in
    its numbers: a vLLM server takes its whole budget up front, so a GPU far above 80 % used can
    be exactly as planned."""
    if related:
        order = {"critical": 0, "warning": 1}
        kinds = ", ".join(f"{f.kind} ({f.severity}){how}"
                          for f, how in sorted(related, key=lambda fh: order.get(fh[0].severity, 2)))
        return f'<span class="bad">{escape(kinds)}</span>: see Findings'
    if not g.up:
        return f'<span class="bad">{escape(g.error or "down")}</span>'
    if a is None or a.utilization_ratio is None:
        return "not known yet"
    used = f"{a.utilization_ratio:.0%} used"
    planned = [b for b in budgets if b.budget_bytes is not None]
    if not budgets:
        return escape(f"no finding: {used}, no vLLM server on this GPU{last_oom}")
    if not planned:
        return escape(f"no finding: {used}; the vLLM budget is not known yet, so all of it counts as planned"
                      f"{last_oom}")
    loading = _loading(planned, snap)
    if loading:
        return escape(f"no finding: {used}; loading: " + ", ".join(
            f"vLLM {b.endpoint} holds {format_bytes(b.used_bytes)} of its {format_bytes(b.budget_bytes)} budget so far"
            for b in loading) + last_oom)
    within = sum(min(b.used_bytes or 0, b.budget_bytes or 0) for b in planned)
    budget = sum(b.budget_bytes or 0 for b in planned)
    beyond = a.beyond_budget_bytes
    return escape(f"no finding: {used}; {format_bytes(within)} of it is vLLM inside its budget of "
                  f"{format_bytes(budget)} (taken up front, as planned), {format_bytes(beyond)} beyond it{last_oom}")


def _servers(state: State) -> list[tuple[object, ...]]:
    """One row per vLLM server: its model, state, budget per GPU against what it uses, KV cache
    use (share, tokens, bytes per GPU), requests running and waiting, preemptions so far."""
    snap, analysis = state.snapshot, state.analysis
    rows: list[tuple[object, ...]] = []
    for v in snap.vllm if snap else ():
        budgets = [b for b in (analysis.budgets if analysis else ()) if b.endpoint == v.endpoint]
        caches = [k for k in (analysis.kv_caches if analysis else ()) if k.endpoint == v.endpoint]
        models = ", ".join(sorted({e.model for e in v.engines if e.model})) or "?"
        config = v.cache_config
        if budgets and any(b.budget_bytes is not None for b in budgets):
            how = (f" (gpu_memory_utilization {config.gpu_memory_utilization:g})"
                   if config is not None and config.gpu_memory_utilization is not None
                   and budgets[0].basis == "gpu_memory_utilization" else
                   " (--kv-cache-memory + the rest)" if budgets[0].basis == "kv_cache_memory" else "")
            budget = "; ".join(f"GPU {b.gpu}: {format_bytes(b.used_bytes)} of {format_bytes(b.budget_bytes)}"
                               for b in budgets) + how
        elif budgets:
            budget = "not known (no cache_config_info yet)"
        elif v.processes and snap is not None and not snap.gpus:
            held = sum(p.host_rss_bytes or 0 for p in v.processes)
            budget = f"host memory (vLLM's CPU backend): its processes hold {format_bytes(held)}"
        elif snap is not None and snap.gpus:
            budget = "no GPU process found"
        else:  # no GPU source (gpu.backend: none), or a server elsewhere: nothing here to weigh
            budget = "not known: no GPU here, and none of its processes found on this host"
        by_engine = {(k.model, k.engine): k for k in caches}
        where = "per GPU" if budgets or (snap is not None and snap.gpus) else "of host memory"
        kv = "; ".join(_kv(e.kv_cache_usage_ratio, by_engine.get((e.model, e.engine)), where)
                       for e in v.engines) or "?"
        state_ = _updown(v.up, v.error_kind) + (" loading" if v.up and _loading(budgets, snap) else "")
        if v.up and v.page_age_seconds >= 1:  # an idle server's page is read less often (vllm_idle.py)
            state_ += escape(f" (idle: page read {v.page_age_seconds:.0f} s ago)")
        rows.append((escape(v.endpoint), escape(models), state_, escape(budget), escape(kv) if v.up else "",
                     *(_total(v.engines, name) if v.up else ""
                       for name in ("requests_running", "requests_waiting", "preemptions_total"))))
    return rows


def _kv(ratio: float | None, k: KvCache | None, where: str = "per GPU") -> str:
    """One engine's KV cache: the share in use, the tokens of its capacity, its bytes (per GPU,
    or of host memory on vLLM's CPU backend)."""
    ratio = k.usage_ratio if k is not None and k.usage_ratio is not None else ratio
    text = "?" if ratio is None else f"{ratio:.0%}"
    if k is not None and k.capacity_tokens:
        text += (f" ({k.used_tokens:,} of {k.capacity_tokens:,} tokens)" if k.used_tokens is not None
                 else f" of {k.capacity_tokens:,} tokens")
    if k is not None and k.capacity_bytes:
        text += f", {format_bytes(k.capacity_bytes)} {where}"
    return text


def _total(engines: tuple[VllmEngineStats, ...], name: str) -> str:
    values = [getattr(e, name) for e in engines if getattr(e, name) is not None]
    return f"{sum(values):g}" if values else ""


def _named_processes(f: Finding) -> str:
    """The processes a finding concerns: its own, else those its evidence names (contention and
    pressure name every holder, an exited server's finding the process that exited)."""
    if f.pid is not None:
        return f"{f.pid} {f.process}"
    ev = dict(f.evidence)
    named = []
    for i in range(1, 1000):
        pid = ev.get(f"process_{i}_pid")
        if pid is None:
            break
        parent = ev.get(f"process_{i}_started_by")
        named.append(f"{pid} {ev.get(f'process_{i}_name') or '?'}{f' (started by {parent})' if parent else ''}")
    if "exited_pid" in ev:
        named.append(f"{ev['exited_pid']} {ev.get('exited_process') or '?'} (exited)")
    return "; ".join(named) or f.process


def _no_gpu(snap: Snapshot | None, samples: int) -> str:
    """Why the GPU table is empty: nothing sampled yet, or the GPU library is unavailable."""
    if snap is None:
        return "No GPU sampled yet."
    names = {b.name: b for b in gpu_backends.BACKENDS}
    down = [s for s in snap.sources if s.source in names and not s.up]
    if down:
        s = down[0]
        b = names[s.source]
        return (f"No GPU could be read in {counted(samples, 'sample')}: the GPU library ({b.title}, "
                f"gpu.backend {b.name}) is unavailable ({s.error or 'unknown error'}). Is the driver "
                "installed and, in a container, exposed to it? It is retried with back-off: see Sources "
                "and the log.")
    if any(s.source == gpu_backends.NoGpuSource.name for s in snap.sources):
        return ("No GPU is read on this host (gpu.backend none): its memory is the host's, as on vLLM's "
                "CPU backend; see vLLM servers and Findings.")
    return "The GPU library answered with no GPU on this host."


def _recent_ooms(state: State) -> list[tuple[object, ...]]:
    analysis = state.analysis
    if analysis is None:
        return []
    now = analysis.timestamp
    return [(escape(_ago(now - f.first_detected_at)), escape(f.gpu if f.gpu is not None else "host"),
             escape(str(dict(f.evidence).get("class", "kernel OOM kill" if "kernel_oom_kills" in dict(f.evidence)
                                              else "?"))),
             escape(f.summary), "active" if cleared is None else escape(f"cleared {_ago(now - cleared)}"))
            for f, cleared in analysis.recent_ooms]


REFRESH_SECONDS = 10


def render(state: State, host: str, sample_age: float | None, stale_after: float) -> str:
    """`host`: how the host is sampled ("real", or the scenario and its clock)."""
    snap, analysis = state.snapshot, state.analysis
    if sample_age is None:
        freshness = '<span class="bad">no sample yet</span>'
    else:
        cls = "ok" if sample_age <= stale_after else "bad"
        freshness = f'<span class="{cls}">{sample_age:.1f} s ago</span> ({state.samples_total} samples)'
    driver = f", driver {escape(snap.driver_version)}" if snap and snap.driver_version else ""
    gpu_analysis = {g.gpu: g for g in analysis.gpus} if analysis else {}
    active = analysis.findings if analysis else ()
    recent = analysis.recent_ooms if analysis else ()
    now = analysis.timestamp if analysis else None
    gpus: list[tuple[object, ...]] = []
    for g in snap.gpus if snap else ():
        a = gpu_analysis.get(g.index)
        use = (f"{format_bytes(g.used_bytes)} of {format_bytes(g.total_bytes)}"
               + (f" ({g.used_bytes / g.total_bytes:.0%})" if g.used_bytes is not None and g.total_bytes else ""))
        admission = "unknown" if a is None else "open" if a.admission_open else (
            '<span class="bad">closed</span>' + (f" ({escape(a.closed_because)})" if a.closed_because else ""))
        budgets = [b for b in (analysis.budgets if analysis else ()) if b.uuid == g.uuid]
        gpus.append((escape(g.index), escape(g.name), _updown(g.up, g.error),
                     escape(use) if g.up else "", escape(format_bytes(g.free_bytes)) if g.up else "",
                     admission, escape(_duration(a.time_to_full_seconds)) if a and g.up else "", len(g.processes),
                     _verdict(g, a, budgets, _related(g, a, active), snap, _last_oom(g, recent, now))))
    findings: list[tuple[object, ...]] = [(escape(f.severity), escape(f.kind), escape(f.gpu or ""),
                                           escape(_named_processes(f)), escape(f.summary), _advice(f.advice))
                                          for f in active]
    # `gpu.backend: none`'s source is named "none": "none up" would read as nothing working.
    sources: list[tuple[object, ...]] = [(escape("gpu: none (gpu.backend)" if s.source == gpu_backends.NoGpuSource.name
                                                 else s.source), _updown(s.up, s.error) + (
        f' <span class="bad">{escape(s.error)}</span>' if s.up and s.error else ""))
                                         for s in (snap.sources if snap else ())]
    sources += [(escape(f"vllm {v.endpoint}"), _updown(v.up, v.error_kind)) for v in (snap.vllm if snap else ())]
    links = "".join(f'<li><a href="{path}">/{path}</a> &mdash; {escape(what)}</li>' for path, what in _LINKS)
    ooms = _recent_ooms(state)
    # It reloads itself: on-call leaves it open beside the pager, and reads it as it is now.
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>gpu-memory-exporter</title>'
            f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
            f"<style>{_STYLE}</style></head><body><h1>gpu-memory-exporter {escape(__version__)}</h1>"
            f"<p>Host: {escape(host)}{driver}. Last sample: {freshness}. "
            f"This page reloads every {REFRESH_SECONDS} s.</p>"
            "<h2>GPUs</h2>" + _table(("GPU", "name", "state", "used", "headroom (free)", "admission",
                                      "full in", "processes", "in trouble?"), gpus,
                                     _no_gpu(snap, state.samples_total))
            + "<h2>vLLM servers</h2>" + _table(("endpoint", "model", "state", "memory used of its budget",
                                                "KV cache in use", "running", "waiting", "preempted (total)"),
                                               _servers(state), "No vLLM endpoint configured.")
            + "<h2>Findings</h2>" + _table(("severity", "kind", "GPU", "process", "why", "what to change"), findings,
                                           "No active findings.")
            + ("<h2>Recent out-of-memory</h2>" + _table(
                ("when", "GPU", "class", "what", "finding"), ooms, "") if ooms else "")
            + "<h2>Sources</h2>" + _table(("source", "state"), sources, "No source has reported yet.")
            + f"<h2>Endpoints</h2><ul>{links}</ul></body></html>\n")
